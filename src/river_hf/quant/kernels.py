"""Weight-only kernels: the strategy objects that turn one ``nn.Linear`` into its cheap copy.

A :class:`WeightOnlyKernel` takes a dense Linear (``weight: [out_features, in_features]``, model
dtype) and returns a *new* module with the same call signature and the same dtype at its
boundary: ``x: [..., in_features]`` in the model's dtype gives ``[..., out_features]`` in the
model's dtype. Only the matmul runs in the kernel's compute dtype (W8A16 / W4A16: 8- or 4-bit
weights, bf16 activations); the source Linear is not modified (a tied LM head stays tied).

Kernels (``KERNELS``):
    ``torch-int8``: per-output-channel symmetric int8 weights, bf16 activations, on torch's own
        weight-only kernel ``torch._weight_int8pack_mm`` (a small module around the op: torchao
        0.18's stable int8 config does not reach it on CPU without ``mslk``).
    ``torch-int4``: asymmetric 4-bit weights in groups of 128 (64 or 32 where ``in_features``
        needs it), bf16 activations, on ``torch._weight_int4pack_mm_for_cpu`` (CPU) /
        ``torch._weight_int4pack_mm`` (CUDA, tinygemm). Unlike quanto it also packs shapes whose
        ``in_features`` is not a multiple of 128 (SmolLM2's 576).
    ``torch-int4-g32``: the same kernel with groups of 32 input channels: a quarter more bytes
        (scales and zeros), about half the relative output error of groups of 128 on the
        Qwen2.5-Coder weights (docs/results/archive/river-measurements.md).
    ``quanto-int4``: optimum-quanto ``qint4`` weights, group size 128, bf16 activations (packed
        int4 kernel where ``in_features % 128 == 0``, a slow dequantizing path elsewhere).
    ``quanto-int8``: optimum-quanto ``qint8`` weights, bf16 activations (quanto dispatches to
        ``torch._weight_int8pack_mm`` on CPU, through its tensor subclass).
    ``ort-int4`` / ``ort-int4-g32`` / ``ort-int8``: onnxruntime's ``MatMulNBits`` (MLAS), 4-bit
        asymmetric (blocks of 128, 64 or 32 / of 32) or 8-bit symmetric (blocks of 128, 64 or 32)
        weights, fp32 activations, accuracy level 4 (int8 dot products), one onnxruntime session
        per Linear (:class:`~river_hf.quant.external.OrtMatMulNBitsLinear`). Needs onnxruntime.
    ``torch-dyn-int8``: torch's fbgemm ``quantized::linear_dynamic``, per-channel int8 weights,
        activations quantized per call (:class:`~river_hf.quant.external.DynamicInt8Linear`).
    ``ark-int4`` / ``ark-int8``: Intel ARK ``woqgemm`` (auto-round-lib), 4-bit asymmetric groups of
        128 (64, 32) / 8-bit per channel, int8 compute (:class:`~river_hf.quant.external.ArkWoqLinear`).
        Needs auto-round-lib.
    ``river-int4``: river-hf's own product for AVX-512 VNNI and AVX2 CPUs (:mod:`~river_hf.quant.river_int4`):
        torch-int4's grid, activations quantized to int8 per group of 128, integer dot products
        (``vpdpbusd``; AVX2: ``vpmaddubsw``), fp32 out. Compiled once per torch version with gcc; unavailable without
        the CPU features or a compiler.
    ``copy``: an unquantized copy in the model's dtype: exit layers then compute exactly what the
        backbone computes, the reference for testing the routing itself.

    Each kernel is *available* (:meth:`WeightOnlyKernel.available`) only where its library is
    installed and a small product computes correctly on this CPU; a choice measures only the
    available ones.

Kernel *choices* (what ``RiverConfig.backend`` / ``exit_head`` name, see :func:`get_backend`):
    ``int4-g32``: ``torch-int4-g32``.
    ``int8`` / ``int4``: the fastest kernel of that weight width for each Linear's shape, chosen by
        a short measurement on the machine at hand (:mod:`.autotune`). The width is the quality
        knob (HumanEval pass@1 follows the exit layers' bits, docs/river.md); within one width the
        kernels quantize alike (same grid, relative output error within a few percent of each
        other, reported per Linear), so speed alone picks among them. The onnxruntime kernels are
        not candidates: each product is fast alone, but their thread pool shares the cores with
        torch's, and inside a whole decode step they lost (Qwen2.5-Coder-0.5B fully quantized on
        the 2-core AVX-512 machine: ``ort-int4`` 0.73x the decode speed of ``torch-int4``, and the
        measured choice with an onnxruntime head slower than without: docs/river.md). Name them to
        use them.
    any kernel name above: that kernel for every Linear (``quanto`` is kept as a name for
    ``quanto-int4``).

Each kernel is one :class:`~river_hf.quant.registry.WeightOnlyKernel` subclass instance,
registered in the one table :data:`KERNELS` (:func:`~river_hf.quant.registry.register`); each
module it builds names its kernel and counts its weight bytes itself
(:class:`~river_hf.quant.registry.KernelModule`), or, for optimum-quanto's ``QLinear``, the kernel
names it (:meth:`QuantoKernel.name_of`). Prompt kernels, the per-shape record of a measured choice
(:class:`KernelPlan`) and :class:`KernelChoice` are :mod:`.choice`; this module re-exports them.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

import torch
from torch import nn

from ..errors import RiverError
from .choice import PROMPT_KERNELS, PROMPT_MIN_ROWS, PROMPT_ROWS, KernelChoice, KernelPlan, prompt_key, shape_key
from .external import ArkWoqLinear, DynamicInt8Linear, OrtMatMulNBitsLinear, ark_works, dynamic_int8_works, ort_works
from .modules import (CastLinear, CastMemo, Int4WeightOnlyLinear, Int8WeightOnlyLinear, PromptRowsLinear,  # noqa: F401
                      fast_kernel_fraction, kernel_name, linear_weight_bytes, relative_error)
from . import river_int4
from .registry import KERNELS, KernelModule, WeightOnlyKernel, register
from .river_int4 import RiverInt4Linear

__all__ = [
    "WeightOnlyKernel",
    "KERNELS",
    "KernelChoice",
    "get_backend",
    "BACKENDS",
    "Int8WeightOnlyLinear",
    "Int4WeightOnlyLinear",
    "CastLinear",
    "CastMemo",
    "linear_weight_bytes",
    "kernel_name",
    "relative_error",
    "KernelPlan",
    "shape_key",
    "prompt_key",
    "PromptRowsLinear",
    "PROMPT_ROWS",
    "PROMPT_MIN_ROWS",
    "PROMPT_KERNELS",
    "KernelModule",
    "TorchInt8Kernel",
    "TorchInt4Kernel",
    "QuantoKernel",
    "OrtKernel",
    "DynamicInt8Kernel",
    "ArkKernel",
    "RiverInt4Kernel",
    "CopyKernel",
]

#: what torch's own kernels need, for the error when none of a choice's kernels can run
_TORCH_OP = ("an op this torch build lacks on this device (torch._weight_int4pack_mm / _weight_int8pack_mm, or the "
             "fbgemm engine for torch-dyn-int8)")


@dataclasses.dataclass(frozen=True)
class _ModuleKernel(WeightOnlyKernel):
    """A kernel whose copy is one module of river-hf's (:meth:`module`), given the layer's cast memo."""

    def module(self, linear: nn.Linear) -> KernelModule:
        """The built module of ``linear`` (called under ``torch.no_grad()``)."""
        raise NotImplementedError(f"{type(self).__name__} does not say which module {self.name} builds")

    def build(self, linear: nn.Linear, memo: CastMemo | None = None) -> nn.Module:
        with torch.no_grad():
            m = self.module(linear)
        m.memo = memo
        return m


@dataclasses.dataclass(frozen=True)
class TorchInt8Kernel(_ModuleKernel):
    """``torch-int8``: :class:`~river_hf.quant.modules.Int8WeightOnlyLinear` on ``torch._weight_int8pack_mm``."""

    needs = _TORCH_OP

    def supports(self, linear: nn.Linear) -> bool:
        return linear.in_features % 4 == 0

    def runs_on(self, device: torch.device) -> bool:
        return hasattr(torch, "_weight_int8pack_mm")

    def module(self, linear: nn.Linear) -> KernelModule:
        return Int8WeightOnlyLinear(linear, self.compute_dtype)


@dataclasses.dataclass(frozen=True)
class TorchInt4Kernel(_ModuleKernel):
    """``torch-int4`` / ``torch-int4-g32``: :class:`~river_hf.quant.modules.Int4WeightOnlyLinear` on
    tinygemm, groups of at most ``group_size`` input channels."""

    needs = _TORCH_OP

    def supports(self, linear: nn.Linear) -> bool:
        return Int4WeightOnlyLinear.supports(linear)

    def runs_on(self, device: torch.device) -> bool:
        return hasattr(torch, "_weight_int4pack_mm_for_cpu" if device.type == "cpu" else "_weight_int4pack_mm")

    def module(self, linear: nn.Linear) -> KernelModule:
        return Int4WeightOnlyLinear(linear, self.compute_dtype, self.group_size or 128)


@dataclasses.dataclass(frozen=True)
class _CpuLibraryKernel(_ModuleKernel):
    """A kernel of another library's CPU code (:mod:`.external`): a CPU device, the library working
    here (:meth:`works`), and for 4-bit (and every ``ort-*``) ``in_features`` divisible by 32."""

    def works(self) -> bool:
        """Whether the library is installed and computes a small product correctly (once per process)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to check {self.name}")

    def supports(self, linear: nn.Linear) -> bool:
        return linear.in_features % 32 == 0

    def runs_on(self, device: torch.device) -> bool:
        return device.type == "cpu" and self.works()

    def build(self, linear: nn.Linear, memo: CastMemo | None = None) -> nn.Module:
        if not self.supports(linear):
            raise RiverError(f"{self.name} needs in_features divisible by 32, got "
                             f"{linear.in_features}x{linear.out_features}")
        return super().build(linear, memo)


