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
        row_exit_layers: per step, None when every row of the batch exited at ``exit_layers``'
            layer, else the exit layer of each row (a batch whose rows exited at different
            layers; ``exit_layers`` then holds the deepest).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exit_layers: list[int] = []
        self.step_tokens: list[int] = []
        self.row_exit_layers: list[tuple[int, ...] | None] = []

    def record_exit_layer(self, exit_layer: int, tokens: int, row_exit_layers=None) -> None:
        """Called by the River router at the end of each forward pass (``row_exit_layers``: each
        row's exit layer when the rows differ, else None)."""
        self.exit_layers.append(int(exit_layer))
        self.step_tokens.append(int(tokens))
        self.row_exit_layers.append(None if row_exit_layers is None else tuple(int(e) for e in row_exit_layers))

    def served_by_exit(self, num_layers: int) -> torch.Tensor:
        """``[steps, num_layers]`` bool: True where layer j of step s ran its exit copy (for a step
        whose rows exited at different layers: for every row, see ``row_exit_layers``)."""
        layers = torch.arange(num_layers)
        return torch.tensor(self.exit_layers, dtype=torch.long)[:, None] <= layers[None, :]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``tokens_to_remove`` positions, transformers' meaning (5.x): ``crop(-n)``
        removes n, ``crop(0)`` removes none (sliding-window layers may still shrink back to their
        window). The per-step records follow: steps wholly past the new length are dropped, and a
        step cut in the middle (a verify pass of several tokens) keeps the tokens that remain, so
        ``sum(step_tokens)`` equals the cache length again.

        Raises:
            ValueError: ``tokens_to_remove`` > 0 (the old absolute-length meaning is gone in
                transformers 5; its layers raise ValueError or RuntimeError for it, this one error
                says what to pass instead).
        """
        if tokens_to_remove > 0:
            raise ValueError(f"RiverCache.crop({tokens_to_remove}): a positive value is not supported; pass -n to remove "
                             "the last n positions (transformers 5 meaning), 0 to remove none")
        super().crop(tokens_to_remove)
        remove = abs(int(tokens_to_remove))
        self.trim_records(remove)
        marks = getattr(self, "river_absent", None)  # KVMask's per-layer absence marks follow the cut
        if marks and remove:
            for idx, rec in marks.items():
                marks[idx] = rec[:, :-remove]

    def trim_records(self, remove: int) -> None:
        """Drop the per-step records of the last ``remove`` positions (a step cut in the middle keeps
        its remaining tokens). Called by :meth:`crop`, and by the ``recompute`` strategy, which cuts
        each layer back by its own amount (:mod:`.strategies`)."""
        while remove and self.step_tokens:
            if self.step_tokens[-1] > remove:
                self.step_tokens[-1] -= remove
                break
            remove -= self.step_tokens.pop()
            self.exit_layers.pop()
            if self.row_exit_layers:
                self.row_exit_layers.pop()
