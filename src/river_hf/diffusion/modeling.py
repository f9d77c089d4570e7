"""Small bidirectional masked-diffusion test models in the two layouts dLLM-Cache supports.

No real diffusion LM weights (LLaDA-8B, Dream-7B) can be fetched here, so these classes stand in
for them: same layer layouts, bidirectional attention with a key padding mask, logits for every
position. They are registered with ``AutoConfig`` and ``AutoModelForMaskedLM``, so
``AutoModelForMaskedLM.from_pretrained(folder)`` works on a saved instance.

* :class:`BidirectionalLlamaForMaskedLM` (``model_type="river_bidirectional_llama"``): transformers'
  own ``LlamaDecoderLayer`` run without the causal mask (layout of Dream-7B, which is Qwen2-like).
  ``config.shift_logits=True`` gives Dream's convention (logits shifted right by one position).
* :class:`LLaDALayoutForMaskedLM` (``model_type="river_llada_layout"``): a re-implementation of
  LLaDA's remote-code ``LLaDALlamaBlock`` layout with the same module names and rotary interface.

:func:`build_test_model` makes random-weight instances ("tiny" for tests, "300m" and "1b" for speed).
Random weights measure speed only; generation quality needs real weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForMaskedLM, LlamaConfig, PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import MaskedLMOutput
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from ..errors import RiverError

__all__ = [
    "BidirectionalLlamaConfig",
    "BidirectionalLlamaForMaskedLM",
    "LLaDALayoutConfig",
    "LLaDALayoutForMaskedLM",
    "build_test_model",
    "LLADA_MASK_ID",
    "DREAM_MASK_ID",
]

LLADA_MASK_ID = 126336  # LLaDA-8B's [MASK] token id
DREAM_MASK_ID = 151666  # Dream-7B's <|mask|> token id


def _keep(h: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """Positions of ``h`` ``[B, T, C]`` the LM head runs on: all (None/0), the last n (int) or an index tensor."""
    if logits_to_keep is None or (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        return h
    if isinstance(logits_to_keep, int):
        return h[:, -logits_to_keep:]
    return h[:, logits_to_keep]


# ---------------------------------------------------------------------------------------------
# Layout (a): transformers Llama decoder layers, bidirectional (Dream-like)
# ---------------------------------------------------------------------------------------------
class BidirectionalLlamaConfig(LlamaConfig):
    """A :class:`~transformers.LlamaConfig` for a bidirectional masked-diffusion LM.

    Extra fields: ``mask_token_id`` (the [MASK] id) and ``shift_logits`` (Dream convention: the
    prediction for position i is read from the logits at position i - 1).
    """

    model_type = "river_bidirectional_llama"
    mask_token_id: int | None = None
    shift_logits: bool = False


class BidirectionalLlamaModel(LlamaPreTrainedModel):
    """Embeddings, Llama decoder layers with bidirectional attention, final norm."""

    config_class = BidirectionalLlamaConfig

    def __init__(self, config: BidirectionalLlamaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        for layer in self.layers:
            layer.self_attn.is_causal = False
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``[B, T]`` int64, ``attention_mask`` ``[B, T]`` (1 = token, 0 = padding) -> ``[B, T, C]``."""
        h = self.embed_tokens(input_ids)
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=attention_mask)
        pe = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        return self.norm(h)


class BidirectionalLlamaForMaskedLM(LlamaPreTrainedModel):
    """Bidirectional Llama-layout LM returning logits for all positions (test model, layout a)."""

    config_class = BidirectionalLlamaConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: BidirectionalLlamaConfig):
        super().__init__(config)
        self.model = BidirectionalLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, logits_to_keep=None, **kwargs) -> MaskedLMOutput:
        """Returns ``MaskedLMOutput(logits=[B, T', vocab])``; ``T'`` = positions kept by ``logits_to_keep``
        (None: all; int n: last n; int64 tensor: those indices)."""
        h = self.model(input_ids, attention_mask=attention_mask)
        return MaskedLMOutput(logits=self.lm_head(_keep(h, logits_to_keep)))


# ---------------------------------------------------------------------------------------------
# Layout (b): LLaDA's remote-code block layout
# ---------------------------------------------------------------------------------------------
class LLaDALayoutConfig(PreTrainedConfig):
    """Config of :class:`LLaDALayoutForMaskedLM`, with LLaDA's field names (``d_model``, ``n_heads``...)."""

    model_type = "river_llada_layout"
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    mlp_hidden_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02
    rope_full_precision: bool = True
    mask_token_id: int | None = None
    shift_logits: bool = False
    tie_word_embeddings: bool = False

    @property
    def effective_n_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


