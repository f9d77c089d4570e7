"""River's exit stack: a decode step's exit layers after the exit in one call of river-int4's
extension (``exit_stack``, ``csrc/river_int4.cpp``), for the Llama family's fused exit layers
(:class:`~river_hf.river.fused_llama.FusedLlamaLayer`, every product one river-int4 module).

Per layer the call computes what the layer's own two C++ calls compute for one query token, with
River's one-token attention, and updates the layer's KV-cache slot as ``cache.update`` would: on
transformers' ``DynamicLayer`` the past and the new position concatenated and assigned to the
slot's ``keys`` / ``values`` (:func:`~river_hf.compat.dynamic_slots`), on River's
:class:`~river_hf.river.cache.GrowingLayer` the new position written into the slot's room. So the
same numbers and the same cache as layer by layer; what goes is the Python and argument passing of
two calls a layer.

What a tuple of layers needs for the call and does not change between steps is a
:class:`StackPlan`, made once per tuple: exit_stack's per-layer argument lists, the layers' cache
slot indices and attention configs, and, for each tensor and hook dict read, the dict it was read
from. Each step then checks by C-level iteration (``map``), not a Python loop over the layers:

- that the plan is still the layers' own: the same layer objects, each layer's ``int4_calls`` switch
  and hook dicts, and every packed weight, bias and norm weight still the one its module holds
  (``.to`` and the like put new buffers in place);
- what may change between steps otherwise: the layers' hooks (a hook needs the layer's own
  output), :meth:`~river_hf.river.fused_layer.FusedExitLayer.serves` (training, a hook on the
  architecture copy) and their attention implementation.
"""

from __future__ import annotations

from operator import attrgetter, getitem, is_, methodcaller

import torch

from ..compat import attn_implementation, dynamic_slots
from ..quant import river_int4
from .cache import GrowingLayer

__all__ = ["StackPlan", "stack_forward", "one_token_mask"]

_SERVES = methodcaller("serves")
#: the per-layer attributes that must agree for one call: head_dim, heads, kv_heads, scaling, hidden
_SHAPE = attrgetter("head_dim", "heads", "kv_heads", "scaling", "hidden")


def one_token_mask(mask, batch: int, length: int) -> bool:
    """Whether river-int4's one-token attention takes ``mask`` as it is: none, or float (added) or bool
    (true: attended) ``[batch or 1, 1, 1, length]``; any other form goes to SDPA."""
    return mask is None or (mask.dim() == 4 and mask.shape[0] in (1, batch) and mask.shape[1] == 1
                            and mask.shape[2] == 1 and mask.shape[3] == length
                            and mask.dtype in (torch.float32, torch.bool))


def _holder(module: torch.nn.Module, name: str) -> dict:
    """The dict that holds ``module``'s attribute ``name``: its parameters, its buffers or its own."""
    for d in (module._parameters, module._buffers):
        if name in d:
            return d
    return module.__dict__


class StackPlan:
    """What one ``exit_stack`` call over ``layers`` (fused layers, the first exit layer first) needs
    from step to step (module docstring).

    Attributes:
        layers: the layers, in decoder order.
        joins: whether they can share one call at all: every one on its int4 calls
            (``int4_calls``), of the first layer's class, of one shape (head_dim, heads, KV heads,
            scaling, hidden) and of one layer type (``config.layer_types``: a sliding-window layer's
            mask is not a full one's).
        args: ``(packed, bias, group, norms, eps)``: per layer, in order, the packed weights, biases
            and group sizes of q|k|v, o, gate|up and down, and the two norms' weights and epsilons.
        indices: the layers' KV-cache slot indices.
    """

    __slots__ = ("layers", "joins", "args", "indices", "configs", "hooks", "dicts", "names", "objects")

    def __init__(self, layers: tuple):
        first = layers[0]
        types = getattr(first.attn_config, "layer_types", None)
        shape = _SHAPE(first)
        packed, bias, group, norms, eps, hooks = [], [], [], [], [], []
        dicts, names, objects = [], [], []

        def held(module, name: str):
            d = _holder(module, name)
            dicts.append(d)
            names.append(name)
            objects.append(d[name])
            return d[name]

        calls = [held(layer, "int4_calls") for layer in layers]  # a layer's switch (tests flip it)
        for layer in layers:
            hooks += [held(layer, "_forward_hooks"), held(layer, "_forward_pre_hooks")]
        self.layers = layers
        self.joins = all(calls) and all(type(layer) is type(first) and _SHAPE(layer) == shape
                                        and (types is None or types[layer.layer_index] == types[first.layer_index])
                                        for layer in layers)
        for layer in layers if self.joins else ():
            for key in ("qkv", "o", "gu", "down"):
                kernel = layer.kernels[key][0]
                packed.append(held(kernel, "packed"))
                bias.append(held(kernel, "bias"))
                group.append(kernel.group_size)
            for norm in layer.norms:
                norms.append(held(norm, "weight"))
                eps.append(norm.variance_epsilon)
        self.args = (packed, bias, group, norms, eps)
        self.indices = [layer.layer_index for layer in layers]
        # each distinct attention config once (the layers usually share one): its implementation is read per step
        self.configs = tuple({id(layer.attn_config): layer.attn_config for layer in layers}.values())
        self.hooks = tuple(hooks)
        self.dicts, self.names, self.objects = tuple(dicts), tuple(names), tuple(objects)

    def current(self, layers: tuple) -> bool:
        """Whether this plan is still ``layers``' own: the same layer objects, and every tensor and hook
        dict it read still the one its module holds."""
        return (len(layers) == len(self.layers) and all(map(is_, self.layers, layers))
                and all(map(is_, map(getitem, self.dicts, self.names), self.objects)))

    def runs(self, served: tuple) -> bool:
        """Whether the layers may run in one call this step: they join (their int4 calls on, as
        :meth:`current` checks), and each has no hook, serves the call and has an attention
        implementation in ``served``."""
        return (self.joins and not any(self.hooks) and all(map(_SERVES, self.layers))
                and all(map(served.__contains__, map(attn_implementation, self.configs))))