@dataclasses.dataclass(frozen=True)
class OrtKernel(_CpuLibraryKernel):
    """``ort-int4`` / ``ort-int4-g32`` / ``ort-int8``: onnxruntime's ``MatMulNBits``
    (:class:`~river_hf.quant.external.OrtMatMulNBitsLinear`, accuracy level 4)."""

    needs = "onnxruntime (pip install 'river-hf[ort]') on a CPU"

    def works(self) -> bool:
        return ort_works()

    def module(self, linear: nn.Linear) -> KernelModule:
        return OrtMatMulNBitsLinear(linear, self.bits, self.group_size or 128, 4, kernel=self.name)


@dataclasses.dataclass(frozen=True)
class DynamicInt8Kernel(_CpuLibraryKernel):
    """``torch-dyn-int8``: fbgemm's ``quantized::linear_dynamic``
    (:class:`~river_hf.quant.external.DynamicInt8Linear`); every shape."""

    needs = _TORCH_OP

    def works(self) -> bool:
        return dynamic_int8_works()

    def supports(self, linear: nn.Linear) -> bool:
        return True

    def module(self, linear: nn.Linear) -> KernelModule:
        return DynamicInt8Linear(linear)


@dataclasses.dataclass(frozen=True)
class RiverInt4Kernel(_CpuLibraryKernel):
    """``river-int4``: river-hf's own AVX-512 VNNI / AVX2 product on torch-int4's grid, int8 activations
    (:class:`~river_hf.quant.river_int4.RiverInt4Linear`); ``out_features`` divisible by 16."""

    @property
    def needs(self) -> str:
        """What it needs, and why it cannot run here when it cannot."""
        why = None if river_int4.works() else river_int4.unavailable_reason()
        return ("an x86-64 CPU with AVX-512 VNNI or AVX2 (with FMA and F16C) and a C++ compiler (gcc) for its one-time build, on Linux"
                + (f"; here: {why}" if why else ""))

    def works(self) -> bool:
        return river_int4.works()

    def supports(self, linear: nn.Linear) -> bool:
        return RiverInt4Linear.supports(linear)

    def module(self, linear: nn.Linear) -> KernelModule:
        return RiverInt4Linear(linear, self.group_size or 128)


