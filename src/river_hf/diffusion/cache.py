"""dLLM-Cache: adaptive reuse of prompt and response features across denoising steps.

Rules (Liu et al., 2025, "dLLM-Cache: Accelerating Diffusion Large Language Models with Adaptive
Caching", arXiv:2506.06295, Methodology section; public code github.com/maomaocun/dLLM-cache,
``dllm_cache/hooks`` and ``dllm_cache/cache``):

* Per layer, keep separately for prompt and response positions: K and V (before rotary), the
  attention output and the FFN output (the per-layer prompt cache and response cache).
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
from .adapters import LayerAdapter, find_decoder_layers

__all__ = ["DLLMCacheConfig", "FeatureCache", "CachedLayer", "select_response_tokens", "attach_cache"]


@dataclass(frozen=True)
class DLLMCacheConfig:
    """dLLM-Cache settings (paper's Methodology; defaults as in its LLaDA GSM8K-style runs: Kp 50, Kr 7, rho 0.25).

    Args:
        prompt_interval: Kp, refresh prompt features every Kp denoising steps (>= 1).
        response_interval: Kr, refresh response features every Kr denoising steps (>= 1).
        ratio: rho, V-verify ratio: fraction of response tokens recomputed on other steps (0..1).

    Raises:
        RiverError: an interval < 1 or a ratio outside [0, 1].
    """

    prompt_interval: int = 50
    response_interval: int = 7
    ratio: float = 0.25

    def __post_init__(self):
        if int(self.prompt_interval) != self.prompt_interval or self.prompt_interval < 1:
            raise RiverError(f"prompt_interval (Kp) must be an integer >= 1, got {self.prompt_interval}")
        if int(self.response_interval) != self.response_interval or self.response_interval < 1:
            raise RiverError(f"response_interval (Kr) must be an integer >= 1, got {self.response_interval}")
        if not 0.0 <= float(self.ratio) <= 1.0:
            raise RiverError(f"ratio (rho) must be in [0, 1], got {self.ratio}")


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
    """Cached features of one layer; ``*_p`` prompt, ``*_r`` response positions.

    K/V: ``[B, n, num_kv_heads, head_dim]`` (K before rotary); attn/ffn: ``[B, n, hidden]``.
    """

    k_p: torch.Tensor | None = None
    v_p: torch.Tensor | None = None
    attn_p: torch.Tensor | None = None
    ffn_p: torch.Tensor | None = None
    k_r: torch.Tensor | None = None
    v_r: torch.Tensor | None = None
    attn_r: torch.Tensor | None = None
    ffn_r: torch.Tensor | None = None


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
        layers: per-layer :class:`LayerFeatures`.
        layer_flops: layer FLOPs actually spent (all sequences), counted per call.
        layer_flops_full: layer FLOPs an uncached forward would have spent on the same calls.
        selected: number of response tokens recomputed by V-verify, summed over layers and rows.
    """

    config: DLLMCacheConfig
    prompt_length: int
    key_mask: torch.Tensor | None = None
    step: int = -1
    refresh_prompt: bool = False
    refresh_response: bool = False
    layers: dict[int, LayerFeatures] = field(default_factory=dict)
    layer_flops: int = 0
    layer_flops_full: int = 0
    selected: int = 0
    refresh_counts: dict[str, int] = field(default_factory=lambda: {"full": 0, "prompt": 0, "response": 0, "verify": 0})

    def next_step(self) -> None:
        """Advance the step counter; call once before each model forward (the first call starts step 0)."""
        self.step += 1
        self.refresh_prompt = self.step % self.config.prompt_interval == 0
        self.refresh_response = self.step % self.config.response_interval == 0
        kind = "full" if self.refresh_prompt and self.refresh_response else "prompt" if self.refresh_prompt else (
            "response" if self.refresh_response else "verify"
        )
        self.refresh_counts[kind] += 1

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
    """

    def __init__(self, layer: nn.Module, adapter: LayerAdapter, cache: FeatureCache, layer_idx: int):
        super().__init__()
        self.layer = layer
        self.adapter = adapter
        self.cache = cache
        self.cache_layer_idx = layer_idx
        self._captured: dict[str, torch.Tensor] | None = None
        self._tuple_output = False
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

    # ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        fc, ad = self.cache, self.adapter
        fc.require_step()
        if fc.refresh_prompt and fc.refresh_response:
            return self._full(args, kwargs)
        x = ad.hidden_states(args, kwargs)
        out = self._partial(x, ad.rotary(args, kwargs, x))
        return ad.pack(out, self._tuple_output)

    def _full(self, args, kwargs):
        """Full refresh: the original layer, unchanged; hooks store its features."""
        fc, ad = self.cache, self.adapter
        self._captured = {}
        try:
            out = self.layer(*args, **kwargs)
        finally:
            cap, self._captured = self._captured, None
        self._tuple_output = isinstance(out, tuple)
        x = ad.hidden_states(args, kwargs)
        b, t, _ = x.shape
        p = fc.prompt_length
        k = cap["k"].reshape(b, t, ad.num_kv_heads, ad.head_dim)
        v = cap["v"].reshape(b, t, ad.num_kv_heads, ad.head_dim)
        st = LayerFeatures(
            k_p=k[:, :p], v_p=v[:, :p], attn_p=cap["attn"][:, :p], ffn_p=cap["ffn"][:, :p],
            k_r=k[:, p:].clone(), v_r=v[:, p:], attn_r=cap["attn"][:, p:].clone(), ffn_r=cap["ffn"][:, p:].clone(),
        )  # fmt: skip
        fc.layers[self.cache_layer_idx] = st
        full = b * self._full_cost(t)
        fc.layer_flops += full
        fc.layer_flops_full += full
        return out

    def _partial(self, x: torch.Tensor, rot) -> torch.Tensor:
        """Prompt refresh, response refresh or V-verify step (paper's Methodology; public code's hook)."""
        fc, ad = self.cache, self.adapter
        st = fc.layers.get(self.cache_layer_idx)
        if st is None:
            raise RuntimeError("dLLM-Cache: partial step before any full refresh (step counter not started)")
        b, t, _ = x.shape
        p, r = fc.prompt_length, t - fc.prompt_length
        dev = x.device
        fpt = self._fpt
        flops = 0
        queries, q_pos = [], []

        if fc.refresh_prompt:
            xn_p = ad.attn_norm(x[:, :p])
            queries.append(ad.q(xn_p))
            q_pos.append(torch.arange(p, device=dev).expand(b, p))
            st.k_p, st.v_p = ad.k(xn_p), ad.v(xn_p)
            flops += p * (fpt["q"] + fpt["k"] + fpt["v"])

        sel = None  # None: all response tokens are recomputed
        if fc.refresh_response:
            xn_r = ad.attn_norm(x[:, p:])
            queries.append(ad.q(xn_r))
            q_pos.append(torch.arange(p, t, device=dev).expand(b, r))
            st.k_r, st.v_r = ad.k(xn_r), ad.v(xn_r)
            flops += r * (fpt["q"] + fpt["k"] + fpt["v"])
        elif fc.config.ratio > 0:
            xn_r = ad.attn_norm(x[:, p:])
            v_r = ad.v(xn_r)
            sel = select_response_tokens(v_r, st.v_r, fc.config.ratio)
            xn_sel = _gather(xn_r, sel)
            queries.append(ad.q(xn_sel))
            q_pos.append(sel + p)
            st.v_r = v_r
            _scatter_(st.k_r, sel, ad.k(xn_sel))
            fc.selected += sel.numel()
            flops += r * fpt["v"] + sel.shape[1] * (fpt["q"] + fpt["k"])
        else:
            sel = torch.empty(b, 0, dtype=torch.long, device=dev)

        if queries:
            q = torch.cat(queries, 1)
            pos = torch.cat(q_pos, 1)
            k_all = torch.cat([st.k_p, st.k_r], 1)
            v_all = torch.cat([st.v_p, st.v_r], 1)
            q = ad.rope(q, pos, rot)
            k_all = ad.rope(k_all, torch.arange(t, device=dev).expand(b, t), rot)
            mask = None if fc.key_mask is None else fc.key_mask[:, None, None, :]
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),
                attn_mask=mask, scale=ad.scaling, enable_gqa=ad.num_kv_heads != ad.num_heads,
            )  # fmt: skip
            o = ad.attn_out(o.transpose(1, 2).reshape(b, q.shape[1], ad.num_heads * ad.head_dim))
            n_q = q.shape[1]
            flops += n_q * fpt["o"] + ad.attention_flops(n_q, t)
            if fc.refresh_prompt:
                st.attn_p, o = o[:, :p], o[:, p:]
            if sel is None:
                st.attn_r = o
            else:
                _scatter_(st.attn_r, sel, o)

        h = x + torch.cat([st.attn_p, st.attn_r], 1)

        ffn_in = []
        if fc.refresh_prompt:
            ffn_in.append(h[:, :p])
        if sel is None:
            ffn_in.append(h[:, p:])
        elif sel.shape[1]:
            ffn_in.append(_gather(h[:, p:], sel))
        if ffn_in:
            f = ad.ffn(torch.cat(ffn_in, 1))
            flops += f.shape[1] * fpt["ffn"]
            if fc.refresh_prompt:
                st.ffn_p, f = f[:, :p], f[:, p:]
            if sel is None:
                st.ffn_r = f
            elif sel.shape[1]:
                _scatter_(st.ffn_r, sel, f)

        fc.layer_flops += b * flops
        fc.layer_flops_full += b * self._full_cost(t)
        return h + torch.cat([st.ffn_p, st.ffn_r], 1)


@contextlib.contextmanager
def attach_cache(model: nn.Module, config: DLLMCacheConfig, prompt_length: int, key_mask: torch.Tensor | None):
    """Serve ``model``'s decoder layers through dLLM-Cache inside the ``with`` block.

    Replaces each entry of the model's layer list by a :class:`CachedLayer` and restores the
    original layers on exit (also on error), so the model's state dict is unchanged afterwards.

    Args:
        model: a model with Llama/Qwen2-style decoder layers or LLaDA blocks.
        config: the cache settings.
        prompt_length: P (prompt positions, padding included, come first).
        key_mask: ``[B, P + gen_length]`` bool (True = real token) or None.

    Yields:
        the :class:`FeatureCache`; call ``next_step()`` before each forward.

    Raises:
        RiverError: unsupported layer layout, or layers already wrapped.
    """
    layers, adapter_cls = find_decoder_layers(model)
    if any(isinstance(m, CachedLayer) for m in layers):
        raise RiverError("dLLM-Cache is already attached to this model (nested generate calls are not supported)")
    fc = FeatureCache(config=config, prompt_length=prompt_length, key_mask=key_mask)
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
