"""After the exit: what the decoder layers a forward pass skipped do, one strategy object each.

Every strategy takes the same exit decision (the router's exit rules: River-LLM's state
transition similarity against τ after each backbone layer) and reads the token out through the
same head (the exit head when one is configured, else the original LM head). In a batch, the
strategies with ``per_row`` (``river``, ``state-propagation``) let each row exit on its own
tokens (the rows that exited run the strategy, the others the backbone, :mod:`.rows`); the
others take one decision for the whole batch (its rows' minimum similarity), because per row
their cache slots would differ in length within one tensor (``recompute``, ``skipdecode``) or
their absence marks would be appended once per path (``kv-mask``).
They differ only in the layers after the exit and their slot of the KV cache, which is the
comparison River-LLM makes (River-LLM, Sec. 2 "KV absence" and Sec. 4 baselines):

- ``river`` (:class:`ExitLayers`): the skipped layers run their cheap 4-bit exit copies, which
  read and write the layer's slot of the one KV cache (River-LLM Sec. 3.1, "KV share").
- ``recompute`` (:class:`Recompute`): skipped layers do nothing; the tokens that exited are fed
  again, with the next token, from the last position every layer has (EE-LLM, Chen et al. 2023,
  Sec. 4.2 "KV recomputation", batched with the next forward pass).
- ``skipdecode`` (:class:`SkipDecode`): skipped layers do nothing, and a token may not go deeper
  than the token before it, so no token ever reads K/V that an earlier token lacks (SkipDecode,
  Del Corro et al. 2023, Sec. 3 "monotonically decreasing exit points").
- ``state-propagation`` (:class:`StatePropagation`): each skipped layer computes only its input
  norm and K/V projections of the exit hidden state (+ k-norm, + rotary) and writes them to its
  cache slot (CALM, Schuster et al. 2022, Sec. 3.3 "state propagation").
- ``kv-mask`` (:class:`KVMask`): each skipped layer marks the exited token absent; later tokens
  do not attend to it at that layer (D-LLM, Jiang et al. 2024, Sec. 3.3 KV-cache masking).

A strategy is chosen by ``RiverConfig.strategy`` (saved with a River folder) or per call with
``model.river_strategy(name)``. The routing wrapper (:class:`~river_hf.river.layer.RiverLayer`)
calls into it; no decoder loop is copied, each architecture keeps its own masks, rotary and cache
calls. τ > 1 never exits, so every strategy then gives the unmodified model's tokens.

The baselines (every strategy but ``river``) need a dynamic KV cache (the default
:class:`~river_hf.river.cache.RiverCache`, or a ``DynamicCache``): their cache slots differ in
length per layer (``recompute``, ``skipdecode``) or carry per-layer absence marks (``kv-mask``).
"""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache

from ..compat import attn_implementation
from ..errors import RiverError

__all__ = ["STRATEGIES", "ExitStrategy", "ExitLayers", "Recompute", "SkipDecode", "StatePropagation", "KVMask",
           "get_strategy", "cache_of"]


