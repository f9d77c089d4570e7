"""The decoder stack's one-token pass when every layer runs as its exit layer (``river_mode("exit")``,
the fully quantized model; lossless mode's exit-path drafts), without the stack's per-pass glue.

Such a pass computes ``norm(exit layers(embed(ids)))`` with the model's own embedding, rotary and final
norm modules and River's exit layers; the backbone runs no layer. The architecture's ``forward``
around it (transformers' output-capture and config-default wrappers, mask creation, the loop over the
decoder layers, most of which return at once after River's exit stack ran them, the output object)
cost about 0.5 ms a decode step on a 0.5B model, beside 5 ms of products. :class:`ExitPass` is the
stack's ``forward`` on River models of the Llama family (:mod:`.fused_llama`): for a pass it can serve
it calls, in order,

- ``stack.embed_tokens(input_ids)`` (the model's module), and ``position_ids`` as the architecture
  makes them when none are given (``arange`` after the cache's length);
- ``stack.rotary_emb(hidden, position_ids)`` (the model's module);
- the first :class:`~river_hf.river.layer.RiverLayer`, which runs every exit layer in one call where
  it can (``river_stack``), then the RiverLayers its call did not run, in order (a hook on a later
  layer or exit layer makes the first one run alone, so every hook sees its own layer's call);
- ``stack.norm(hidden)`` (the model's module),

with the attention mask the architecture would give a one-token pass over full-attention layers: none
when every past position is real; with padding (a 2-D mask with zeros), under ``sdpa``, the boolean
``[batch, 1, 1, past + 1]`` mask of the real positions (transformers' ``create_causal_mask`` for one
query token: every cached position precedes it, so only padding masks a key). So the same calls on
the same tensors as the architecture's forward: the same numbers, token for token.

Any other pass runs the architecture's own ``forward``: a pass that may run a backbone layer (route,
backbone and lossless verify passes), more than one token, ``inputs_embeds``, keyword arguments other
than those transformers' causal LM heads pass (``input_ids``, ``attention_mask``, ``position_ids``,
``cache``, ``inputs_embeds``, ``use_cache``), no cache, sliding-window layers, requested hidden states or
attentions, training mode, a decoder list other than the config's ``num_hidden_layers`` River layers,
exit layers that are not the Llama family's fused ones, or padding under another attention
implementation.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..compat import attn_implementation

__all__ = ["ExitPass", "install_exit_pass", "full_attention"]

#: the keyword arguments transformers' causal LM heads pass their decoder stack
_TAKEN = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache"})
#: the stack's own modules the pass calls
_CALLED = ("embed_tokens", "rotary_emb", "norm")


class ExitPass:
    """The decoder stack's ``forward`` on a River model (module docstring): serves one-token passes
    that run no backbone layer, hands every other call to the architecture's own ``forward``.

    Called as the stack's ``forward`` (keyword arguments as transformers' causal LM heads pass them);
    returns what the architecture's forward returns, a ``BaseModelOutputWithPast``
    (``last_hidden_state`` ``[batch, 1, hidden]`` in the model's dtype, ``cache``).

    Args:
        stack: the decoder stack (``LlamaModel``, ``Qwen2Model``, ``MistralModel``), with
            ``embed_tokens``, ``rotary_emb``, ``norm`` and ``layers`` (River's layers).
        router: the model's :class:`~river_hf.river.layer.RiverRouter`.
    """

    def __init__(self, stack: nn.Module, router):
        self.stack = stack
        self.router = router
        self.architecture = type(stack).forward

    def __call__(self, *args, **kwargs):
        out = self._serve(args, kwargs)
        return out if out is not None else self.architecture(self.stack, *args, **kwargs)

    def _serve(self, args: tuple, kwargs: dict):
        router, stack = self.router, self.stack
        if args or not router.exited or router.stacked_layers or not kwargs.keys() <= _TAKEN:
            return None
        ids, cache = kwargs.get("input_ids"), kwargs.get("cache")
        if (ids is None or kwargs.get("inputs_embeds") is not None or cache is None or ids.dim() != 2
                or ids.shape[1] != 1):
            return None
        if not self.serves_steps():
            return None
        config = stack.config
        use_cache = kwargs.get("use_cache")
        layers = router.layers
        mask = self._mask(kwargs.get("attention_mask"), config)
        if mask is False:
            return None
        hidden = stack.embed_tokens(ids)
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # as the architecture makes them
            position_ids = (torch.arange(1, device=hidden.device) + cache.get_seq_length()).unsqueeze(0)
        position_embeddings = stack.rotary_emb(hidden, position_ids)
        layer_kwargs = {"attention_mask": mask, "position_embeddings": position_embeddings,
                        "position_ids": position_ids, "cache": cache,
                        "use_cache": config.use_cache if use_cache is None else use_cache}
        hidden = layers[0](hidden, **layer_kwargs)
        for layer in layers[max(1, router.stacked_layers):]:
            hidden = layer(hidden, **layer_kwargs)
        return BaseModelOutputWithPast(last_hidden_state=stack.norm(hidden), cache=cache)

    def serves_steps(self) -> bool:
        """What does not depend on the pass: the stack in eval mode, no hidden states or attentions
        asked by its config, full attention only, the config's number of layers, a first exit layer
        that stacks."""
        config, layers = self.stack.config, self.router.layers
        return (not self.stack.training and not config.output_hidden_states and not config.output_attentions
                and full_attention(config) and len(layers) == config.num_hidden_layers
                and getattr(getattr(layers[0], "exit_layer", None), "stacks", False))

    @staticmethod
    def _mask(mask, config):
        """The layers' mask for this one-token pass: None (every past position real), the boolean
        ``[batch, 1, 1, past + 1]`` mask of the real positions (padding, ``sdpa``), or False (the
        architecture's forward makes it)."""
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return False
        real = mask.bool()
        if bool(real.all()):
            return None
        if attn_implementation(config) != "sdpa":
            return False
        return real[:, None, None, :]


def full_attention(config) -> bool:
    """Whether every decoder layer of ``config`` attends to the whole past (no sliding window): Qwen2
    picks each layer's mask by ``layer_types``, Mistral all of them by ``sliding_window`` (its
    forward's ``mask_function``), Llama has only full attention."""
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False
    return getattr(config, "model_type", None) != "mistral" or getattr(config, "sliding_window", None) is None


class _Installed:
    """The handle :func:`install_exit_pass` returns: ``remove()`` gives the stack back its class's
    ``forward`` (as a hook handle's ``remove`` does; ``disable_river`` calls it)."""

    def __init__(self, stack: nn.Module):
        self.stack = stack

    def remove(self) -> None:
        if isinstance(self.stack.__dict__.get("forward"), ExitPass):
            del self.stack.__dict__["forward"]


def install_exit_pass(stack: nn.Module, router) -> _Installed | None:
    """Make an :class:`ExitPass` the ``forward`` of ``stack`` (an instance attribute; the class's
    ``forward`` is untouched) when it has the modules the pass calls (``embed_tokens``, ``rotary_emb``,
    ``norm``) and no ``forward`` of its own already (accelerate's hooks put one there, which the pass
    must not hide); returns the handle that removes it, or None (nothing installed)."""
    if "forward" in stack.__dict__ or not all(isinstance(getattr(stack, name, None), nn.Module) for name in _CALLED):
        return None
    stack.__dict__["forward"] = ExitPass(stack, router)
    return _Installed(stack)
