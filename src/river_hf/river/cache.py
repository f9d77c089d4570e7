"""RiverCache: transformers' DynamicCache that also records who served each layer at each step, on
slots that grow in place (:class:`GrowingLayer`)."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["RiverCache", "GrowingLayer"]


def _prefix_of(view: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``view`` is ``buf``'s first positions along dim 2 (same start, strides, other sizes)."""
    return (view.dim() == 4 and view.data_ptr() == buf.data_ptr() and view.stride() == buf.stride()
            and view.shape[:2] == buf.shape[:2] and view.shape[3] == buf.shape[3] and view.dtype == buf.dtype)


class GrowingLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` whose ``keys`` / ``values`` (``[batch, kv_heads, length, head_dim]``,
    the model's dtype, as there) are the first ``length`` positions of buffers with room for more.
    ``update`` copies the new positions into that room where ``DynamicLayer.update`` concatenates, which
    copies the whole slot at every step (2 x length rows a layer per decode step, quadratic over a
    generation). The same elements, so the same numbers; the tensors are views whose head stride is the
    buffer's (attention reads them by strides: transformers' ``sdpa`` / ``eager``, River's own).

    Room: an allocation holds ``max(MIN_ROOM, needed // 4)`` positions beyond those needed, so a
    generation allocates and copies again every ~25 % of growth (memory: at most ~1.25 x the slot plus
    ``MIN_ROOM`` positions). ``crop`` leaves a prefix view, whose room the next update reuses (the
    positions after it are overwritten); anything that puts other tensors in ``keys`` / ``values``
    (``batch_select_indices``, ``reorder_cache``, an assignment) makes the next update allocate anew.
    River's exit stack writes a decode step's positions in that room too (:meth:`make_room`,
    :meth:`grown`; :mod:`river_hf.river.fused_llama`)."""

    #: spare positions an allocation holds at least
    MIN_ROOM = 128

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.room = None  # (keys buffer, values buffer, the keys view, the values view) last made

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states`` / ``value_states`` ``[batch, kv_heads, tokens, head_dim]`` (as
        ``DynamicLayer.update``) and return the slot's keys and values, ``[batch, kv_heads, length, head_dim]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, k = self.get_seq_length(), key_states.shape[-2]
        kbuf = self._buffer(0, self.keys, key_states, n, k)
        vbuf = self._buffer(1, self.values, value_states, n, k)
        kbuf.narrow(2, n, k).copy_(key_states)
        vbuf.narrow(2, n, k).copy_(value_states)
        self.room = (kbuf, vbuf, None, None)
        return self.grown(kbuf.narrow(2, 0, n + k), vbuf.narrow(2, 0, n + k))

    def make_room(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers ``[batch, kv_heads, capacity, head_dim]`` whose first
        ``get_seq_length()`` positions are the slot and which have room for ``tokens`` more, for a
        caller that writes them there and then calls :meth:`grown` with the longer views. The slot
        must be initialized and hold at least one position."""
        room = self.room
        if room is not None and self.keys is room[2] and self.values is room[3]:  # the views last made: room?
            n = room[2].shape[2] + tokens
            if n <= room[0].shape[2] and n <= room[1].shape[2]:
                return room[0], room[1]
        n = self.get_seq_length()
        kbuf = self._buffer(0, self.keys, self.keys, n, tokens)
        vbuf = self._buffer(1, self.values, self.values, n, tokens)
        self.room = (kbuf, vbuf, None, None)
        return kbuf, vbuf

    def grown(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take ``keys`` / ``values``, prefix views of the buffers of the last :meth:`make_room` (or
        update), as the slot; returns them."""
        self.keys, self.values = keys, values
        self.room = (self.room[0], self.room[1], keys, values)
        return keys, values

    def _buffer(self, i: int, view: torch.Tensor, like: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The buffer (``i`` 0: keys, 1: values) whose first ``n`` positions are ``view`` with room for
        ``k`` more positions of ``like``'s batch, heads, head_dim, dtype and device: the one in use,
        else a new one with ``view`` copied in."""
        room = self.room
        if room is not None:
            buf = room[i]
            if (n + k <= buf.shape[2] and (view is room[2 + i] or (n and _prefix_of(view, buf)))
                    and like.shape[:2] == buf.shape[:2] and like.shape[3] == buf.shape[3]
                    and like.dtype == buf.dtype and like.device == buf.device):
                return buf
        b, h, _, d = like.shape
        buf = like.new_empty((b, h, n + k + max(self.MIN_ROOM, (n + k) // 4), d))
        if n:
            buf.narrow(2, 0, n).copy_(view)
        return buf



class RiverCache(DynamicCache):
    """A :class:`transformers.DynamicCache` (same constructor) that records, for each forward pass
    (step), which decoder layers were served by the backbone and which by their exit copy. Its
    full-attention slots are :class:`GrowingLayer` (the same tensors' values, grown in place);
    sliding-window slots are transformers' own.

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
        # full-attention slots grow in place (GrowingLayer); sliding-window and filled slots stay as made
        self.layers = [GrowingLayer() if type(layer) is DynamicLayer and not layer.is_initialized else layer
                       for layer in self.layers]
        if getattr(self, "layer_class_to_replicate", None) is DynamicLayer:
            self.layer_class_to_replicate = GrowingLayer
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