def cache_of(kwargs: dict):
    """The KV cache a decoder layer (or the decoder stack) was called with (transformers 5.24 calls
    it ``cache``; older releases ``past_key_values``), or None."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def _layer_lengths(cache) -> list[int]:
    return [layer.get_seq_length() if layer.is_initialized else 0 for layer in cache.layers]


class ExitStrategy:
    """Base class: what the layers after the exit do. Subclasses override the hooks they need.

    Attributes:
        name: the ``RiverConfig.strategy`` value that selects it.
        runs_exit_layers: whether skipped layers run their exit copies (only ``river``).
        masks_attention: whether :meth:`before_layer` must run before every layer that runs
            (only ``kv-mask``; the others keep the hot path to one branch).
        needs_dynamic_cache: whether the strategy can only work on a ``DynamicCache``.
        per_row: whether, in a batch, each row may exit at its own layer (:meth:`skipped` then
            runs on the exited rows only, with a :class:`~river_hf.river.rows.RowsCache`);
            otherwise the batch exits as one, when all its rows would.
    """

    name = ""
    runs_exit_layers = False
    masks_attention = False
    needs_dynamic_cache = True
    per_row = False

    def check_cache(self, cache) -> None:
        """Raises RiverError when ``cache`` is not a dynamic cache and the strategy needs one."""
        if cache is not None and self.needs_dynamic_cache and not isinstance(cache, DynamicCache):
            raise RiverError(
                f"River strategy {self.name!r} needs a dynamic KV cache (its layers' cache slots differ in length or "
                f"carry absence marks), got {type(cache).__name__}; drop cache_implementation / the cache you passed "
                "(a River model makes a RiverCache), or use strategy='river'")

    def exit_cap(self, cache, num_layers: int) -> int:
        """The deepest exit layer the next pass may have (``num_layers``: no cap)."""
        return num_layers

    def prepare_inputs(self, model, input_ids: torch.Tensor, kwargs: dict) -> int | None:
        """Called by ``prepare_inputs_for_generation`` before each decode step; may change the
        cache and return how many of the last ``input_ids`` the step must feed (None: as usual)."""
        return None

    def skipped(self, layer, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """Run for each decoder layer after the exit; returns its output hidden states
        (``[batch, tokens, hidden]``, as the decoder layer would). Default: the identity, and the
        layer's cache slot is left as it is."""
        return hidden_states

    def before_layer(self, layer, hidden_states: torch.Tensor, kwargs: dict) -> dict:
        """Run before each layer that does run (backbone or exit copy) when
        ``masks_attention``; returns its keyword arguments."""
        return kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ExitLayers(ExitStrategy):
    """River-LLM (Sec. 3.1): every layer after the exit runs its exit layer (the 4-bit copy), which
    writes K/V to the same cache slot as the backbone layer would ("KV share"); no K/V is ever
    missing, so any cache type works."""

    name = "river"
    runs_exit_layers = True
    needs_dynamic_cache = False
    per_row = True

    def skipped(self, layer, hidden_states, args, kwargs):
        return layer.exit_layer(hidden_states, *args, **kwargs)


class Recompute(ExitStrategy):
    """Batching recompute (EE-LLM, Chen et al. 2023, Sec. 4.2 "KV recomputation"): skipped layers do
    nothing, so the layers after a token's exit lack its K/V. Before the next decode step, every
    layer's cache slot is cut back to the last position that *every* layer has, and that step
    feeds the exited token(s) again together with the new token, from layer 0, through every layer
    (it does not exit: the deep layers must run for the exited tokens anyway, and on one device
    their weights are read once for all rows of the pass, so the new token reads out at full depth
    too). Exits therefore happen at most every other step, and the pending tokens never pile up.

    Sliding-window cache layers keep their past states (``activate_past_recording``) so that they
    can be cut back; the cut restricts them to their window again."""

    name = "recompute"

    def exit_cap(self, cache, num_layers):
        if isinstance(cache, DynamicCache):
            lengths = _layer_lengths(cache)
            if lengths and max(lengths) > min(lengths):
                raise RiverError(
                    "strategy 'recompute': this forward pass would read K/V that earlier exited tokens never wrote "
                    f"(cache slots hold {min(lengths)} to {max(lengths)} positions); call generate(), or first pass the "
                    "cache through model.river.strategy.prepare_inputs(model, all_ids, {'cache': cache}) and feed the "
                    "tokens it returns")
        else:
            self.check_cache(cache)
        return num_layers

    def prepare_inputs(self, model, input_ids, kwargs):
        cache = kwargs.get("cache")
        if not isinstance(cache, DynamicCache):
            self.check_cache(cache)
            return None
        lengths = _layer_lengths(cache)
        if not lengths or max(lengths) == 0:
            return None  # prefill
        for layer in cache.layers:  # from the first decode step on, sliding layers keep what a cut needs
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        complete = min(lengths)
        for layer, n in zip(cache.layers, lengths):
            if layer.is_initialized and (n > complete or getattr(layer, "record_past", False)):
                layer.crop(complete - n)  # -(positions past `complete`); 0 restricts a sliding layer to its window
        if max(lengths) == complete:
            return None
        if hasattr(cache, "trim_records"):
            cache.trim_records(max(lengths) - complete)
        model.river.expect_decode_pass(full_depth=True)
        return input_ids.shape[1] - complete