@dataclasses.dataclass(frozen=True)
class ArkKernel(_CpuLibraryKernel):
    """``ark-int4`` / ``ark-int8``: Intel ARK ``woqgemm`` (:class:`~river_hf.quant.external.ArkWoqLinear`);
    8-bit packs every shape."""

    needs = ("auto-round-lib (pip install 'river-hf[ark]'; wheels for Linux x86-64, CPython >= 3.11, torch >= 2.13) "
             "on a CPU")

    def works(self) -> bool:
        return ark_works()

    def supports(self, linear: nn.Linear) -> bool:
        return self.bits != 4 or super().supports(linear)

    def module(self, linear: nn.Linear) -> KernelModule:
        return ArkWoqLinear(linear, self.bits, self.group_size or 128, kernel=self.name)


#: quanto weight types that run on a packed int4 kernel (tinygemm on CPU/CUDA, Marlin on CUDA).
_FAST_INT4_TYPES = ("TinyGemmWeightQBitsTensor", "MarlinInt4WeightQBitsTensor")


@dataclasses.dataclass(frozen=True)
class QuantoKernel(WeightOnlyKernel):
    """``quanto-int8`` / ``quanto-int4``: optimum-quanto ``qint8`` / ``qint4`` weights (its ``QLinear``,
    run in ``compute_dtype`` through a :class:`~river_hf.quant.modules.CastLinear` when the model's
    dtype differs); every shape (int4 on a slow dequantizing path where it cannot pack)."""

    needs = "optimum-quanto"

    def runs_on(self, device: torch.device) -> bool:
        try:
            return importlib.util.find_spec("optimum.quanto") is not None
        except ImportError:  # no optimum at all
            return False

    def check_installed(self) -> None:
        try:
            import optimum.quanto  # noqa: F401
        except ImportError as e:  # pragma: no cover - it is a dependency
            raise RiverError("the quanto kernels need optimum-quanto: pip install optimum-quanto") from e

    def build(self, linear: nn.Linear, memo: CastMemo | None = None) -> nn.Module:
        from optimum.quanto import freeze, qint4, qint8, quantize

        model_dtype = linear.weight.dtype
        with torch.no_grad():
            compute = self.compute_dtype or model_dtype
            holder = nn.Sequential(copy.deepcopy(linear).to(compute))
            quantize(holder, weights={4: qint4, 8: qint8}[self.bits])
            freeze(holder)
            return holder[0] if compute == model_dtype else CastLinear(holder[0], compute, memo)

    def name_of(self, module: nn.Module) -> str | None:
        """``quanto-int8``, ``quanto-int4`` or ``quanto-int4 (slow fallback)`` for a ``QLinear`` of this
        kernel's width (by its weight tensor's type), else None."""
        if not type(module).__name__.startswith("QLinear"):
            return None
        kind = type(module.weight).__name__
        bits = 4 if "QBits" in kind else 8
        if bits != self.bits:
            return None
        return f"quanto-int{bits}" + ("" if bits == 8 or kind in _FAST_INT4_TYPES else " (slow fallback)")


