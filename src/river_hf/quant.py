"""Quantization backends that turn one decoder layer into its cheap exit copy.

A backend takes a decoder layer and returns a *new* module with the same call signature and the
same dtype at its boundary, whose Linear weights are quantized (the layer itself is untouched).
Only the matmuls run in the backend's compute dtype (W4A16: 4-bit weights, 16-bit activations);
norms, rotary embeddings, attention and the KV cache stay in the model's dtype, so an exit layer
writes keys and values into the shared cache exactly as its backbone layer would (River-LLM,
"KV share").

Backends:
    ``quanto`` (default): optimum-quanto ``qint4`` weights, group size 128, bf16 activations.
        On CPU a Linear whose ``in_features`` is a multiple of 128 uses a packed int4 kernel;
        other shapes fall back to a much slower path (see docs/river.md).
    ``quanto-int8``: optimum-quanto ``qint8`` weights (W8A16).
    ``copy``: an unquantized copy in the model's dtype. Exit layers then compute exactly what the
        backbone computes, which makes it the reference for testing the routing itself.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from .errors import RiverError

__all__ = ["QuantBackend", "get_backend", "BACKENDS", "linear_weight_bytes"]


class _CastLinear(nn.Module):
    """Runs ``inner`` in ``compute_dtype`` and returns the caller's dtype (W4A16 on an fp32 model)."""

    def __init__(self, inner: nn.Module, compute_dtype: torch.dtype):
        super().__init__()
        self.inner = inner
        self.compute_dtype = compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.compute_dtype)).to(x.dtype)


@dataclasses.dataclass(frozen=True)
class QuantBackend:
    """How exit layers are built.

    Attributes:
        name: registry name (``quanto``, ``quanto-int8``, ``copy``).
        bits: weight bits of the exit layers' Linears.
        compute_dtype: activation dtype of the quantized matmuls; ``None`` keeps the model's dtype.
    """

    name: str
    bits: int
    compute_dtype: torch.dtype | None = torch.bfloat16

    def build_exit_layer(self, layer: nn.Module) -> nn.Module:
        """Return a quantized copy of ``layer``; ``layer`` is not modified.

        The copy keeps every attribute of the original (``layer_idx``, ``attention_type``, ...), so
        its attention writes to the same KV-cache slot.
        """
        exit_layer = copy.deepcopy(layer)
        if self.name == "copy":
            return exit_layer
        from optimum.quanto import freeze, qint4, qint8, quantize

        weights = {4: qint4, 8: qint8}[self.bits]
        model_dtype = next(layer.parameters()).dtype
        compute = self.compute_dtype or model_dtype
        linears = [(n, m) for n, m in exit_layer.named_modules() if type(m) is nn.Linear]
        for name, linear in linears:
            holder = nn.Sequential(linear.to(compute))
            quantize(holder, weights=weights)
            freeze(holder)
            new = holder[0] if compute == model_dtype else _CastLinear(holder[0], compute)
            parent_name, _, child = name.rpartition(".")
            setattr(exit_layer.get_submodule(parent_name) if parent_name else exit_layer, child, new)
        return exit_layer

    def to_dict(self) -> dict:
        dtype = None if self.compute_dtype is None else str(self.compute_dtype).removeprefix("torch.")
        return {"name": self.name, "bits": self.bits, "compute_dtype": dtype}


BACKENDS: dict[str, QuantBackend] = {
    "quanto": QuantBackend("quanto", 4, torch.bfloat16),
    "quanto-int8": QuantBackend("quanto-int8", 8, None),
    "copy": QuantBackend("copy", 16, None),
}


def get_backend(name: str | QuantBackend) -> QuantBackend:
    """Look a backend up by name. Raises :class:`RiverError` for an unknown name."""
    if isinstance(name, QuantBackend):
        return name
    if name not in BACKENDS:
        raise RiverError(f"unknown quantization backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name.startswith("quanto"):
        try:
            import optimum.quanto  # noqa: F401
        except ImportError as e:  # pragma: no cover - it is a dependency
            raise RiverError("the quanto backend needs optimum-quanto: pip install optimum-quanto") from e
    return BACKENDS[name]


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes of weight storage read by one pass through ``module``'s Linears (quantized or not).

    Counts packed integer data, scales and shifts for quanto tensors, and the plain weight (and
    bias) bytes for dense Linears. Used for the achieved-bandwidth figure (bytes/token x tokens/s).
    """
    total = 0
    for m in module.modules():
        if isinstance(m, nn.Linear) or type(m).__name__.startswith("QLinear"):
            for t in (getattr(m, "weight", None), getattr(m, "bias", None)):
                if t is not None:
                    total += _tensor_bytes(t)
    return total


def _tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor; quanto's packed tensors are summed over their inner tensors."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


#: quanto weight types that run on a packed int4 kernel (tinygemm on CPU/CUDA, Marlin on CUDA).
_FAST_INT4_TYPES = ("TinyGemmWeightQBitsTensor", "MarlinInt4WeightQBitsTensor")


def fast_kernel_fraction(model: nn.Module) -> float | None:
    """Fraction of the exit layers' quantized Linears that got a packed int4 kernel.

    On CPU, quanto packs a ``qint4`` Linear for the fast kernel only when its ``in_features`` is a
    multiple of 128 and activations are bf16; the others dequantize on every call, 10-30x slower.
    Returns None when the model has no quantized exit Linears (e.g. the ``copy`` backend).
    """
    kinds = [
        type(m.weight).__name__
        for name, m in model.named_modules()
        if ".exit_layer." in f".{name}." and type(m).__name__.startswith("QLinear")
    ]
    if not kinds:
        return None
    return sum(k in _FAST_INT4_TYPES for k in kinds) / len(kinds)
