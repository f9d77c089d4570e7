"""Per-layer routing: each decoder layer sends the hidden state to its backbone or its exit copy.

The architecture's own decoder loop, masks, rotary embeddings and cache calls stay untouched;
River only replaces each entry of the model's layer list with a :class:`RiverLayer` that holds the
original layer (backbone) and its quantized copy (exit layer). Both carry the same ``layer_idx``,
so whichever runs reads and writes that layer's slot of the one KV cache (River-LLM "KV share":
a token that left the backbone early still leaves complete KV for every later token).

The LM head is wrapped the same way (:class:`RiverHead`): a step whose forward pass left the
backbone reads its logits through the quantized *exit head*, a step that stayed on the backbone
through the original head (so τ > 1 stays token-identical to the unmodified model).

One :class:`RiverRouter` per model holds the decision of the current forward pass.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .controllers import ExitRuleList

__all__ = ["RiverRouter", "RiverLayer", "RiverHead", "ROUTE", "BACKBONE_ONLY", "EXIT_ONLY", "PREFILL_POLICIES"]

ROUTE, BACKBONE_ONLY, EXIT_ONLY = "route", "backbone", "exit"
#: ``route``: a multi-token pass (prefill) takes the exit decision once for the whole sequence
#: (River-LLM's sequence-level exit); ``backbone``: it always runs on the backbone (exact KV for
#: the prompt), and only one-token decode steps may exit.
PREFILL_POLICIES = ("route", "backbone")


class RiverRouter:
    """State of the exit decision for the forward pass in flight, and a log of past passes.

    Attributes:
        rules: the :class:`ExitRuleList` asked after each backbone layer.
        num_layers: number of decoder layers L.
        mode: ``"route"`` (normal), ``"backbone"`` (never exit) or ``"exit"`` (every layer runs its
            exit copy: the fully quantized model, for comparisons).
        exit_layer: for the pass in flight, index of the first layer served by its exit copy
            (= number of backbone layers run); L when the pass never left the backbone.
        prefill: how multi-token passes are routed (:data:`PREFILL_POLICIES`).
        log: one ``(batch, tokens, exit_layer, end_time)`` tuple per forward pass since the last
            reset (``end_time``: ``time.perf_counter()`` seconds when the pass finished).
    """

    def __init__(self, rules: ExitRuleList, num_layers: int, prefill: str = "route"):
        self.rules = rules
        self.num_layers = num_layers
        self.mode = ROUTE
        self.prefill = prefill
        self.exited = False
        self._stay = False
        self.exit_layer = num_layers
        self.log: list[tuple[int, int, int, float]] = []
        self._mask = None
        self._token_mask = None
        self._next_mask = None

    def expect_padding_mask(self, attention_mask) -> None:
        """Give the next forward pass its 2-D padding mask (``[batch, past+tokens]``, 1 or True for
        real tokens) ahead of time. ``generate`` turns the mask into a 4-D causal mask (or a dict
        of them) before the decoder stack sees it when the cache is a static one; River's model
        calls this from ``prepare_inputs_for_generation`` with the 2-D mask it started from."""
        is_2d = isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
        self._next_mask = attention_mask if is_2d else None

    def begin(self, attention_mask, tokens: int = 1) -> None:
        """Start a forward pass of ``tokens`` new tokens per row.

        Args:
            attention_mask: the mask the decoder stack got: 2-D ``[batch, past+tokens]`` (int or
                bool, nonzero = real token), or anything else (4-D, a dict, None), in which case
                the mask given by :meth:`expect_padding_mask` for this pass is used, if any; with
                neither, every position counts as real.
            tokens: new tokens per row in this pass.
        """
        self._stay = self.mode == BACKBONE_ONLY or (tokens > 1 and self.prefill == BACKBONE_ONLY)
        self.exited = self.mode == EXIT_ONLY
        self.exit_layer = 0 if self.exited else self.num_layers
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            self._mask = attention_mask
        else:
            self._mask = self._next_mask
        self._next_mask = None
        self._token_mask = None

    def after_backbone(self, layer_idx: int, hidden_in: torch.Tensor, hidden_out: torch.Tensor) -> None:
        """Ask the rules whether the layers after ``layer_idx`` run as exit layers."""
        if self.mode != ROUTE or self._stay or layer_idx + 1 >= self.num_layers:
            return
        if self.rules(layer_idx, hidden_in, hidden_out, self._tokens(hidden_in.shape[1])):
            self.exited = True
            self.exit_layer = layer_idx + 1

    def end(self, batch: int, tokens: int, cache=None) -> None:
        """Finish a forward pass: log it, and tell a :class:`RiverCache` who served each layer."""
        self.log.append((batch, tokens, self.exit_layer, time.perf_counter()))
        if hasattr(cache, "record_exit_layer"):
            cache.record_exit_layer(self.exit_layer, tokens)

    def _tokens(self, n: int):
        if self._mask is None:
            return None
        if self._token_mask is None or self._token_mask.shape[1] != n:
            m = self._mask[:, -n:].bool()
            self._token_mask = None if bool(m.all()) else m
            if self._token_mask is None:
                self._mask = None  # every position is real: no masking needed for this pass
        return self._token_mask


class _ReadsThroughToBackbone(nn.Module):
    """Attributes the wrapper does not have are looked up on its ``backbone`` (the model's own code
    reads ``attention_type``, ``layer_idx``, ``weight`` ... from its layers and head)."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("backbone", "exit_layer", "exit_head") or "backbone" not in self._modules:
                raise
            return getattr(self._modules["backbone"], name)


class RiverLayer(_ReadsThroughToBackbone):
    """A decoder layer that runs its backbone, or its exit copy once the router has exited.

    Called exactly like the wrapped decoder layer (same arguments, same return value). Attributes
    the model's decoder loop reads from its layers (``attention_type``, ``layer_idx``, ...) are
    looked up on the backbone.

    Args:
        backbone: the original decoder layer (kept as is, may be offloaded).
        exit_layer: its quantized copy, same ``layer_idx``.
        router: the model's shared :class:`RiverRouter`.
        layer_idx: position in the decoder stack.
    """

    def __init__(self, backbone: nn.Module, exit_layer: nn.Module, router: RiverRouter, layer_idx: int):
        super().__init__()
        self.backbone = backbone
        self.exit_layer = exit_layer
        self.router = router
        self.river_layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        router = self.router
        if router.exited:
            return self.exit_layer(hidden_states, *args, **kwargs)
        out = self.backbone(hidden_states, *args, **kwargs)
        router.after_backbone(self.river_layer_idx, hidden_states, out[0] if isinstance(out, tuple) else out)
        return out



class RiverHead(_ReadsThroughToBackbone):
    """The LM head, routed: the original head (``backbone``) for a pass that stayed on the backbone,
    the quantized ``exit_head`` for a pass that left it (or when ``exit_head`` is None, the original
    head always). Called like the head: ``[batch, tokens, hidden]`` -> ``[batch, tokens, vocab]``.

    The original head is kept as is (a head tied to the input embeddings stays tied); attributes
    such as ``weight`` are looked up on it.
    """

    def __init__(self, backbone: nn.Module, exit_head: nn.Module | None, router: RiverRouter):
        super().__init__()
        self.backbone = backbone
        self.exit_head = exit_head
        self.router = router

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.exit_head is not None and self.router.exited:
            return self.exit_head(hidden_states)
        return self.backbone(hidden_states)