class SkipDecode(ExitStrategy):
    """Monotonically decreasing exit (SkipDecode, Del Corro et al. 2023, Sec. 3): a token's exit
    layer is min(the rules' decision, the exit layer of the token before it); the layers after the
    exit do nothing. No later token then reads a layer's K/V that an earlier token lacks.

    Warm-up and reset rule used here: the prompt runs every layer (with ``prefill="backbone"``;
    with ``prefill="route"`` the prompt's own exit is the first cap), then the cap is the
    shallowest exit so far in the sequence. It is read off the KV cache (the first layer whose slot
    is shorter than layer 0's), so it resets only with a new cache, i.e. per ``generate`` call.

    Two differences from the SkipDecode paper, both from River-LLM's framing of it as the
    "mono-decreasing exit" baseline: the paper fixes the per-position layer budget ahead of
    generation (linear decay with the position) instead of taking it from the exit rule, and it
    spends the budget by skipping the *lower* layers (the top layers always run), where this
    baseline exits early (the layers after the exit are skipped). economize's
    ``SkipDecodeConfig(skip="top")`` is the same rule; ``benchmarks/economize_crosscheck.py``
    checks the two agree."""

    name = "skipdecode"

    def exit_cap(self, cache, num_layers):
        if not isinstance(cache, DynamicCache):
            self.check_cache(cache)
            return num_layers
        lengths = _layer_lengths(cache)
        if not lengths:
            return num_layers
        for i, n in enumerate(lengths[:num_layers]):
            if n < lengths[0]:
                return max(i, 1)
        return num_layers


def _rotary(attn):
    """The ``apply_rotary_pos_emb`` of ``attn``'s modeling module (each architecture's own)."""
    fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if fn is None:
        raise RiverError(f"strategy 'state-propagation' found no apply_rotary_pos_emb next to {type(attn).__name__}; "
                         "use another strategy for this architecture")
    return fn


class StatePropagation(ExitStrategy):
    """State propagation (CALM, Schuster et al. 2022, Sec. 3.3): the exit hidden state is copied to
    every skipped layer, which computes only what later tokens need from it, its K and V:
    ``input_layernorm`` -> ``k_proj`` / ``v_proj`` (fp32 backbone weights) -> ``k_norm`` where the
    architecture has one (Gemma 3) -> rotary on K (the positions of the pass) -> ``cache.update``.
    The hidden state passes on unchanged."""

    name = "state-propagation"
    needs_dynamic_cache = False
    per_row = True  # its K/V write goes through cache.update, which a RowsCache restricts to the rows

    def skipped(self, layer, hidden_states, args, kwargs):
        cache = cache_of(kwargs)
        if cache is None:
            return hidden_states  # no cache: nothing later tokens could read
        backbone = layer.backbone
        attn = backbone.self_attn
        x = backbone.input_layernorm(hidden_states)
        shape = (*x.shape[:-1], -1, attn.head_dim)
        keys = attn.k_proj(x).view(shape).transpose(1, 2)
        values = attn.v_proj(x).view(shape).transpose(1, 2)
        if getattr(attn, "k_norm", None) is not None:
            keys = attn.k_norm(keys)
        cos, sin = kwargs["position_embeddings"]
        _, keys = _rotary(attn)(keys, keys, cos, sin)
        cache.update(keys, values, attn.layer_idx)
        return hidden_states