def _plan(first, layers: tuple) -> StackPlan:
    """``layers``' plan, kept on ``first`` per tuple of layers and remade when no longer current."""
    plans = first.__dict__.setdefault("_stack_plans", {})
    key = tuple(map(id, layers))
    plan = plans.get(key)
    if plan is None or not plan.current(layers):
        plan = plans[key] = StackPlan(layers)
    return plan


def stack_forward(first, following: tuple, hidden_states: torch.Tensor, attention_mask, cache,
                  position_embeddings, served: tuple) -> torch.Tensor | None:
    """``first`` and the exit layers ``following`` it on a decode step, in one ``exit_stack`` call:
    ``hidden_states`` ``[batch, 1, hidden]`` fp32 in, the last layer's output ``[batch, 1, hidden]``
    out, each layer's cache slot updated. None when that call cannot serve them: not one query token
    in fp32, a mask :func:`one_token_mask` does not take, rotary tables ``cos`` / ``sin`` not fp32
    ``[batch or 1, 1, head_dim]``, a cache it does not update this way (static, sliding-window,
    quantized, offloaded, a subclass's own ``update``) or slots of different lengths, or a plan that
    does not run (:meth:`StackPlan.runs`, with ``served`` the attention implementations taken)."""
    batch, tokens, hidden = hidden_states.shape
    d = first.head_dim
    if (position_embeddings is None or tokens != 1 or hidden_states.dtype != torch.float32 or d % 8
            or (attention_mask is not None and not isinstance(attention_mask, torch.Tensor))):
        return None
    cos, sin = position_embeddings
    if (cos.dtype != torch.float32 or cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != 1
            or cos.shape[2] != d or sin.shape != cos.shape or sin.dtype != torch.float32):
        return None
    layers = (first, *following)
    plan = _plan(first, layers)
    if not plan.runs(served):
        return None
    growing = False
    if cache is None:
        slots, length = None, 1
    else:
        slots = dynamic_slots(cache, plan.indices, (GrowingLayer,))
        if slots is None:
            return None
        length = slots[0].keys.shape[-2] + 1
        if any(slot.keys.shape[-2] + 1 != length or slot.keys.dtype != torch.float32 for slot in slots):
            return None
        growing = all(type(slot) is GrowingLayer for slot in slots)
    if not one_token_mask(attention_mask, batch, length):
        return None
    if not slots:
        past_keys, past_values = [], []
    elif growing:  # the new position is written into each slot's room (river.cache.GrowingLayer)
        rooms = [slot.make_room(1) for slot in slots]
        past_keys, past_values = [r[0] for r in rooms], [r[1] for r in rooms]
    else:
        past_keys, past_values = [slot.keys for slot in slots], [slot.values for slot in slots]
    out = river_int4.extension().exit_stack(hidden_states.reshape(batch, hidden), *plan.args, cos, sin, past_keys,
                                            past_values, length - 1 if growing else -1, attention_mask,
                                            first.heads, first.kv_heads, d, first.scaling)
    if slots:
        n = len(layers)
        for slot, keys, values in zip(slots, out[1:1 + n], out[1 + n:]):
            if growing:
                slot.grown(keys, values)
            else:
                slot.keys, slot.values = keys, values
    return out[0].view(batch, 1, hidden)
