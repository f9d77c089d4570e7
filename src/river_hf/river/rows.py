"""Running one decoder layer on some rows of the batch (route mode's per-row exit).

In a batched route-mode pass each row leaves the backbone on its own tokens, so at a layer some
rows run the backbone layer and the others what the strategy runs after the exit (River: the
layer's exit copy). Each path runs on its own rows (gathered with ``index_select``) and the
outputs are scattered back; both paths write their rows of the layer's one KV-cache slot (KV
share). :class:`RowsCache` is the cache as one path sees it: its ``update`` appends the path's
rows to the full slot and returns only those rows' keys and values. :func:`take_rows` slices the
layer's other arguments (4-D attention mask, rotary ``(cos, sin)``, position ids) to the rows.

Only caches whose slots append by concatenation can be split by rows (:func:`splittable`:
transformers' ``DynamicCache`` / River's ``RiverCache`` with ``DynamicLayer``,
``DynamicSlidingWindowLayer`` and River's ``GrowingLayer`` slots, not offloaded); with another cache (static, quantized,
offloaded) a batch leaves the backbone when all its rows do, as one decision.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .cache import GrowingLayer

__all__ = ["splittable", "RowsCache", "take_rows", "rows_kwargs", "position_ids"]

_SPLITTABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, GrowingLayer)


def splittable(cache) -> bool:
    """Whether a forward pass with ``cache`` may run different rows through different paths: no
    cache, or a (not offloaded) ``DynamicCache`` whose slots are ``DynamicLayer`` /
    ``DynamicSlidingWindowLayer`` / ``GrowingLayer`` exactly (they keep the new positions last and return views of
    what they store, which :class:`RowsCache` relies on)."""
    if cache is None:
        return True
    if not isinstance(cache, DynamicCache) or getattr(cache, "offloading", False):
        return False
    return all(type(layer) in _SPLITTABLE_LAYERS for layer in cache.layers)


class RowsCache:
    """The KV cache as a layer run on ``rows`` of the batch sees it.

    ``update(keys, values, layer_idx)`` takes ``[len(rows), heads, tokens, head_dim]`` and returns
    those rows' full keys and values. The first path to write a slot in this layer call appends a
    full-batch block (its rows filled, the others zero) through the real cache's ``update``; the
    second writes its rows into the positions just appended (in place: the slot's stored tensors
    are the returned ones or views of them). Every other attribute is the real cache's.

    Args:
        cache: the pass's cache (:func:`splittable`).
        rows: ``[n]`` long tensor, the batch rows this path runs, ascending.
        batch: the full batch size.
        written: one dict shared by the paths of one layer call (layer_idx -> appended keys,
            values), empty at the start of the call.
    """

    def __init__(self, cache, rows: torch.Tensor, batch: int, written: dict):
        self._cache = cache
        self._rows = rows
        self._batch = batch
        self._written = written

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        rows = self._rows.to(key_states.device)
        entry = self._written.get(layer_idx)
        if entry is None:
            keys = key_states.new_zeros((self._batch, *key_states.shape[1:])).index_copy_(0, rows, key_states)
            values = value_states.new_zeros((self._batch, *value_states.shape[1:])).index_copy_(0, rows, value_states)
            entry = self._written[layer_idx] = self._cache.update(keys, values, layer_idx, *args, **kwargs)
        else:
            t = key_states.shape[-2]
            entry[0][:, :, -t:].index_copy_(0, rows, key_states)
            entry[1][:, :, -t:].index_copy_(0, rows, value_states)
        return entry[0].index_select(0, rows), entry[1].index_select(0, rows)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_cache"], name)


def take_rows(value, rows: torch.Tensor, batch: int):
    """``value`` restricted to ``rows``: a tensor of 2+ dims whose first dim is ``batch`` is
    indexed along it (a mask or rotary table with batch dim 1 broadcasts and stays as it is, and
    so do 1-D tensors such as ``cache_position``); tuples, lists and dicts are followed; anything
    else is returned unchanged."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == batch:
            return value.index_select(0, rows.to(value.device))
        return value
    if type(value) in (tuple, list):
        return type(value)(take_rows(v, rows, batch) for v in value)
    if type(value) is dict:
        return {k: take_rows(v, rows, batch) for k, v in value.items()}
    return value


def rows_kwargs(kwargs: dict, rows: torch.Tensor, batch: int, written: dict) -> dict:
    """A decoder layer's keyword arguments for a call on ``rows``: the cache (``cache`` /
    ``past_key_values``) as a :class:`RowsCache` sharing ``written``, the rest :func:`take_rows`."""
    out = {}
    for key, value in kwargs.items():
        if key in ("cache", "past_key_values") and value is not None:
            out[key] = RowsCache(value, rows, batch, written)
        else:
            out[key] = take_rows(value, rows, batch)
    return out


def position_ids(mask: torch.Tensor, tokens: int) -> torch.Tensor:
    """Position ids ``[batch, tokens]`` (long) of the last ``tokens`` columns of a left-padded
    batch's 2-D mask ``[batch, length]``: each row's real positions count from 0 (``cumsum - 1``,
    as ``generate`` computes them); padding positions get 0 (they are never attended to)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -tokens:]
