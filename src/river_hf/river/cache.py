"""RiverCache: transformers' DynamicCache that also records who served each layer at each step."""

from __future__ import annotations

import torch
from transformers import DynamicCache

__all__ = ["RiverCache"]


class RiverCache(DynamicCache):
    """A :class:`transformers.DynamicCache` (same constructor, same per-layer storage) that records,
    for each forward pass (step), which decoder layers were served by the backbone and which by
    their exit copy.

    Backbone and exit layer i write to the same slot i (River-LLM "KV share"), so the KV tensors
    are complete whatever the route; the record tells how each slot's entries were produced.

    Usable as ``cache=RiverCache(config=model.config)`` (or ``past_key_values=``) in ``generate``;
    a River model creates one by itself when none is passed.

    Attributes:
        exit_layers: per step, the index of the first layer served by its exit copy (the number
            of backbone layers run); ``num_layers`` when the step never left the backbone.
        step_tokens: per step, the number of tokens in that forward pass (prefill: the prompt).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exit_layers: list[int] = []
        self.step_tokens: list[int] = []

    def record_exit_layer(self, exit_layer: int, tokens: int) -> None:
        """Called by the River router at the end of each forward pass."""
        self.exit_layers.append(int(exit_layer))
        self.step_tokens.append(int(tokens))

    def served_by_exit(self, num_layers: int) -> torch.Tensor:
        """``[steps, num_layers]`` bool: True where layer j of step s ran its exit copy."""
        layers = torch.arange(num_layers)
        return torch.tensor(self.exit_layers, dtype=torch.long)[:, None] <= layers[None, :]

    def crop(self, max_length: int) -> None:
        """Crop the KV to ``max_length`` positions and drop the records of steps past it."""
        super().crop(max_length)
        if max_length < 0:
            max_length = sum(self.step_tokens) + max_length
        kept, total = 0, 0
        for n in self.step_tokens:
            if total + n > max_length:
                break
            total += n
            kept += 1
        del self.exit_layers[kept:], self.step_tokens[kept:]
