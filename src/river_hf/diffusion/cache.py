"""dLLM-Cache: adaptive reuse of prompt and response features across denoising steps.

Rules (Liu et al., 2025, "dLLM-Cache: Accelerating Diffusion Large Language Models with Adaptive
Caching", arXiv:2506.06295, Methodology section; public code github.com/maomaocun/dLLM-cache,
``dllm_cache/hooks`` and ``dllm_cache/cache``):

* Per layer, keep for prompt and response positions: K and V, the attention output and the FFN
  output (the per-layer prompt cache and response cache). Here each feature is one buffer over all
  ``T = P + G`` positions (prompt rows ``[:P]``, response rows ``[P:]``), allocated at the first
  step and then written by slice or scatter; K is stored *after* rotary (positions never move in
  masked diffusion, so a cached key never needs rotating again).
* One step counter over the whole generation (one step = one model forward). Prompt features are
  recomputed when ``step % prompt_interval == 0`` (long-interval prompt caching, Kp), response
  features when ``step % response_interval == 0`` (short-interval response caching, Kr); step 0
  refreshes both.
* Other steps: V-verify (the paper's adaptive partial response update): compute fresh V for every
  response token, take its cosine similarity with the cached V, and recompute attention and FFN only
  for the ``ratio`` (rho) fraction of response tokens with the lowest similarity. Their queries attend
  to all cached K/V (fresh V for the response, fresh K for the selected tokens); the results are
  scattered into the cache. As in the public code, the response V cache takes the fresh V every step.

Beyond the public code, cached attention here applies the key padding mask of batched inputs, so a
left-padded prompt gives the same result as the same prompt alone.

Full-refresh steps (both intervals due) run the original layer unchanged and fill the cache with
forward hooks, so ``prompt_interval = response_interval = 1`` reproduces uncached generation
token for token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import RiverError
from ..quant.dense import SmallBatchLinear
from .adapters import LayerAdapter, find_decoder_layers

__all__ = ["DLLMCacheConfig", "FeatureCache", "CachedLayer", "select_response_tokens", "attach_cache",
           "choose_partial_kernel", "verify_rows"]


@dataclass(frozen=True)
class DLLMCacheConfig:
    """dLLM-Cache settings (paper's Methodology; defaults as in its LLaDA GSM8K-style runs: Kp 50, Kr 7, rho 0.25).

    Args:
        prompt_interval: Kp, refresh prompt features every Kp denoising steps (>= 1).
        response_interval: Kr, refresh response features every Kr denoising steps (>= 1).
        ratio: rho, V-verify ratio: fraction of response tokens recomputed on other steps (0..1).
        small_batch_linear: run the decomposed (non-full-refresh) steps under
            :class:`river_hf.quant.dense.SmallBatchLinear`, which computes fp32 CPU Linear calls of 2..64
            rows (V-verify's rho * G selected tokens) in the ``(W @ x.T).T`` orientation. ``True`` /
            ``False`` (default: its wall-time gain was not resolved, docs/diffusion.md) force it on /
            off; ``"auto"`` measures both orientations on this machine, on the block's largest Linear
            shape at the V-verify row count (:func:`choose_partial_kernel`), once per process and
            shape, and uses the faster. Full
            refresh steps never use it, so ``Kp = Kr = 1`` stays exact; elsewhere results change by
            fp32 summation order only.

    Raises:
        RiverError: an interval < 1 or a ratio outside [0, 1].
    """

    prompt_interval: int = 50
    response_interval: int = 7
    ratio: float = 0.25
    small_batch_linear: bool | str = False

    def __post_init__(self):
        if int(self.prompt_interval) != self.prompt_interval or self.prompt_interval < 1:
            raise RiverError(f"prompt_interval (Kp) must be an integer >= 1, got {self.prompt_interval}")
        if int(self.response_interval) != self.response_interval or self.response_interval < 1:
            raise RiverError(f"response_interval (Kr) must be an integer >= 1, got {self.response_interval}")
        if not 0.0 <= float(self.ratio) <= 1.0:
            raise RiverError(f"ratio (rho) must be in [0, 1], got {self.ratio}")
        if not isinstance(self.small_batch_linear, bool) and self.small_batch_linear != "auto":
            raise RiverError(f"small_batch_linear must be True, False or 'auto', got {self.small_batch_linear!r}"
                             " (the CLI's on / off are True / False here)")


def select_response_tokens(v_fresh: torch.Tensor, v_cached: torch.Tensor, ratio: float) -> torch.Tensor:
    """V-verify selection: indices of the ``ratio`` fraction of response tokens whose V changed most.

    Args:
        v_fresh, v_cached: ``[batch, R, ...]`` value vectors (any trailing shape, flattened).
        ratio: rho in [0, 1]; ``k = floor(R * rho)`` tokens per row (at least 1 when rho > 0).

    Returns:
        ``[batch, k]`` int64 indices into the R response positions, lowest cosine similarity first.
    """
    b, r = v_fresh.shape[:2]
    k = min(r, max(1, int(r * ratio))) if ratio > 0 else 0
    if k == 0:
        return torch.empty(b, 0, dtype=torch.long, device=v_fresh.device)
    sim = F.cosine_similarity(v_fresh.reshape(b, r, -1).float(), v_cached.reshape(b, r, -1).float(), dim=-1)
    return torch.topk(sim, k, dim=1, largest=False).indices


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, idx[b]]`` for ``t`` ``[B, R, ...]`` and ``idx`` ``[B, k]``."""
    shape = idx.shape + t.shape[2:]
    return t.gather(1, idx.view(*idx.shape, *([1] * (t.dim() - 2))).expand(shape))


def _scatter_(t: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    t.scatter_(1, idx.view(*idx.shape, *([1] * (t.dim() - 2))).expand(src.shape), src)


@dataclass
class LayerFeatures:
    """Cached features of one layer, one buffer per feature over all T positions (prompt ``[:P]``,
    response ``[P:]``), in the model dtype.

    Attributes:
        k: ``[B, T, num_kv_heads, head_dim]``, keys *after* rotary.
        v: ``[B, T, num_kv_heads, head_dim]``.
        attn: ``[B, T, hidden]``, attention branch output (after the output projection).
        ffn: ``[B, T, hidden]``, FFN branch output.
    """

    k: torch.Tensor
    v: torch.Tensor
    attn: torch.Tensor
    ffn: torch.Tensor


@dataclass
class FeatureCache:
    """State of dLLM-Cache for one ``generate`` call.

    Attributes:
        config: the :class:`DLLMCacheConfig`.
        prompt_length: P, the first P positions are the prompt (padding included).
        key_mask: ``[B, T]`` bool, True for real tokens, or None when nothing is padded.
        step: index of the denoising step (model forward) in flight: -1 until the first
            :meth:`next_step`, then 0, 1, ...
        refresh_prompt, refresh_response: whether the step in flight refreshes prompt / response
            features (set by :meth:`next_step`).
        kind: the step in flight: ``"full"``, ``"prompt"`` (prompt refresh + V-verify), ``"response"``
            (response refresh) or ``"verify"`` (V-verify only); None before the first step.
        layers: per-layer :class:`LayerFeatures` (filled by the first full refresh).
        layer_flops: layer FLOPs actually spent (all sequences), counted per call.
        layer_flops_full: layer FLOPs an uncached forward would have spent on the same calls.
        selected: number of response tokens recomputed by V-verify, summed over layers and rows.
        linear_mode: the :class:`~river_hf.quant.dense.SmallBatchLinear` mode entered around decomposed
            steps (``config.small_batch_linear``, resolved by :func:`attach_cache`), else None; its
            ``calls_rerouted`` counts the calls.
        linear_timing: with ``small_batch_linear="auto"``, the measurement that decided
            (:func:`choose_partial_kernel`), else None.
    """

    config: DLLMCacheConfig
    prompt_length: int
    key_mask: torch.Tensor | None = None
    step: int = -1
    refresh_prompt: bool = False
    refresh_response: bool = False
    kind: str | None = None
    layers: dict[int, LayerFeatures] = field(default_factory=dict)
    layer_flops: int = 0
    layer_flops_full: int = 0
    selected: int = 0
    refresh_counts: dict[str, int] = field(default_factory=lambda: {"full": 0, "prompt": 0, "response": 0, "verify": 0})
    linear_mode: SmallBatchLinear | None = None
    linear_timing: dict | None = None

    def next_step(self) -> None:
        """Advance the step counter; call once before each model forward (the first call starts step 0)."""
        self.step += 1
        self.refresh_prompt = self.step % self.config.prompt_interval == 0
        self.refresh_response = self.step % self.config.response_interval == 0
        self.kind = "full" if self.refresh_prompt and self.refresh_response else "prompt" if self.refresh_prompt else (
            "response" if self.refresh_response else "verify"
        )
        self.refresh_counts[self.kind] += 1

    def require_step(self) -> None:
        """Raise unless :meth:`next_step` has started a step.

        Raises:
            RiverError: the model was called inside :func:`attach_cache` before the first ``next_step()``.
        """
        if self.step < 0:
            raise RiverError("dLLM-Cache: call FeatureCache.next_step() before each model forward "
                             "(the step counter has not started)")  # fmt: skip


class CachedLayer(nn.Module):
    """A decoder layer served through dLLM-Cache; called exactly like the layer it wraps.

    Args:
        layer: the original decoder layer.
        adapter: its :class:`~.adapters.LayerAdapter`.
        cache: the shared :class:`FeatureCache`.
        layer_idx: position in the decoder stack.

    A call with ``x`` ``[B, T, hidden]`` returns what the layer returns (``[B, T, hidden]``, in a
    tuple where the layer uses one). Which of the four step kinds runs is decided by the cache's
    current step (paper's Methodology): full refresh (:meth:`_full`), or the decomposed path
    (:meth:`_partial`) made of a prompt refresh and/or a response refresh (:meth:`_refresh`) or
    V-verify (:meth:`_verify`), then attention (:meth:`_attend`) and FFN (:meth:`_ffn`) for the
    recomputed rows only.

    Raises:
        RiverError: called before ``FeatureCache.next_step()``, or with a batch/length other than
            the one the cache was filled with.
    """

    def __init__(self, layer: nn.Module, adapter: LayerAdapter, cache: FeatureCache, layer_idx: int):
        super().__init__()
        self.layer = layer
        self.adapter = adapter
        self.cache = cache
        self.cache_layer_idx = layer_idx
        self._captured: dict[str, torch.Tensor] | None = None
        self._tuple_output = False
        self._rot = None  # rotary tables for positions 0..T-1, read once
        self._fpt = adapter.flops_per_token()
        self._full_flops: dict[int, int] = {}
        self._hooks = [
            mod.register_forward_hook(self._capture_hook(name))
            for name, mod in (
                ("k", adapter.k_module),
                ("v", adapter.v_module),
                ("attn", adapter.attn_out_module),
                ("ffn", adapter.ffn_out_module),
            )
        ]

    def _capture_hook(self, name: str):
        def hook(module, args, output):
            if self._captured is not None:
                self._captured[name] = output[0] if isinstance(output, tuple) else output

        return hook

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "layer" or "layer" not in self._modules:
                raise
            return getattr(self._modules["layer"], name)

    def _full_cost(self, t: int) -> int:
        if t not in self._full_flops:
            self._full_flops[t] = self.adapter.full_flops(t)
        return self._full_flops[t]

    def _rotary(self, args, kwargs, x):
        if self._rot is None:
            self._rot = self.adapter.rotary(args, kwargs, x)
        return self._rot

    def _features(self, x: torch.Tensor) -> LayerFeatures | None:
        """This layer's buffers (None before the first full refresh), checked against ``x``'s [B, T]."""
        st = self.cache.layers.get(self.cache_layer_idx)
        if st is not None and st.attn.shape[:2] != x.shape[:2]:
            raise RiverError(f"dLLM-Cache: the cache holds [batch, tokens] = {list(st.attn.shape[:2])}, this call "
                             f"has {list(x.shape[:2])}; positions must not move (attach a new cache for a new input)")
        return st

    def _spend(self, flops_per_sequence: int, batch: int) -> None:
        self.cache.layer_flops += batch * flops_per_sequence

    # ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        fc, ad = self.cache, self.adapter
        fc.require_step()
        if fc.refresh_prompt and fc.refresh_response:
            return self._full(args, kwargs)
        x = ad.hidden_states(args, kwargs)
        st = self._features(x)
        if st is None:
            raise RiverError("dLLM-Cache: a partial step before any full refresh (step 0 must run through the cache)")
        with fc.linear_mode if fc.linear_mode is not None else contextlib.nullcontext():
            out = self._partial(x, st, self._rotary(args, kwargs, x))
        fc.layer_flops_full += x.shape[0] * self._full_cost(x.shape[1])
        return ad.pack(out, self._tuple_output)

    def _full(self, args, kwargs):
        """Full refresh: the original layer, unchanged; hooks capture its features into the buffers."""
        fc, ad = self.cache, self.adapter
        self._captured = {}
        try:
            out = self.layer(*args, **kwargs)
        finally:
            cap, self._captured = self._captured, None
        self._tuple_output = isinstance(out, tuple)
        x = ad.hidden_states(args, kwargs)
        b, t, _ = x.shape
        k = cap["k"].reshape(b, t, ad.num_kv_heads, ad.head_dim)
        _, k = ad.rope(None, k, self._rotary(args, kwargs, x), slice(0, t))
        v = cap["v"].reshape(b, t, ad.num_kv_heads, ad.head_dim)
        st = self._features(x)
        if st is None:
            st = fc.layers[self.cache_layer_idx] = LayerFeatures(
                k=torch.empty_like(k), v=torch.empty_like(v), attn=torch.empty_like(cap["attn"]),
                ffn=torch.empty_like(cap["ffn"]),
            )  # fmt: skip
        # copies, not references: the buffers are written in place later, the layer's tensors are its own
        st.k.copy_(k)
        st.v.copy_(v)
        st.attn.copy_(cap["attn"])
        st.ffn.copy_(cap["ffn"])
        full = b * self._full_cost(t)
        fc.layer_flops += full
        fc.layer_flops_full += full
        return out

    def _partial(self, x: torch.Tensor, st: LayerFeatures, rot) -> torch.Tensor:
        """Prompt refresh and/or response refresh or V-verify, then attention and FFN for those rows.

        Every other row reuses its cached attention and FFN outputs on the fresh residual stream:
        ``h = x + attn``, ``out = h + ffn`` (paper's Methodology; both layouts are pre-norm).
        """
        fc = self.cache
        p, t = fc.prompt_length, x.shape[1]
        parts: list[tuple[slice | torch.Tensor, torch.Tensor]] = []  # (rows, their rotated queries)
        if fc.refresh_prompt:
            parts.append((slice(0, p), self._refresh(x, st, rot, slice(0, p))))
        if fc.refresh_response:
            parts.append((slice(p, t), self._refresh(x, st, rot, slice(p, t))))
        elif fc.config.ratio > 0:
            parts.append(self._verify(x, st, rot))
        if parts:
            self._attend(st, parts)
        h = x + st.attn
        if parts:
            self._ffn(h, st, parts)
        return h + st.ffn

    def _refresh(self, x: torch.Tensor, st: LayerFeatures, rot, rows: slice) -> torch.Tensor:
        """Prompt refresh (rows ``[0, P)``, every Kp steps) or response refresh (rows ``[P, T)``, every Kr
        steps), paper's long-/short-interval caching: fresh K (rotated) and V into the buffers.

        Returns:
            the rows' rotated queries ``[B, n, num_heads, head_dim]``.
        """
        ad, fpt = self.adapter, self._fpt
        xn = ad.attn_norm(x[:, rows])
        q, k = ad.rope(ad.q(xn), ad.k(xn), rot, rows)
        st.k[:, rows] = k
        st.v[:, rows] = ad.v(xn)
        self._spend(xn.shape[1] * (fpt["q"] + fpt["k"] + fpt["v"]), x.shape[0])
        return q

    def _verify(self, x: torch.Tensor, st: LayerFeatures, rot) -> tuple[torch.Tensor, torch.Tensor]:
        """V-verify (paper's adaptive partial response update): fresh V for every response row into the
        buffer; fresh K for the ``ratio`` fraction whose V moved most (lowest cosine similarity).

        Returns:
            ``(positions, q)``: ``[B, k]`` int64 absolute positions of the selected rows and their
            rotated queries ``[B, k, num_heads, head_dim]``.
        """
        fc, ad, fpt = self.cache, self.adapter, self._fpt
        p = fc.prompt_length
        xn = ad.attn_norm(x[:, p:])
        v = ad.v(xn)
        sel = select_response_tokens(v, st.v[:, p:], fc.config.ratio)
        st.v[:, p:] = v
        xn_sel = _gather(xn, sel)
        pos = sel + p
        q, k = ad.rope(ad.q(xn_sel), ad.k(xn_sel), rot, pos)
        _scatter_(st.k, pos, k)
        fc.selected += sel.numel()
        self._spend(xn.shape[1] * fpt["v"] + sel.shape[1] * (fpt["q"] + fpt["k"]), x.shape[0])
        return pos, q

    def _attend(self, st: LayerFeatures, parts) -> None:
        """Attention of the recomputed rows' queries over all cached keys/values; writes ``st.attn`` rows."""
        fc, ad = self.cache, self.adapter
        q = parts[0][1] if len(parts) == 1 else torch.cat([q for _, q in parts], 1)
        b, n, t = q.shape[0], q.shape[1], st.k.shape[1]
        mask = None if fc.key_mask is None else fc.key_mask[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), st.k.transpose(1, 2), st.v.transpose(1, 2),
            attn_mask=mask, scale=ad.scaling, enable_gqa=ad.num_kv_heads != ad.num_heads,
        )  # fmt: skip
        o = ad.attn_out(o.transpose(1, 2).reshape(b, n, ad.num_heads * ad.head_dim))
        _write_rows(st.attn, parts, o)
        self._spend(n * self._fpt["o"] + ad.attention_flops(n, t), b)

    def _ffn(self, h: torch.Tensor, st: LayerFeatures, parts) -> None:
        """FFN of the recomputed rows of the post-attention stream ``h``; writes ``st.ffn`` rows."""
        rows = [h[:, r] if isinstance(r, slice) else _gather(h, r) for r, _ in parts]
        f = self.adapter.ffn(rows[0] if len(rows) == 1 else torch.cat(rows, 1))
        _write_rows(st.ffn, parts, f)
        self._spend(f.shape[1] * self._fpt["ffn"], h.shape[0])


def _write_rows(buf: torch.Tensor, parts, values: torch.Tensor) -> None:
    """Write ``values`` ``[B, n1 + n2 ..., ...]`` into the rows of ``buf`` named by ``parts``, in order."""
    start = 0
    for rows, q in parts:
        n = q.shape[1]
        if isinstance(rows, slice):
            buf[:, rows] = values[:, start : start + n]
        else:
            _scatter_(buf, rows, values[:, start : start + n])
        start += n


def verify_rows(batch: int, response_length: int, ratio: float) -> int:
    """Rows of each Linear call of a V-verify step's recomputed part: ``batch * k`` with ``k`` as in
    :func:`select_response_tokens`."""
    return batch * (min(response_length, max(1, int(response_length * ratio))) if ratio > 0 else 0)


def choose_partial_kernel(layers, config: DLLMCacheConfig, rows: int | None) -> tuple[bool, dict | None]:
    """Whether the decomposed steps run under :class:`~river_hf.quant.dense.SmallBatchLinear`, and the
    timing that decided (None when nothing was measured).

    ``config.small_batch_linear`` True/False decides alone. ``"auto"``: off unless the block's Linear
    weights are float32 on the CPU, ``rows`` (the V-verify row count, :func:`verify_rows`) is one the
    mode reroutes (2..64) and ``RIVER_HF_AUTOTUNE`` is not ``0``; then both orientations are timed on
    the largest Linear shape of the first layer at ``rows`` rows with weights streamed from memory
    (:meth:`SmallBatchLinear.measure`) through river-hf's one tuner
    (:meth:`~river_hf.quant.autotune.KernelTuner.choose_mode`: cached in ``kernels.json`` per machine,
    shape and row count), and the faster wins.
    """
    choice = config.small_batch_linear
    if isinstance(choice, bool):
        return choice, None
    from ..quant.autotune import LinearSpec, default_tuner

    linears = [m for m in layers[0].modules() if isinstance(m, nn.Linear)]
    if (not linears or rows is None or not 2 <= rows <= SmallBatchLinear.DEFAULT_MAX_ROWS
            or any(m.weight.dtype != torch.float32 or m.weight.device.type != "cpu" for m in linears)):
        return False, None
    tuner = default_tuner()  # None when RIVER_HF_AUTOTUNE=0
    if tuner is None:
        return False, None
    big = max(linears, key=lambda m: m.weight.numel())
    best, timings = tuner.choose_mode(LinearSpec(big.in_features, big.out_features, False), rows,
                                      ("torch", "small-batch"),
                                      lambda: SmallBatchLinear.measure(big.in_features, big.out_features, rows))
    timing = {"shape": [big.in_features, big.out_features], "rows": rows, "us_per_call": timings}
    return best == "small-batch", timing


@contextlib.contextmanager
def attach_cache(model: nn.Module, config: DLLMCacheConfig, prompt_length: int, key_mask: torch.Tensor | None,
                 partial_rows: int | None = None):
    """Serve ``model``'s decoder layers through dLLM-Cache inside the ``with`` block.

    Replaces each entry of the model's layer list by a :class:`CachedLayer` and restores the
    original layers on exit (also on error), so the model's state dict is unchanged afterwards.

    Args:
        model: a model with Llama/Qwen2-style decoder layers or LLaDA blocks.
        config: the cache settings.
        prompt_length: P (prompt positions, padding included, come first).
        key_mask: ``[B, P + gen_length]`` bool (True = real token) or None.
        partial_rows: rows of a V-verify step's Linear calls (:func:`verify_rows`), which
            ``small_batch_linear="auto"`` measures at; None: ``"auto"`` means off.

    Yields:
        the :class:`FeatureCache`; call ``next_step()`` before each forward.

    Raises:
        RiverError: unsupported layer layout, or layers already wrapped.
    """
    layers, adapter_cls = find_decoder_layers(model)
    if any(isinstance(m, CachedLayer) for m in layers):
        raise RiverError("dLLM-Cache is already attached to this model (nested generate calls are not supported)")
    fc = FeatureCache(config=config, prompt_length=prompt_length, key_mask=key_mask)
    use_mode, fc.linear_timing = choose_partial_kernel(layers, config, partial_rows)
    fc.linear_mode = SmallBatchLinear() if use_mode else None
    originals = list(layers)
    wrappers = [CachedLayer(layer, adapter_cls(layer), fc, i) for i, layer in enumerate(originals)]
    try:
        for i, w in enumerate(wrappers):
            layers[i] = w
        yield fc
    finally:
        for i, (layer, w) in enumerate(zip(originals, wrappers)):
            w.remove_hooks()
            layers[i] = layer


def uncached_layer_flops(model: nn.Module, tokens: int) -> int | None:
    """Layer FLOPs of one uncached forward over ``tokens`` positions (per sequence), or None if the
    layout is not recognised."""
    try:
        layers, adapter_cls = find_decoder_layers(model)
    except RiverError:
        return None
    return sum(adapter_cls(layer).full_flops(tokens) for layer in layers)
