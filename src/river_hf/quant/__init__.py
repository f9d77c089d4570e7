"""Every Linear kernel of river-hf, and the one tuner that chooses between them by measurement.

``kernels`` holds the weight-only kernels of the exit layers and exit head (one registered class
each, in the one table ``registry.KERNELS``; ``modules`` and ``external`` the modules they build,
each naming its kernel and counting its bytes) and the config names that select them; ``choice``
which kernel each Linear gets (``KernelChoice``, ``KernelPlan``); ``dense`` the fp32 modes for
multi-row calls of dense Linears (``SmallBatchLinear``, ``PrepackedLinear``: lossless mode's
verify, R-Stitch's catch-ups, dLLM-Cache's partial steps); ``autotune`` measures which kernel or
mode is fastest for a shape on the machine at hand, with one timing routine, and ``kernel_cache``
keeps its one cache file (``kernels.json``).
"""

from .autotune import DENSE_MODES, KernelTuner, alternating_medians, default_tuner, last_level_cache_bytes, machine_id
from .dense import PrepackedLinear, SmallBatchLinear, WeightFingerprint, onednn_available
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
    "BACKENDS", "DENSE_MODES", "KERNELS", "PrepackedLinear", "SmallBatchLinear", "WeightFingerprint", "alternating_medians",
    "onednn_available", "CastLinear", "CastMemo", "Int4WeightOnlyLinear", "Int8WeightOnlyLinear", "KernelChoice",
    "KernelPlan", "KernelTuner", "WeightOnlyKernel", "default_tuner", "fast_kernel_fraction", "get_backend", "kernel_name",
    "last_level_cache_bytes", "linear_weight_bytes", "machine_id", "shape_key",
]
