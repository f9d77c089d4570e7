"""Weight-only kernels for River's exit layers and exit head, chosen per shape by measurement.

``kernels`` holds the strategy objects (one per kernel) and the config names that select them;
``autotune`` measures which kernel is fastest for a shape on the machine at hand.
"""

from .autotune import KernelTuner, default_tuner, last_level_cache_bytes, machine_id
from .kernels import (
    BACKENDS,
    KERNELS,
    CastLinear,
    CastMemo,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    KernelChoice,
    KernelPlan,
    WeightOnlyKernel,
    fast_kernel_fraction,
    get_backend,
    kernel_name,
    linear_weight_bytes,
    shape_key,
)

__all__ = [
    "BACKENDS", "KERNELS", "CastLinear", "CastMemo", "Int4WeightOnlyLinear", "Int8WeightOnlyLinear", "KernelChoice",
    "KernelPlan", "KernelTuner", "WeightOnlyKernel", "default_tuner", "fast_kernel_fraction", "get_backend", "kernel_name",
    "last_level_cache_bytes", "linear_weight_bytes", "machine_id", "shape_key",
]
