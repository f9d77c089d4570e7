"""One decode step of River's decoding loop in exit mode (:mod:`.decode_loop`), without the per-step glue.

A fully quantized decode step of Qwen2.5-Coder-0.5B is ~5 ms of weight products on a 2-core CPU. Around
them, a step through the model's forward spends ~0.5 ms in Python on objects that are the same at every
step of a call: the causal LM's forward and its output objects, the decoder stack's hooks and
:class:`~river_hf.river.exit_pass.ExitPass`' checks, the River layers' and fused layers' calls, and the
exit stack's per-step checks (:class:`~river_hf.river.exit_stack.StackPlan`: every layer's hooks,
switches and weights; every KV-cache slot's class, length and room). Each object touched costs cache
misses there, since the products stream the weights through the caches at every step.

:class:`ExitStep` checks all of that once, when River's loop starts decoding (:meth:`ExitStep.prepare`),
and then does only what such a step computes, with the model's own modules and the same calls on the same
tensors as the forward would:

- ``router.begin`` (what the stack's River pre-hook calls), ``stack.embed_tokens(ids)``,
  ``stack.rotary_emb(hidden, position_ids)``;
- river-int4's ``exit_stack`` over every layer's fused exit layer, writing each step's keys and values
  into the KV-cache slots' room (:class:`~river_hf.river.cache.GrowingLayer`), with the mask
  :class:`~river_hf.river.exit_pass.ExitPass` gives such a pass; through the extension's
  ``ExitStackHandle``, which holds the layers' weights, norms and buffers from step to step (passing
  them at each step hands pybind11 ~400 Python objects);
- ``stack.norm(hidden)``, ``router.end`` (the stack's River post-hook), ``model.lm_head`` of the
  positions ``logits_to_keep`` keeps (transformers' ``slice_logits_to_keep``, as the Llama family's
  causal LM forward does).

So the same tokens, scores and logits (``tests/test_exit_step.py``), and the same cache records. What a
call reads once: the model's and its modules' hooks, its layers, their weights and settings, the
attention implementation and the mask's padding (as a compiled forward reads them once). The slots'
``keys`` / ``values`` views are brought up to date when the step's room runs out and when the loop ends
(:meth:`ExitStep.close`); in between only the step itself reads the cache.

A call it does not serve (:meth:`ExitStep.prepare` returns None) runs the model's forward at every step:
a mode other than exit, a causal LM other than Llama / Qwen2 / Mistral's own forward, any hook on the
model, the decoder stack (other than River's two), a River layer or an exit layer (the modules the step
calls keep theirs: embedding, rotary, norm, head), a global module hook, an exit stack that does not run
(:meth:`~river_hf.river.exit_stack.StackPlan.runs`), a cache whose slots are not River's growing ones,
padding under an attention implementation other than ``sdpa``, or anything the exit pass refuses.

The step profiler (``bench_harness.step_profile``) sees the step through :attr:`ExitStep.observer`.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.llama.modeling_llama import LlamaForCausalLM
from transformers.models.mistral.modeling_mistral import MistralForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

from ..compat import attn_implementation, dynamic_slots
from ..quant import river_int4
from .cache import GrowingLayer
from .exit_pass import ExitPass
from .exit_stack import _plan
from .fused_llama import _ATTENTION, FusedLlamaLayer
from .layer import EXIT_ONLY, RiverLayer

__all__ = ["ExitStep"]

#: the causal LM forwards whose work the step does (the decoder stack's pass, the head on the kept positions)
_FORWARDS = (LlamaForCausalLM.forward, Qwen2ForCausalLM.forward, MistralForCausalLM.forward)


def _global_hooks() -> bool:
    """Whether a global module forward hook is registered (torch's ``register_module_forward_*hook``)."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


def _hooked(module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


class ExitStep:
    """Exit-mode decode steps of one ``generate`` call (module docstring).

    Call it with the step's tokens ``[batch, 1]`` long, ``position_ids`` ``[batch, 1]`` long and the 2-D
    attention mask ``[batch, past + 1]`` (or None, when the call has none); it returns the logits
    ``[batch, 1, vocab]`` in the head's dtype, what the model's forward would return as ``logits``.
    :meth:`close` when the loop ends (also after an error).

    Attributes:
        observer: class-wide, None, or the step profiler while it profiles: it then gets
            ``step_begin(tokens)`` / ``step_end()`` around each step and ``push(category)`` / ``pop()``
            around the exit stack's call; global module hooks and the model's hooks whose ids are in its
            ``hook_ids`` (the profiler's own) do not stop the step.
    """

    observer = None

    @classmethod
    def prepare(cls, model, cache, mask, logits_to_keep=0) -> ExitStep | None:
        """The steps of a call on ``model`` with ``cache`` (after the prefill) and the call's 2-D ``mask``
        ``[batch, prompt]`` (or None), or None when they must run the model's forward (module docstring)."""
        router = getattr(model, "river", None)
        stack = getattr(model, "model", None)
        exit_pass = getattr(stack, "__dict__", {}).get("forward")
        river_hooks = model.__dict__.get("_river_hooks", ())
        if (router is None or router.mode != EXIT_ONLY or not isinstance(exit_pass, ExitPass)
                or type(model).forward not in _FORWARDS or "forward" in model.__dict__
                or not (model._forward_hooks.keys() | model._forward_pre_hooks.keys()) <= cls._observed()
                or len(river_hooks) < 2 or set(stack._forward_pre_hooks) != {river_hooks[0].id}
                or set(stack._forward_hooks) != {river_hooks[1].id} or not exit_pass.serves_steps()
                or (_global_hooks() and cls.observer is None)):
            return None
        layers = tuple(router.layers._modules.values())
        if any(type(layer) is not RiverLayer or _hooked(layer) for layer in layers):
            return None
        exits = tuple(layer.exit_layer for layer in layers)
        if any(type(e) is not FusedLlamaLayer or not e.stacks for e in exits):
            return None
        plan = _plan(exits[0], exits)
        if not plan.runs(_ATTENTION):
            return None
        if mask is not None and not bool(mask.bool().all()) and attn_implementation(stack.config) != "sdpa":
            return None
        slots = dynamic_slots(cache, plan.indices, (GrowingLayer,))
        if not slots or any(type(slot) is not GrowingLayer for slot in slots):
            return None
        length = slots[0].keys.shape[-2]
        if any(slot.keys.shape[-2] != length or slot.keys.dtype != torch.float32 for slot in slots):
            return None
        return cls(model, stack, router, plan, cache, slots, length, mask, logits_to_keep)

    @classmethod
    def _observed(cls) -> set:
        """The ids of the model's hooks that are the observer's (it hears of each step from the step)."""
        return set(cls.observer.hook_ids) if cls.observer is not None else set()

    def __init__(self, model, stack, router, plan, cache, slots, length, mask, logits_to_keep):
        first = plan.layers[0]
        self.router, self.cache, self.slots, self.length = router, cache, slots, length
        self.embed, self.rotary, self.norm, self.head = stack.embed_tokens, stack.rotary_emb, stack.norm, model.lm_head
        self.keep = logits_to_keep
        self.padded = mask is not None and not bool(mask.bool().all())
        # the layers' weights, norms and shapes, held by the extension from step to step
        self.stack = river_int4.extension().ExitStackHandle(*plan.args, first.heads, first.kv_heads, first.head_dim,
                                                            first.scaling)
        self.hidden = first.hidden
        self.keys = self.values = ()
        self.capacity = 0  # positions the rooms hold

    def __call__(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask) -> torch.Tensor:
        observer = self.observer
        if observer is not None:
            observer.step_begin(tokens.shape[1])
        router, cache = self.router, self.cache
        batch = tokens.shape[0]
        router.begin(mask, 1, cache, batch=batch)
        hidden = self.embed(tokens)
        cos, sin = self.rotary(hidden, position_ids)
        layer_mask = mask.bool()[:, None, None, :] if self.padded else None  # as ExitPass gives it
        if self.length >= self.capacity:
            self._room()
        if observer is not None:
            observer.push("norms/rotary/elementwise")
        out = self.stack.run(hidden.reshape(batch, self.hidden), cos, sin, self.length, layer_mask)
        if observer is not None:
            observer.pop()
        self.length += 1
        hidden = self.norm(out.view(batch, 1, self.hidden))
        router.end(batch, 1, cache)
        logits = self.head(slice_logits_to_keep(hidden, self.keep))
        if observer is not None:
            observer.step_end()
        return logits

    def _room(self) -> None:
        """Bring the slots up to date and take their rooms (each with space for at least one position)."""
        self.close()
        rooms = [slot.make_room(1) for slot in self.slots]
        self.keys, self.values = [r[0] for r in rooms], [r[1] for r in rooms]
        self.stack.set_rooms(self.keys, self.values)
        self.capacity = min(min(k.shape[2], v.shape[2]) for k, v in rooms)

    def close(self) -> None:
        """Give every slot its ``keys`` / ``values``: the first ``length`` positions of its room."""
        n = self.length
        for slot, keys, values in zip(self.slots, self.keys, self.values):
            slot.grown(keys.narrow(2, 0, n), values.narrow(2, 0, n))