class LLaDARotaryEmbedding(nn.Module):
    """Rotary embedding with LLaDA's interface: ``get_rotary_embedding(seq_len, device) -> (sin, cos)``
    each ``[1, 1, seq_len, head_dim]`` float32, and ``apply_rotary_pos_emb(sin, cos, t)``."""

    def __init__(self, config: LLaDALayoutConfig):
        super().__init__()
        self.config = config
        self.inv_freq = nn.Buffer(self.compute_inv_freq(config), persistent=False)

    @staticmethod
    def compute_inv_freq(config: LLaDALayoutConfig) -> torch.Tensor:
        dim = config.d_model // config.n_heads
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def get_rotary_embedding(self, seq_len: int, device: torch.device):
        t = torch.arange(seq_len, device=device, dtype=torch.float)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.sin()[None, None], emb.cos()[None, None]

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin, pos_cos, t):
        return ((t * pos_cos) + (self.rotate_half(t) * pos_sin)).to(t.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor):
        """``q``, ``k`` ``[B, heads, T, D]`` -> rotated at positions 0..T-1 (computed in float32)."""
        q_, k_ = q.float(), k.float()
        sin, cos = self.get_rotary_embedding(k_.shape[-2], q.device)
        return self.apply_rotary_pos_emb(sin, cos, q_).type_as(q), self.apply_rotary_pos_emb(sin, cos, k_).type_as(k)


class LLaDALayoutBlock(nn.Module):
    """One block in LLaDA's layout: ``x + attn_out(Attn(attn_norm(x)))`` then
    ``+ ff_out(act(ff_proj(ff_norm(h))) * up_proj(ff_norm(h)))``; bidirectional attention."""

    def __init__(self, layer_id: int, config: LLaDALayoutConfig):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        d, hd = config.d_model, config.d_model // config.n_heads
        kv = config.effective_n_kv_heads * hd
        self.attn_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.ff_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden_size, d, bias=False)
        self.act = nn.SiLU()
        self.dropout = nn.Identity()
        self.rotary_emb = LLaDARotaryEmbedding(config)

    def attention(self, q, k, v, attention_bias=None):
        b, t, c = q.shape
        hd = c // self.config.n_heads
        q = q.view(b, t, -1, hd).transpose(1, 2)
        k = k.view(b, t, -1, hd).transpose(1, 2)
        v = v.view(b, t, -1, hd).transpose(1, 2)
        q, k = self.rotary_emb(q, k)
        att = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_bias, is_causal=False, enable_gqa=k.shape[1] != q.shape[1]
        )
        return self.attn_out(att.transpose(1, 2).reshape(b, t, c))

    def forward(self, x, attention_bias=None, layer_past=None, use_cache=False):
        """``x`` ``[B, T, d_model]``; ``attention_bias`` bool ``[B, 1, 1, T]`` (True = attend) or None.
        Returns ``(x, None)`` like LLaDA's blocks."""
        xn = self.attn_norm(x)
        x = x + self.dropout(self.attention(self.q_proj(xn), self.k_proj(xn), self.v_proj(xn), attention_bias))
        hn = self.ff_norm(x)
        x = x + self.dropout(self.ff_out(self.act(self.ff_proj(hn)) * self.up_proj(hn)))
        return x, None


class LLaDALayoutPreTrainedModel(PreTrainedModel):
    config_class = LLaDALayoutConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDALayoutBlock"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, LlamaRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, LLaDARotaryEmbedding):  # non-persistent buffer: not in checkpoints
            with torch.no_grad():
                module.inv_freq.copy_(module.compute_inv_freq(self.config))


