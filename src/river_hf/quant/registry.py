"""The one table of weight-only kernels, and the protocol of the modules they build.

A weight-only kernel is one :class:`WeightOnlyKernel` subclass instance in :data:`KERNELS`
(registered by :func:`register`; the kernels themselves are defined in :mod:`.kernels`). It knows
its ``name`` and weight ``bits``, which Linear shapes it packs (:meth:`~WeightOnlyKernel.supports`),
whether this machine runs it (:meth:`~WeightOnlyKernel.available`) and how to build the cheap copy
of an ``nn.Linear`` (:meth:`~WeightOnlyKernel.build`).

What is read off a built copy afterwards asks the copy itself: river-hf's own modules are
:class:`KernelModule`\\ s, which name the kernel they run on (``river_kernel``) and count the weight
bytes one call reads (``weight_nbytes()``). A module type of another library (optimum-quanto's
``QLinear``) is named by the kernel that builds it (:meth:`WeightOnlyKernel.name_of`); a plain
``nn.Linear`` is ``"dense"``. :func:`kernel_name` and :func:`linear_weight_bytes` do nothing else,
so a new kernel is one module and one registered kernel class.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["WeightOnlyKernel", "KERNELS", "register", "KernelModule", "kernel_name", "linear_weight_bytes",
           "tensor_bytes"]


@dataclasses.dataclass(frozen=True)
class WeightOnlyKernel:
    """One way to run a Linear with cheaper weights (the base of every kernel in :data:`KERNELS`).

    Attributes:
        name: registry name (``torch-int8``, ``torch-int4``, ``quanto-int4``, ``ort-int4``, ..., ``copy``).
        bits: weight bits.
        compute_dtype: activation dtype at the kernel's boundary; None keeps the model's dtype
            (``ort-*``, ``ark-*``, ``torch-dyn-int8``: float32 in and out, int8 dot products inside).
        group_size: the largest group of input channels sharing a scale (None: per output channel).

    A subclass gives :meth:`build` and, where they differ from the defaults, :meth:`supports`
    (every shape), :meth:`runs_on` (always), :meth:`name_of` (none: its modules name themselves),
    :meth:`check_installed` (nothing to check), :attr:`needs` and :attr:`keeps_dense_layer`.
    """

    name: str
    bits: int
    compute_dtype: torch.dtype | None = torch.bfloat16
    group_size: int | None = None

    #: what the kernel needs to run, for the error when none of a choice's kernels can
    needs = "its library"
    #: True for a kernel whose copy is the dense Linear itself (``copy``): a layer is then deep-copied
    #: as a whole, none of its Linears rebuilt
    keeps_dense_layer = False

    def supports(self, linear: nn.Linear) -> bool:
        """Whether this kernel has a real (packed) implementation for ``linear``'s shape."""
        return True

    def available(self, device: torch.device | str = "cpu") -> bool:
        """Whether this machine has what the kernel runs on for ``device`` (:meth:`runs_on`):
        torch's op (``_weight_int4pack_mm_for_cpu`` / ``_weight_int4pack_mm`` /
        ``_weight_int8pack_mm``), optimum-quanto for the quanto kernels, and for ``ort-*`` /
        ``ark-*`` / ``torch-dyn-int8`` a CPU ``device`` and the library installed and computing a
        small product correctly here (checked once per process). ``copy`` is always available."""
        return self.runs_on(torch.device(device))

    def runs_on(self, device: torch.device) -> bool:
        """What :meth:`available` asks of a kernel (default: it runs anywhere)."""
        return True

    def build(self, linear: nn.Linear, memo=None) -> nn.Module:
        """Return the cheap copy of ``linear`` (``linear`` itself is not modified); ``memo``: a
        :class:`~river_hf.quant.modules.CastMemo` shared with the Linears of the same layer.

        Raises:
            RiverError: the kernel does not support this shape (see :meth:`supports`).
        """
        raise NotImplementedError(f"{type(self).__name__} does not say how to build {self.name}")

    def name_of(self, module: nn.Module) -> str | None:
        """The kernel name of ``module`` when it is a copy this kernel builds of a type that cannot
        name itself (another library's module type), else None."""
        return None

    def check_installed(self) -> None:
        """Raise ``RiverError`` when a library this kernel always needs is missing (default: none)."""

    def to_dict(self) -> dict:
        dtype = None if self.compute_dtype is None else str(self.compute_dtype).removeprefix("torch.")
        return {"name": self.name, "bits": self.bits, "compute_dtype": dtype}


#: every weight-only kernel, by name, in the order :func:`register` was called (:mod:`.kernels`)
KERNELS: dict[str, WeightOnlyKernel] = {}


def register(kernel: WeightOnlyKernel) -> WeightOnlyKernel:
    """Put ``kernel`` into :data:`KERNELS` under its name and return it.

    Raises:
        ValueError: another kernel is registered under that name.
    """
    if kernel.name in KERNELS and KERNELS[kernel.name] != kernel:
        raise ValueError(f"a kernel named {kernel.name!r} is already registered")
    KERNELS[kernel.name] = kernel
    return kernel


class KernelModule(nn.Module):
    """The base of the modules river-hf's kernels build: each names its kernel and counts its bytes.

    ``river_kernel``: the kernel name (a class attribute, an instance attribute or a property; a
    wrapper such as ``CastLinear`` gives the name of what it wraps). ``weight_nbytes()``: the bytes
    of weight storage one call reads (packed integers, scales, zero points, bias); the default
    counts the module's own buffers. A module's ``weight_nbytes`` covers its submodules, which
    :func:`linear_weight_bytes` then does not count again.
    """

    river_kernel: str

    def weight_nbytes(self) -> int:
        """Bytes of the module's own buffers (packed weights, scales, zero points, bias)."""
        return sum(tensor_bytes(b) for b in self.buffers(recurse=False))


def kernel_name(module: nn.Module) -> str:
    """The kernel a built Linear copy runs on (``torch-int8``, ``quanto-int4``, ``dense`` ...): its
    ``river_kernel`` (:class:`KernelModule`), else what a registered kernel names it
    (:meth:`WeightOnlyKernel.name_of`), else ``"dense"``. A ``PromptRowsLinear`` is named by its
    decode kernel (what a decode step runs)."""
    named = getattr(module, "river_kernel", None)
    if isinstance(named, str):
        return named
    return next((n for n in (k.name_of(module) for k in KERNELS.values()) if n is not None), "dense")


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes of weight storage read by one pass through ``module``'s Linears (quantized or not).

    Counts what each :class:`KernelModule` (or any module with a ``weight_nbytes()``) reports:
    packed integer data, scales and zero points, weights held outside torch (``ort-*``, ``ark-*``,
    ``torch-dyn-int8``); of a ``PromptRowsLinear`` only the decode copy (a decode step does not
    read the prompt kernel's copy). Every other ``nn.Linear`` (a dense copy, quanto's ``QLinear``)
    counts its weight and bias bytes. Used for the achieved bandwidth figure (bytes per step x steps
    per second).
    """
    total, counted = 0, set()
    for m in module.modules():  # parents before their children
        if id(m) in counted:
            continue
        if callable(getattr(m, "weight_nbytes", None)):
            total += int(m.weight_nbytes())
            counted.update(id(sub) for sub in m.modules())  # its submodules are in its own count
        elif isinstance(m, nn.Linear):
            total += sum(tensor_bytes(t) for t in (m.weight, m.bias) if t is not None)
    return total


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor; quanto's packed tensors are summed over their inner tensors."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()
