"""Fused projections: sibling Linears that read one input run as one product.

A decoder layer's attention calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden state,
its MLP ``gate_proj`` and ``up_proj`` on the same normed state. :func:`fuse_projections` puts one
Linear in their place whose weight is their weights stacked (``torch.cat`` along the output
rows, biases likewise), registered once on their parent as :data:`FUSED_NAMES` (e.g.
``self_attn.river_fused_qkv.linear``), and a thin :class:`ProjectionSlice` under each original
name. The architecture's own forward is not touched: it still calls ``self.q_proj(x)``,
``self.k_proj(x)``, ``self.v_proj(x)``; the first of those calls runs the fused product once and
keeps the other slices of its output for the calls that follow with the *same* input tensor.

Built on an exit layer before its Linears get their kernels, the fused Linear is one more
``nn.Linear`` of the layer, so the layer's kernel choice quantizes and measures it like any other
(its shape key is the stacked shape, e.g. ``int4:896x1152+bias`` for Qwen2.5-0.5B's q/k/v). Per
output row the quantization grid is the same as the separate Linears' (every weight-only kernel
here scales per output channel or per group of input channels within a row), so the fused copy
rounds the weights exactly as the separate copies do; only the product's accumulation order may
differ (kernel rounding). A layer then makes 4 weight products instead of 7 and the small k/v
products (``896x128`` on Qwen2.5-0.5B) are gone.

Correctness does not depend on the call order or on the inputs being shared: a slice called with
a tensor other than the one the kept outputs were computed from (another tensor, the same tensor
changed in place, a slice already handed out, another thread, another grad mode) runs the fused
product on its own input and returns its part. Cross-attention, where ``q_proj`` and ``k_proj``
read different tensors, therefore stays correct but runs the whole stacked product per call.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

__all__ = ["FusedProjection", "ProjectionSlice", "fuse_projections", "fused_groups", "GROUPS", "FUSED_NAMES"]

#: the sibling Linears fused, by child name (any module of a layer that has all of a group's
#: names as ``nn.Linear`` children with one ``in_features``, dtype and device gets them fused)
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: the name the fused product is registered under on the group's parent, per group
FUSED_NAMES: dict[tuple[str, ...], str] = {GROUPS[0]: "river_fused_qkv", GROUPS[1]: "river_fused_gate_up"}


class FusedProjection(nn.Module):
    """One product for several sibling projections of one input, split after.

    Args:
        linear: the product: an ``nn.Linear`` ``[in_features -> sum(sizes)]`` whose weight rows are
            the siblings' weights one after another (a kernel may replace it with its quantized
            copy: any module ``[..., in] -> [..., sum(sizes)]``).
        sizes: the siblings' ``out_features``, in the order their rows are stacked.

    ``forward(x)`` returns all parts (a tuple of views of one ``[..., sum(sizes)]`` output);
    :meth:`part` is what a :class:`ProjectionSlice` calls. The kept outputs live in a
    ``threading.local``, so threads running one layer never see each other's.
    """

    def __init__(self, linear: nn.Module, sizes):
        super().__init__()
        self.linear = linear
        self.sizes = tuple(int(s) for s in sizes)
        self._kept = threading.local()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``index`` (``[..., sizes[index]]``, x's dtype) of the fused product of ``x``.

        Returns the part kept by an earlier call of this thread when that call had this very
        tensor (identity, version counter, grad mode) and this part has not been handed out since;
        otherwise runs the product and keeps the other parts for the next calls."""
        kept = self._kept
        entry = getattr(kept, "entry", None)
        grad = torch.is_grad_enabled()
        version = None if x.is_inference() else x._version  # inference tensors have no version counter
        if entry is not None:
            ref, ver, was_grad, parts, left = entry
            if index in left and ref() is x and ver == version and was_grad == grad:
                left = left - {index}
                kept.entry = (ref, ver, was_grad, parts, left) if left else None
                return parts[index]
        parts = self.linear(x).split(self.sizes, dim=-1)
        left = frozenset(range(len(parts))) - {index}
        kept.entry = (weakref.ref(x), version, grad, parts, left) if left else None
        return parts[index]

    def __getstate__(self):  # deepcopy / pickle: the kept outputs are per thread and not copied
        state = super().__getstate__()
        state.pop("_kept", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._kept = threading.local()

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


class ProjectionSlice(nn.Module):
    """Stands where one of the fused siblings was (``q_proj``, ...): ``[..., in_features]`` ->
    ``[..., out_features]``, the rows ``fused`` computes for it.

    The fused product is registered on the parent (:data:`FUSED_NAMES`), not under each slice,
    so the layer's modules, weight bytes and kernel report count it once; the slice only holds a
    reference to it.
    """

    def __init__(self, fused: FusedProjection, index: int, in_features: int, out_features: int):
        super().__init__()
        self.__dict__["fused"] = fused  # a plain reference, not a child module
        self.index = index
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)

    @property
    def weight(self) -> torch.Tensor:
        """This slice's rows of the stacked weight (``[out_features, in_features]``, a view) while
        the fused product is a dense ``nn.Linear`` (the ``copy`` kernel).

        Raises:
            AttributeError: the product runs on a quantized kernel (no dense weight, as for an
                unfused quantized copy)."""
        return self._rows("weight")

    @property
    def bias(self) -> torch.Tensor | None:
        """This slice's entries of the stacked bias (a view; None without one), dense product only
        (see :attr:`weight`)."""
        return self._rows("bias")

    def _rows(self, name: str):
        linear = self.fused.linear
        if not isinstance(linear, nn.Linear):
            raise AttributeError(f"{type(self).__name__}.{name}: the fused product runs on "
                                 f"{type(linear).__name__}, which has no dense {name}")
        t = getattr(linear, name)
        if t is None:
            return None
        start = sum(self.fused.sizes[:self.index])
        return t[start:start + self.out_features]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part={self.index}"