@dataclasses.dataclass(frozen=True)
class CopyKernel(WeightOnlyKernel):
    """``copy``: an unquantized deep copy in the model's dtype (a plain ``nn.Linear``: ``dense``)."""

    keeps_dense_layer = True

    def build(self, linear: nn.Linear, memo: CastMemo | None = None) -> nn.Module:
        return copy.deepcopy(linear)


for _kernel in (
    TorchInt8Kernel("torch-int8", 8),
    TorchInt4Kernel("torch-int4", 4, group_size=128),
    TorchInt4Kernel("torch-int4-g32", 4, group_size=32),
    QuantoKernel("quanto-int8", 8),
    QuantoKernel("quanto-int4", 4, group_size=128),
    OrtKernel("ort-int4", 4, torch.float32, group_size=128),
    OrtKernel("ort-int4-g32", 4, torch.float32, group_size=32),
    OrtKernel("ort-int8", 8, torch.float32, group_size=128),
    DynamicInt8Kernel("torch-dyn-int8", 8, torch.float32),
    ArkKernel("ark-int4", 4, torch.float32, group_size=128),
    RiverInt4Kernel("river-int4", 4, torch.float32, group_size=128),
    ArkKernel("ark-int8", 8, torch.float32),
    CopyKernel("copy", 16, None),
):
    register(_kernel)
del _kernel


#: the fixed-kernel names, and the two measured choices. ``quanto`` is the old name of ``quanto-int4``.
BACKENDS: dict[str, KernelChoice] = {
    "int8": KernelChoice("int8", tuple(KERNELS[k] for k in ("torch-int8", "torch-dyn-int8", "ark-int8", "quanto-int8"))),
    "int4": KernelChoice("int4", tuple(KERNELS[k] for k in ("torch-int4", "river-int4", "ark-int4", "quanto-int4"))),
    "int4-g32": KernelChoice("int4-g32", (KERNELS["torch-int4-g32"],)),
    **{name: KernelChoice(name, (k,)) for name, k in KERNELS.items()},
    "quanto": KernelChoice("quanto", (KERNELS["quanto-int4"],)),
}


def get_backend(name: str | KernelChoice) -> KernelChoice:
    """Look a kernel choice up by name (see the module docstring).

    Raises:
        RiverError: an unknown name, or a quanto kernel without optimum-quanto installed.
    """
    if isinstance(name, KernelChoice):
        return name
    if name not in BACKENDS:
        raise RiverError(f"unknown quantization backend {name!r}: choose one of {', '.join(BACKENDS)}")
    for kernel in BACKENDS[name].candidates:
        kernel.check_installed()
    return BACKENDS[name]