class KVMask(ExitStrategy):
    """KV mask (D-LLM, Jiang et al. 2024, Sec. 3.3): a skipped layer writes placeholder (zero) K/V
    to its cache slot, so positions stay aligned, and marks the pass's tokens absent at that
    layer; when the layer runs again, later tokens' attention excludes the absent positions (their
    attention weight is exactly zero).

    The marks live with the call, on the cache (``cache.river_absent``: layer index ->
    ``[batch, positions]`` bool, True = absent). The layer's own attention mask is kept and
    narrowed: a boolean mask (sdpa) is AND-ed, an additive one (eager) gets the dtype's minimum, and
    where the model passed none (sdpa's causal shortcut) a causal (and sliding-window) one is
    built."""

    name = "kv-mask"
    masks_attention = True

    def skipped(self, layer, hidden_states, args, kwargs):
        cache = cache_of(kwargs)
        if cache is None:
            return hidden_states
        self.check_cache(cache)
        attn = layer.backbone.self_attn
        batch, tokens = hidden_states.shape[:2]
        heads = attn.k_proj.out_features // attn.head_dim
        zeros = hidden_states.new_zeros(batch, heads, tokens, attn.head_dim)
        cache.update(zeros, zeros, attn.layer_idx)
        self._mark(cache, attn.layer_idx, batch, tokens, True, hidden_states.device)
        return hidden_states

    @staticmethod
    def _mark(cache, idx: int, batch: int, tokens: int, absent: bool, device) -> torch.Tensor | None:
        """Append the marks of ``tokens`` new positions at layer ``idx``; returns the layer's marks,
        or None when the layer has never had an absent position (no masking needed)."""
        marks = getattr(cache, "river_absent", None)
        if marks is None:
            marks = cache.river_absent = {}
        rec = marks.get(idx)
        if rec is None and not absent:
            return None
        if rec is None:
            # positions before this pass (kept by the layer so far) were all present
            rec = torch.zeros(batch, cache.layers[idx].get_seq_length() - tokens, dtype=torch.bool, device=device)
        marks[idx] = rec = torch.cat([rec, torch.full((batch, tokens), absent, dtype=torch.bool, device=device)], dim=1)
        return rec

    def before_layer(self, layer, hidden_states, kwargs):
        cache = cache_of(kwargs)
        if cache is None or idx_absent(cache, layer.river_layer_idx) is None:
            return kwargs
        idx = layer.river_layer_idx
        batch, tokens = hidden_states.shape[:2]
        kv_len, _ = cache.layers[idx].get_mask_sizes(tokens)
        rec = self._mark(cache, idx, batch, tokens, False, hidden_states.device)
        present = ~rec[:, -kv_len:][:, None, None, :]  # [batch, 1, 1, kv]
        mask = kwargs.get("attention_mask")
        attn = layer.backbone.self_attn
        if mask is None:
            q = torch.arange(kv_len - tokens, kv_len, device=present.device)[:, None]
            k = torch.arange(kv_len, device=present.device)[None, :]
            allowed = k <= q
            window = getattr(attn, "sliding_window", None)
            if window:
                allowed &= k > q - window
            mask = allowed[None, None] & present
            if attn_implementation(attn.config) == "eager":
                mask = torch.zeros(mask.shape, dtype=hidden_states.dtype, device=mask.device).masked_fill(
                    ~mask, torch.finfo(hidden_states.dtype).min)
        elif mask.dtype == torch.bool:
            mask = mask & present
        else:
            mask = mask.masked_fill(~present, torch.finfo(mask.dtype).min)
        return {**kwargs, "attention_mask": mask}


def idx_absent(cache, idx: int):
    """The absence marks of layer ``idx`` on ``cache`` (KVMask), or None."""
    marks = getattr(cache, "river_absent", None)
    return None if marks is None else marks.get(idx)


_STRATEGIES = {cls.name: cls() for cls in (ExitLayers, Recompute, SkipDecode, StatePropagation, KVMask)}
#: ``RiverConfig.strategy`` values, River's own first.
STRATEGIES = tuple(_STRATEGIES)


def get_strategy(name) -> ExitStrategy:
    """The strategy object of ``name`` (an :class:`ExitStrategy` is returned as is).

    Raises:
        RiverError: an unknown name.
    """
    if isinstance(name, ExitStrategy):
        return name
    try:
        return _STRATEGIES[name]
    except (KeyError, TypeError):
        raise RiverError(f"unknown River strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None