def fused_groups(layer: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """``(parent module name, group)`` for every group of :data:`GROUPS` that ``layer`` can fuse:
    a module with all of the group's names as plain ``nn.Linear`` children of one
    ``in_features``, dtype and device (``""`` names ``layer`` itself)."""
    found = []
    for name, module in layer.named_modules():
        for group in GROUPS:
            linears = [module._modules.get(n) for n in group]
            if all(type(m) is nn.Linear for m in linears) and len(
                    {(m.in_features, m.weight.dtype, m.weight.device) for m in linears}) == 1:
                found.append((name, group))
    return found


@torch.no_grad()
def fuse_projections(layer: nn.Module) -> list[str]:
    """Replace, in place, each fusable group of ``layer`` (:func:`fused_groups`) with one stacked
    ``nn.Linear`` (a :class:`FusedProjection` under :data:`FUSED_NAMES`) and a
    :class:`ProjectionSlice` under each sibling's name; returns the fused products' names.

    The stacked weight is ``torch.cat`` of the siblings' weights along the output rows (a new
    tensor; the siblings' own tensors are not modified); siblings without a bias get zeros where
    another has one. Call it on a copy: the layer's forward then computes the same outputs up to
    the product's rounding.
    """
    names = []
    for parent_name, group in fused_groups(layer):
        parent = layer.get_submodule(parent_name) if parent_name else layer
        linears = [parent._modules[n] for n in group]
        first = linears[0]
        sizes = [m.out_features for m in linears]
        has_bias = any(m.bias is not None for m in linears)
        stacked = nn.Linear(first.in_features, sum(sizes), bias=has_bias, device=first.weight.device,
                            dtype=first.weight.dtype)
        stacked.weight.copy_(torch.cat([m.weight for m in linears], dim=0))
        if has_bias:
            stacked.bias.copy_(torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                                          for m in linears]))
        stacked.requires_grad_(first.weight.requires_grad)
        fused = FusedProjection(stacked, sizes)
        fused_name = FUSED_NAMES[group]
        parent.add_module(fused_name, fused)
        for index, (n, m) in enumerate(zip(group, linears)):
            setattr(parent, n, ProjectionSlice(fused, index, m.in_features, m.out_features))
        names.append(f"{parent_name}.{fused_name}" if parent_name else fused_name)
    return names
