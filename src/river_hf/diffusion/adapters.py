"""Layer adapters: how dLLM-Cache reads one decoder layer of a given layout, piece by piece.

dLLM-Cache (Liu et al., 2025, "dLLM-Cache: Accelerating Diffusion Large Language Models with
Adaptive Caching", arXiv:2506.06295, Methodology) needs to run a pre-norm transformer layer in parts: the attention
input norm, the Q/K/V projections, rotary at given positions (K is cached *after* rotary: positions
never move in masked diffusion), the output projection, and the FFN (norm included). Each layout has one small adapter
that names those parts; the caching rule itself lives once, in :mod:`river_hf.diffusion.cache`.

Two layouts are supported:

* :class:`HFDecoderLayerAdapter` -- transformers' Llama/Qwen2-style decoder layers
  (``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp``;
  rotary ``(cos, sin)`` passed in as ``position_embeddings``), run bidirectionally. Dream-7B's
  layout is Qwen2-like and matches this adapter.
* :class:`LLaDABlockAdapter` -- LLaDA's remote-code block (``attn_norm``, ``q_proj``, ``k_proj``,
  ``v_proj``, ``attn_out``, ``ff_norm``, ``ff_proj``, ``up_proj``, ``ff_out``, ``act``, and a
  ``rotary_emb`` with ``get_rotary_embedding`` / ``apply_rotary_pos_emb``).

Both layouts compute ``h = x + Attn(norm1(x))`` and ``out = h + FFN(norm2(h))``, which is what
lets cached attention and FFN outputs be added to a fresh residual stream.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..errors import RiverError

__all__ = ["LayerAdapter", "HFDecoderLayerAdapter", "LLaDABlockAdapter", "find_decoder_layers"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _linear_flops(*modules: nn.Module | None) -> int:
    """FLOPs per token of the Linear layers inside ``modules`` (2 x weight elements)."""
    total = 0
    for m in modules:
        if m is None:
            continue
        for sub in m.modules():
            if isinstance(sub, nn.Linear):
                total += 2 * sub.weight.numel()
    return total


class LayerAdapter:
    """Parts of one decoder layer, as dLLM-Cache needs them. Subclasses fill in the layout.

    Shapes: ``x`` is ``[batch, tokens, hidden]`` in the model dtype; ``q`` is
    ``[batch, tokens, num_heads, head_dim]``, ``k``/``v`` are ``[batch, tokens, num_kv_heads, head_dim]``.

    Attributes:
        layer: the wrapped decoder layer.
        num_heads, num_kv_heads, head_dim: attention geometry.
        scaling: softmax scale (``head_dim ** -0.5`` for both layouts).
        q_proj, k_proj, v_proj: the Q/K/V projections (``nn.Linear``).
        ffn_modules: the FFN's Linear-holding modules (for the FLOPs count).
        k_module, v_module, attn_out_module, ffn_out_module: submodules whose outputs are the
            cached features (K before rotary, V, attention output, FFN output); forward hooks on
            them fill the cache on full-refresh steps, where the original layer runs unchanged
            (the cache applies :meth:`rope` to the captured K once).
    """

    layer: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    ffn_modules: tuple[nn.Module, ...]
    k_module: nn.Module
    v_module: nn.Module
    attn_out_module: nn.Module
    ffn_out_module: nn.Module

    # --- call interface of the wrapped layer -------------------------------------------------
    def hidden_states(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The layer input ``x`` from the layer's call arguments."""
        raise NotImplementedError

    def rotary(self, args: tuple, kwargs: dict, x: torch.Tensor):
        """Rotary tables for the call's ``T = x.shape[1]`` positions, handed back to :meth:`rope`.

        Positions are 0..T-1 on every call of one generation, so the cache reads this once per layer.
        """
        raise NotImplementedError

    def pack(self, out: torch.Tensor, tuple_output: bool):
        """Return ``out`` the way the original layer returns its output."""
        return (out,) if tuple_output else out

    # --- parts --------------------------------------------------------------------------------
    def attn_norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def q(self, xn: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def k(self, xn: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def v(self, xn: torch.Tensor) -> torch.Tensor:
        return self._heads(self.v_proj(xn))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """``[..., heads * head_dim]`` -> ``[..., heads, head_dim]`` (a view)."""
        return t.view(*t.shape[:-1], -1, self.head_dim)

    def rope(self, q: torch.Tensor | None, k: torch.Tensor, rot, rows: slice | torch.Tensor):
        """Rotary embedding of queries and keys that sit at the same positions.

        Args:
            q: ``[B, n, num_heads, D]`` or None (keys only).
            k: ``[B, n, num_kv_heads, D]``.
            rot: the tables from :meth:`rotary`.
            rows: the n absolute positions: a ``slice`` (the tables are sliced, no index gather)
                or ``[B, n]`` int64 (gathered per row).

        Returns:
            ``(q_rot, k_rot)`` in the input dtypes (``q_rot`` None when ``q`` is None).
        """
        raise NotImplementedError

    def attn_out(self, o: torch.Tensor) -> torch.Tensor:
        """Output projection of attention values ``o`` ``[B, n, num_heads * head_dim]``."""
        raise NotImplementedError

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """FFN branch (norm included) of the post-attention stream ``h``; the layer adds it to ``h``."""
        raise NotImplementedError

    # --- cost model ------------------------------------------------------------------------
    def flops_per_token(self) -> dict[str, int]:
        """FLOPs per token of each projection group: ``q``, ``k``, ``v``, ``o``, ``ffn``."""
        return {
            "q": _linear_flops(self.q_proj),
            "k": _linear_flops(self.k_proj),
            "v": _linear_flops(self.v_proj),
            "o": _linear_flops(self.attn_out_module),
            "ffn": _linear_flops(*self.ffn_modules),
        }

    def attention_flops(self, n_queries: int, n_keys: int) -> int:
        """FLOPs of QK^T and AV for ``n_queries`` x ``n_keys`` (per sequence)."""
        return 4 * n_queries * n_keys * self.num_heads * self.head_dim

    def full_flops(self, tokens: int) -> int:
        """Layer FLOPs per sequence of an uncached forward over ``tokens`` positions."""
        f = self.flops_per_token()
        return tokens * sum(f.values()) + self.attention_flops(tokens, tokens)


class HFDecoderLayerAdapter(LayerAdapter):
    """transformers Llama / Qwen2 / Qwen3 / Mistral-style decoder layer (also Dream's layout).

    Raises:
        RiverError: the layer is not a plain pre-norm layer (e.g. Gemma's extra norms).
    """

    @staticmethod
    def matches(layer: nn.Module) -> bool:
        return all(hasattr(layer, n) for n in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"))

    def __init__(self, layer: nn.Module):
        if not self.matches(layer):
            raise RiverError(f"{type(layer).__name__} is not a Llama/Qwen2-style decoder layer")
        if hasattr(layer, "pre_feedforward_layernorm") or hasattr(layer, "post_feedforward_layernorm"):
            raise RiverError(
                f"{type(layer).__name__} has extra norms around attention/FFN (Gemma-style); "
                "dLLM-Cache supports plain pre-norm layers only"
            )
        self.layer = layer
        attn = layer.self_attn
        self.attn = attn
        cfg = attn.config
        self.num_heads = cfg.num_attention_heads
        self.head_dim = getattr(attn, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = float(getattr(attn, "scaling", self.head_dim**-0.5))  # older remote code (Dream) has none
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self.ffn_modules = (layer.mlp,)
        self.k_module = self.k_norm if self.k_norm is not None else attn.k_proj
        self.v_module = attn.v_proj
        self.attn_out_module = attn.o_proj
        self.ffn_out_module = layer.mlp
        mod = sys.modules.get(type(attn).__module__)
        self._apply_rope = getattr(mod, "apply_rotary_pos_emb", None)

    def hidden_states(self, args, kwargs):
        return args[0] if args else kwargs["hidden_states"]

    def rotary(self, args, kwargs, x):
        pe = kwargs.get("position_embeddings")
        if pe is None:
            raise RiverError(
                f"{type(self.layer).__name__} was called without position_embeddings; dLLM-Cache needs a "
                "model that computes rotary (cos, sin) once and passes it to each layer (transformers >= 4.48 style)"
            )
        cos, sin = pe
        if cos.shape[0] != x.shape[0]:
            cos, sin = cos.expand(x.shape[0], -1, -1), sin.expand(x.shape[0], -1, -1)
        return cos, sin

    def attn_norm(self, x):
        return self.layer.input_layernorm(x)

    def q(self, xn):
        q = self._heads(self.q_proj(xn))
        return self.q_norm(q) if self.q_norm is not None else q

    def k(self, xn):
        k = self._heads(self.k_proj(xn))
        return self.k_norm(k) if self.k_norm is not None else k

    def rope(self, q, k, rot, rows):
        cos, sin = rot  # [B, T, D]
        if isinstance(rows, slice):
            c, s = cos[:, rows], sin[:, rows]
        else:
            idx = rows.unsqueeze(-1).expand(-1, -1, cos.shape[-1])
            c, s = cos.gather(1, idx), sin.gather(1, idx)  # [B, n, D]
        if self._apply_rope is not None:  # the model's own function, on the [B, n, heads, D] layout
            q_rot, k_rot = self._apply_rope(k if q is None else q, k, c, s, unsqueeze_dim=2)
            return (None if q is None else q_rot), k_rot
        c, s = c.unsqueeze(2), s.unsqueeze(2)
        k_rot = k * c + _rotate_half(k) * s
        return (None if q is None else q * c + _rotate_half(q) * s), k_rot

    def attn_out(self, o):
        return self.attn.o_proj(o)

    def ffn(self, h):
        return self.layer.mlp(self.layer.post_attention_layernorm(h))



class LLaDABlockAdapter(LayerAdapter):
    """LLaDA's remote-code ``LLaDALlamaBlock`` layout (and :class:`~.modeling.LLaDALayoutBlock`).

    Expects ``block.config`` with ``n_heads``, ``d_model`` and optionally ``effective_n_kv_heads``
    / ``n_kv_heads``; optional ``q_norm`` / ``k_norm`` acting on the flat projections (as in LLaDA).
    """

    PARTS = ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out")

    @classmethod
    def matches(cls, layer: nn.Module) -> bool:
        return all(hasattr(layer, n) for n in cls.PARTS)

    def __init__(self, block: nn.Module):
        if not self.matches(block):
            raise RiverError(f"{type(block).__name__} lacks LLaDA block modules {self.PARTS}")
        self.layer = block
        cfg = block.config
        self.num_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        kv = getattr(cfg, "effective_n_kv_heads", None) or getattr(cfg, "n_kv_heads", None) or cfg.n_heads
        self.num_kv_heads = kv
        self.scaling = self.head_dim**-0.5
        self.q_norm = getattr(block, "q_norm", None)
        self.k_norm = getattr(block, "k_norm", None)
        self.q_proj, self.k_proj, self.v_proj = block.q_proj, block.k_proj, block.v_proj
        self.ffn_modules = (block.ff_proj, block.up_proj, block.ff_out)
        self.k_module = self.k_norm if self.k_norm is not None else block.k_proj
        self.v_module = block.v_proj
        self.attn_out_module = block.attn_out
        self.ffn_out_module = block.ff_out
        self.full_precision_rope = bool(getattr(cfg, "rope_full_precision", True))

    def hidden_states(self, args, kwargs):
        return args[0] if args else kwargs["x"]

    def rotary(self, args, kwargs, x):
        rot = self.layer.rotary_emb
        sin, cos = rot.get_rotary_embedding(x.shape[1], x.device)  # [1, 1, T, D] each
        return sin[0, 0], cos[0, 0]

    def pack(self, out, tuple_output):
        return (out, None) if tuple_output else out

    def attn_norm(self, x):
        return self.layer.attn_norm(x)

    def q(self, xn):
        q = self.q_proj(xn)
        return self._heads(self.q_norm(q) if self.q_norm is not None else q)

    def k(self, xn):
        k = self.k_proj(xn)
        return self._heads(self.k_norm(k) if self.k_norm is not None else k)

    def rope(self, q, k, rot, rows):
        sin, cos = rot  # [T, D] float32
        s, c = sin[rows].unsqueeze(-2), cos[rows].unsqueeze(-2)  # [n, 1, D] (slice) or [B, n, 1, D]
        apply = self.layer.rotary_emb.apply_rotary_pos_emb

        def one(t):
            tt = t.float() if self.full_precision_rope else t
            return apply(s.type_as(tt), c.type_as(tt), tt).to(t.dtype)

        return (None if q is None else one(q)), one(k)

    def attn_out(self, o):
        return self.layer.attn_out(o)

    def ffn(self, h):
        b = self.layer
        hn = b.ff_norm(h)
        return b.ff_out(b.act(b.ff_proj(hn)) * b.up_proj(hn))



ADAPTERS = (HFDecoderLayerAdapter, LLaDABlockAdapter)


def find_decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, type[LayerAdapter]]:
    """The model's decoder layer list and the adapter class for its layout.

    Looks for the first ``nn.ModuleList`` whose entries all match one adapter.

    Raises:
        RiverError: no supported layer list was found.
    """
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            for cls in ADAPTERS:
                if all(cls.matches(getattr(m, "layer", m)) for m in module):
                    return module, cls
    raise RiverError(
        f"{type(model).__name__}: no Llama/Qwen2-style decoder layers or LLaDA blocks found; "
        "dLLM-Cache supports those two layouts"
    )