class LLaDALayoutForMaskedLM(LLaDALayoutPreTrainedModel):
    """LLaDA-layout bidirectional LM returning logits for all positions (test model, layout b).

    Module tree as in LLaDA: ``model.transformer.{wte, blocks, ln_f, ff_out}``.
    """

    def __init__(self, config: LLaDALayoutConfig):
        super().__init__(config)
        self.model = nn.Module()
        self.model.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.d_model),
                "blocks": nn.ModuleList([LLaDALayoutBlock(i, config) for i in range(config.n_layers)]),
                "ln_f": LlamaRMSNorm(config.d_model, eps=config.rms_norm_eps),
                "ff_out": nn.Linear(config.d_model, config.vocab_size, bias=False),
            }
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer["wte"]

    def get_output_embeddings(self) -> nn.Linear:
        """The LM head (LLaDA's ``transformer.ff_out``)."""
        return self.model.transformer["ff_out"]

    def forward(self, input_ids=None, attention_mask=None, logits_to_keep=None, **kwargs) -> MaskedLMOutput:
        """``input_ids`` ``[B, T]`` int64; ``attention_mask`` ``[B, T]`` (1 = token, 0 = padding);
        returns ``MaskedLMOutput(logits=[B, T', vocab])`` (``T'`` as in ``logits_to_keep``)."""
        tr = self.model.transformer
        x = tr["wte"](input_ids)
        bias = None
        if attention_mask is not None and not bool(attention_mask.all()):
            bias = attention_mask.bool()[:, None, None, :]
        for block in tr["blocks"]:
            x, _ = block(x, attention_bias=bias)
        x = tr["ln_f"](_keep(x, logits_to_keep))
        return MaskedLMOutput(logits=tr["ff_out"](x))


AutoConfig.register(BidirectionalLlamaConfig.model_type, BidirectionalLlamaConfig, exist_ok=True)
AutoModelForMaskedLM.register(BidirectionalLlamaConfig, BidirectionalLlamaForMaskedLM, exist_ok=True)
AutoConfig.register(LLaDALayoutConfig.model_type, LLaDALayoutConfig, exist_ok=True)
AutoModelForMaskedLM.register(LLaDALayoutConfig, LLaDALayoutForMaskedLM, exist_ok=True)


#: Shapes of the random-weight instances. "1b": about 1.1e9 parameters (0.62e9 in the 12 blocks,
#: the rest in LLaDA's 126464-token embedding and LM head), d_model 2048, 16 heads of 128, SwiGLU 5632.
#: "300m": about 0.30e9 parameters (0.23e9 in 18 blocks of d_model 1024, 16 heads of 64, SwiGLU 2816,
#: LLaDA's FFN ratio; a 32768-token vocabulary, so the blocks keep most of the weights as in "1b").
SIZES = {
    "tiny": dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128),
    "small": dict(vocab=1024, hidden=256, layers=4, heads=8, kv_heads=8, ffn=688),
    "300m": dict(vocab=32768, hidden=1024, layers=18, heads=16, kv_heads=16, ffn=2816),
    "1b": dict(vocab=126464, hidden=2048, layers=12, heads=16, kv_heads=16, ffn=5632),
}


def build_test_model(layout: str = "llada", size: str = "tiny", *, seed: int = 0, dream: bool = False,
                     dtype: torch.dtype = torch.float32) -> PreTrainedModel:  # fmt: skip
    """A random-weight bidirectional test model, in eval mode.

    Args:
        layout: ``"llada"`` (LLaDA block layout) or ``"llama"`` (transformers Llama layers, Dream-like).
        size: ``"tiny"``, ``"small"``, ``"300m"`` or ``"1b"`` (see :data:`SIZES`).
        seed: torch seed for the weights.
        dream: set ``shift_logits`` (Dream convention) in the config.
        dtype: parameter dtype.

    The [MASK] id is ``config.mask_token_id`` (LLaDA's 126336 for "1b", ``vocab - 1`` otherwise).

    Raises:
        RiverError: unknown layout or size.
    """
    if size not in SIZES:
        raise RiverError(f"unknown test model size {size!r}; choose one of {sorted(SIZES)}")
    s = SIZES[size]
    mask_id = LLADA_MASK_ID if s["vocab"] > LLADA_MASK_ID else s["vocab"] - 1
    torch.manual_seed(seed)
    if layout == "llada":
        cfg = LLaDALayoutConfig(
            vocab_size=s["vocab"], d_model=s["hidden"], n_layers=s["layers"], n_heads=s["heads"],
            n_kv_heads=s["kv_heads"], mlp_hidden_size=s["ffn"], mask_token_id=mask_id, shift_logits=dream,
            rope_theta=500000.0,
        )  # fmt: skip
        model = LLaDALayoutForMaskedLM(cfg)
    elif layout == "llama":
        cfg = BidirectionalLlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], intermediate_size=s["ffn"],
            mask_token_id=mask_id, shift_logits=dream, max_position_embeddings=4096,
        )  # fmt: skip
        model = BidirectionalLlamaForMaskedLM(cfg)
    else:
        raise RiverError(f"unknown layout {layout!r}; choose 'llada' or 'llama'")
    return model.to(dtype).eval()
