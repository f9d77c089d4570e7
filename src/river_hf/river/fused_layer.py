"""River's own exit layers: one fused forward per architecture family, checked against the
architecture's exit copy at build.

An exit copy (:func:`river_hf.river.build.build_exit_copy`) is the architecture's decoder-layer
class over quantized Linears: correct for every architecture, but each decode step makes dozens of
small eager calls per layer (RMSNorm in seven ops, ``rotate_half`` rotary, view/transpose pairs,
casts, ``repeat_kv``). A *fused exit layer* computes the same function with far fewer, bigger calls
on the very same kernel modules (nothing is quantized again): it is a :class:`FusedExitLayer`
whose ``architecture`` child is the exit copy it was made from. The backbone never runs one: it
always runs the architecture's own code, so τ > 1 stays token-identical to the plain model, and
lossless mode's verify passes are untouched (its drafts run exit layers, so they get the fused
ones).

Which layers get one (``RiverConfig.exit_layer_impl``): ``architecture`` (none), ``fused`` (every
layer a registered family supports; a warning where none does) or ``auto`` (the same, without that
warning). Either way a layer whose fused build check fails keeps the architecture copy, with a warning.
A family is an :class:`ExitLayerFamily` in :data:`FAMILIES` (:func:`register_family`, the way
:mod:`river_hf.quant.registry` holds kernels): ``refusal(layer, config)`` says why it cannot serve a
layer (None: it can; :meth:`ExitLayerFamily.supports`), ``build(exit_copy, config)`` makes the
fused layer. :mod:`.fused_llama` registers the Llama / Qwen2 / Mistral family.

Every fused layer is checked once at build (:func:`check_against_architecture`): both run a short
prefill and one decode step on random hidden states into caches of their own; the largest relative
error of the layer's update (output minus input) and of the K/V written, median over the inputs of
:data:`CHECK_SEEDS`, must be at most :func:`check_tolerance` of the layer's dtype
(:data:`CHECK_TOLERANCE`, 1e-3, in an fp32 model), else that layer keeps the architecture's exit
copy (a warning names it). The update, not the output, is compared: the residual would hide an
error in the attention or the MLP. A wrong function (another norm, a missing bias, another rotary
layout) is off by 10 % or more on every input; the two implementations of one function differ by
float rounding order. Why the median: a kernel that rounds each call's activations to int8
(river-int4) turns a one-rounding difference before a product into whole int8 steps, which the
next products' roundings carry on, so an occasional input shows far more than most do.

At run time a fused layer hands a call to its architecture copy when it cannot serve it as
checked (its :meth:`FusedExitLayer.serves` says so): training mode, a forward hook on the
architecture copy (transformers' ``output_hidden_states`` capture installs one), an attention
implementation other than the one the family handles.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["ExitLayerFamily", "FusedExitLayer", "FAMILIES", "register_family", "family_for", "fused_exit_layer",
           "check_against_architecture", "CHECK_TOLERANCE", "CHECK_SEEDS", "check_tolerance"]

#: the largest relative error of a fused layer's update and K/V against its architecture copy
#: accepted at build in an fp32 model (both run the same kernels; what differs is float rounding order)
CHECK_TOLERANCE = 1e-3
#: the random inputs (seeds) the build check runs; the median of their errors is compared
CHECK_SEEDS = (0, 1, 2)


def check_tolerance(dtype: torch.dtype) -> float:
    """The build check's bound for a layer computing in ``dtype``: :data:`CHECK_TOLERANCE`, or four
    units of ``dtype``'s rounding (``4 * finfo(dtype).eps``: 0.031 for bf16, 0.0039 for fp16) where
    that is larger: in a 16-bit model every op rounds to 16 bits, so one op computed in another
    order (a fused multiply-add where the architecture multiplies and adds: up to 0.011 in bf16,
    0.0015 in fp16 on tiny random Llama and Qwen2 layers) already moves the update by about
    1e-3 relative or more."""
    return max(CHECK_TOLERANCE, 4 * torch.finfo(dtype).eps)
#: families by name (:func:`register_family`)
FAMILIES: dict[str, "ExitLayerFamily"] = {}


class ExitLayerFamily:
    """One fused exit layer for the decoder layers of a family of architectures.

    Attributes:
        name: the family's name (the key in :data:`FAMILIES`).
        model_types: the ``model_type`` values it is written for (the structure is checked too).
    """

    name = ""
    model_types: tuple[str, ...] = ()

    def refusal(self, layer: nn.Module, config) -> str | None:
        """Why this family cannot serve ``layer`` (an exit copy or a backbone layer) of a model
        with text config ``config``, or None when it can."""
        raise NotImplementedError

    def supports(self, layer: nn.Module, config) -> bool:
        """Whether this family can serve ``layer`` (:meth:`refusal` is None)."""
        return self.refusal(layer, config) is None

    def build(self, exit_copy: nn.Module, config) -> "FusedExitLayer":
        """The fused layer of ``exit_copy`` (a supported layer), on its kernel modules."""
        raise NotImplementedError

    def dtype(self, layer: nn.Module) -> torch.dtype:
        """The dtype ``layer`` computes in (the model's): its first floating parameter's, fp32 when it
        has none. Families override it where a kernel's parameters may come first in another dtype."""
        return next((p.dtype for p in layer.parameters() if p.is_floating_point()), torch.float32)

    def check_kwargs(self, exit_copy: nn.Module, config, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """Keyword arguments (besides ``hidden_states`` and the cache) of one call of the layer
        at ``positions`` (``[1, tokens]`` long) for :func:`check_against_architecture`."""
        raise NotImplementedError


def register_family(family: ExitLayerFamily) -> ExitLayerFamily:
    """Add ``family`` to :data:`FAMILIES` and return it.

    Raises:
        ValueError: another family is registered under that name.
    """
    if family.name in FAMILIES and FAMILIES[family.name] is not family:
        raise ValueError(f"an exit-layer family named {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def family_for(layer: nn.Module, config) -> tuple[ExitLayerFamily | None, str]:
    """The first registered family that supports ``layer``, and ``""``; or None and why none does
    (each family's refusal)."""
    reasons = []
    for family in FAMILIES.values():
        why = family.refusal(layer, config)
        if why is None:
            return family, ""
        reasons.append(f"{family.name}: {why}")
    return None, "; ".join(reasons) or "no family is registered"


class FusedExitLayer(nn.Module):
    """The base of every fused exit layer: it holds the architecture's exit copy it was made from
    (``architecture``, its one child, whose kernel modules it calls) and speaks its names.

    Attributes it does not have are read on the architecture copy (``self_attn``, ``mlp``,
    ``layer_idx`` ...), and ``named_modules`` gives the architecture copy's modules under the
    names they have there, so :func:`river_hf.river.exit_modules`, the kernel report and the weight
    bytes see the same modules with either implementation. ``check_error`` is the build check's
    relative error, the median over :data:`CHECK_SEEDS` (None: not checked).
    """

    family = ""

    def __init__(self, architecture: nn.Module):
        super().__init__()
        self.architecture = architecture
        self.check_error: float | None = None
        self.train(architecture.training)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "architecture" or "architecture" not in self._modules:
                raise
            return getattr(self._modules["architecture"], name)

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        """This layer, then the architecture copy and its submodules under the names they have
        in the architecture copy (the fused layer adds no module of its own)."""
        if memo is None:
            memo = set()
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        yield from self._modules["architecture"].named_modules(memo, prefix, remove_duplicate)

    def serves(self) -> bool:
        """Whether this call may run fused: not in training mode, and no forward hook on the
        architecture copy (a hook expects that module to run). Families add their own checks."""
        arch = self._modules["architecture"]
        return not (self.training or arch._forward_hooks or arch._forward_pre_hooks)

    def extra_repr(self) -> str:
        return f"family={self.family!r}, check_error={self.check_error}"


def fused_exit_layer(exit_copy: nn.Module, impl: str, name: str = "") -> nn.Module:
    """``exit_copy`` as ``impl`` asks (``RiverConfig.exit_layer_impl``): itself for ``architecture``;
    otherwise the fused layer of the first family that supports it, when the build check passes.

    Args:
        exit_copy: an exit copy built by ``build_exit_copy`` (its kernels are reused).
        impl: ``architecture``, ``fused`` or ``auto``.
        name: the layer's name in warnings (``"layers.3"``).

    Warns:
        UserWarning: ``fused`` and no family supports the layer (once per reason); the build check
            failed or raised (each layer: it keeps the architecture's exit copy).
    """
    if impl == "architecture":
        return exit_copy
    config = _text_config(exit_copy)
    family, why = family_for(exit_copy, config)
    if family is None:
        if impl == "fused":
            warnings.warn(f"exit_layer_impl='fused': no fused exit layer for this decoder layer ({why}); these exit "
                          "layers run the architecture's code", UserWarning, stacklevel=2)
        return exit_copy
    try:
        fused = family.build(exit_copy, config)
        errors = sorted(check_against_architecture(family, fused, exit_copy, config, seed=seed) for seed in CHECK_SEEDS)
        error = errors[len(errors) // 2]
    except Exception as e:  # noqa: BLE001 - any failure of the fused path means: keep the architecture copy
        warnings.warn(f"exit_layer_impl={impl!r}: the fused exit layer of {name or 'a layer'} failed to build or its check "
                      f"({type(e).__name__}: {e}); it runs the architecture's code", UserWarning, stacklevel=2)
        return exit_copy
    bound = check_tolerance(family.dtype(exit_copy))
    if not error <= bound:
        warnings.warn(f"exit_layer_impl={impl!r}: the fused exit layer of {name or 'a layer'} differs from the "
                      f"architecture's exit copy by {error:.2e} (relative, above {bound:g}); it runs the "
                      "architecture's code", UserWarning, stacklevel=2)
        return exit_copy
    fused.check_error = error
    return fused


def _text_config(layer: nn.Module):
    """The model config a decoder layer's attention keeps (``self_attn.config``), or None."""
    return getattr(getattr(layer, "self_attn", None), "config", None)


def _relative(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / scale.float().norm().clamp(min=1e-12))


@torch.no_grad()
def check_against_architecture(family: ExitLayerFamily, fused: FusedExitLayer, exit_copy: nn.Module, config,
                               prompt: int = 3, seed: int = 0) -> float:
    """The largest relative error of ``fused`` against ``exit_copy`` over a ``prompt``-token
    prefill and one decode step on random hidden states (N(0, 1), seed ``seed``, the layer's
    dtype, ``family.dtype``, and device), each into a ``DynamicCache`` of its own: of the layer's update
    (``||out_f - out_a|| / ||out_a - in||``) and of the K/V each wrote (``/ ||K_a||``)."""
    from transformers import DynamicCache

    dtype = family.dtype(exit_copy)
    device = next(t for t in (*exit_copy.parameters(), *exit_copy.buffers())).device
    hidden = config.hidden_size
    gen = torch.Generator(device="cpu").manual_seed(seed)
    caches = (DynamicCache(), DynamicCache())
    worst = 0.0
    for start, tokens in ((0, prompt), (prompt, 1)):
        h = torch.randn(1, tokens, hidden, generator=gen).to(device, dtype)
        positions = torch.arange(start, start + tokens, device=device)[None]
        kwargs = family.check_kwargs(exit_copy, config, positions, dtype)
        outs = [layer(h, cache=cache, **kwargs) for layer, cache in zip((exit_copy, fused), caches)]
        outs = [o[0] if isinstance(o, tuple) else o for o in outs]
        worst = max(worst, _relative(outs[1], outs[0], outs[0] - h))
    idx = exit_copy.self_attn.layer_idx
    arch_slot, fused_slot = caches[0].layers[idx], caches[1].layers[idx]
    for name in ("keys", "values"):
        a, f = getattr(arch_slot, name), getattr(fused_slot, name)
        if a.shape != f.shape or a.dtype != f.dtype:
            raise ValueError(f"the fused layer wrote {name} of shape {tuple(f.shape)} {f.dtype}, the architecture "
                             f"copy {tuple(a.shape)} {a.dtype}")
        worst = max(worst, _relative(f, a, a))
    return worst
