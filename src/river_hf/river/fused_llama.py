"""The fused exit layer of the Llama / Qwen2 / Mistral family (``model_type`` llama, qwen2,
mistral; SmolLM2 is a Llama), registered as the ``llama`` family of :mod:`.fused_layer`.

These decoder layers compute ``h = x + o(attn(rope(q(n1(x))), rope(k(n1(x))), v(n1(x))))`` and
``out = h + down(silu(gate(n2(h))) * up(n2(h)))`` with T5-style RMSNorms ``n1``, ``n2``
(``weight * x / sqrt(mean(x²) + eps)``), rotary embeddings in the ``rotate_half`` layout and
grouped-query attention; Qwen2 adds q/k/v biases, Mistral and Qwen2 may have a sliding window
(which transformers puts into the attention mask each layer receives). :class:`FusedLlamaLayer`
computes that on the exit copy's own kernel modules with few, big calls:

- ``torch.nn.functional.rms_norm`` for each norm (torch's own, one call);
- one stacked q/k/v product and one stacked gate/up product when the exit copy has them
  (``RiverConfig.fuse_projections``: the :class:`~river_hf.quant.fused.FusedProjection`'s kernel is
  called directly, not its slices); otherwise the separate products, concatenated once;
- rotary on q and k together, on the ``[batch, heads, tokens, head_dim]`` view of the product:
  ``qk * cos + roll(qk, head_dim / 2) * sin_signed``, where ``sin_signed`` is ``sin`` with its first
  half negated (``rotate_half(x) * sin`` term by term, bit for bit; a multiply and an add as in the
  architecture, not a fused multiply-add, which rounds once less), made once per forward pass from the
  ``position_embeddings`` the model computed (kept while the same ``cos``/``sin`` tensors come
  back, per thread);
- K/V written through the cache's public ``update`` with the layer's index, in the layout and
  dtype the architecture writes (``[batch, kv_heads, tokens, head_dim]``, model dtype, rotary
  applied to K): the backbone reads them;
- ``scaled_dot_product_attention`` on the inputs transformers' ``sdpa`` attention
  (``transformers.integrations.sdpa_attention``, 5.24 and 5.25) hands it: with no mask
  ``enable_gqa``, the causal flag and the static-cache crop; with a mask (a padded batch, a sliding
  window) the mask as it came, and for one query token the query heads of each K/V head packed as
  its query rows (its ``pack_gqa``), for more tokens K/V repeated per query head (``repeat_kv``):
  the same SDPA call, so the same numbers as the architecture's layer on the same weights;
- one cast into each product's compute dtype where the kernel computes in bf16 inside an fp32
  model (:class:`~river_hf.quant.modules.Int4WeightOnlyLinear`, ``Int8WeightOnlyLinear``,
  ``CastLinear``), its output folded into the next op that needs fp32 (the residual add, the
  rotary multiply), which gives the same numbers as the kernel's own cast back.

When every product is one :class:`~river_hf.quant.river_int4.RiverInt4Linear` (river-int4, q/k/v and
gate/up stacked) in an fp32 model, the layer is two calls into river-int4's C++ extension around the
cache's own ``update`` (``attention_in``: input norm, q/k/v product, rotary; ``attention_out``:
attention, o product and residual, second norm, gate/up product, ``silu(gate) * up``, down product
and residual). The norms, silu and, for one query token (a decode step), the attention over the
cache slot and the mask as they are, are River's own loops (``csrc/layer_ops.h``): ATen's ops cost
10-50 µs a call there in dispatch and set-up for microseconds of arithmetic. They compute the same
functions in another float rounding order, so this path is not bit for bit the architecture copy's
numbers (the build check bounds it; :mod:`.fused_layer`); more query tokens go to SDPA on the inputs
transformers gives it, as in the Python path. On a decode step after the exit, the
:class:`~river_hf.river.layer.RiverLayer` of the first exit layer hands it the exit layers after it
(``river_stack``), and where all of them can they run in one call, ``exit_stack`` (:mod:`.exit_stack`):
the same functions per layer, each cache slot updated as transformers' ``DynamicLayer.update`` does
it, or, on River's own :class:`~river_hf.river.cache.GrowingLayer` slots, each new position written
into the slot's room.

The attention implementations served are ``sdpa`` and ``eager`` (their masks are tensors SDPA
takes as they are; eager with no mask attends to every key, as eager does); another one
(flash, flex) makes the call run the architecture copy.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import attn_implementation, sdpa_gqa
from ..quant.fused import FUSED_NAMES, GROUPS
from ..quant.modules import CastLinear, Int4WeightOnlyLinear, Int8WeightOnlyLinear
from ..quant import river_int4
from ..quant.river_int4 import RiverInt4Linear
from .exit_stack import one_token_mask, stack_forward
from .fused_layer import ExitLayerFamily, FusedExitLayer, register_family

__all__ = ["LlamaFamily", "FusedLlamaLayer", "LLAMA_FAMILY", "step_tables"]

#: attention implementations whose masks SDPA takes as they are
_ATTENTION = ("sdpa", "eager")
#: kernel modules that take their compute dtype as input and then return it (the cast is ours)
_CASTING_KERNELS = (Int4WeightOnlyLinear, Int8WeightOnlyLinear, CastLinear)
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}


class _StepTables(threading.local):
    """This thread's tables derived from the forward pass in flight: the rotary ``cos``/``sin`` it
    came with (identity and version), their ``[batch, 1, tokens, head_dim]`` forms, and the
    attention implementation of each config seen in it."""

    def __init__(self):
        self.key = None
        self.tables = None
        self.impls: dict = {}


_TABLES = _StepTables()


def _version(t: torch.Tensor):
    return None if t.is_inference() else t._version  # inference tensors have no version counter


def _begin_pass(cos: torch.Tensor, sin: torch.Tensor) -> _StepTables:
    """This thread's tables, started anew when ``cos`` / ``sin`` are not the tensors (identity and
    version) of the pass they were made in: the model computes ``position_embeddings`` once per
    forward pass, so new tensors mean a new pass. Starting one drops the signed tables and the
    attention implementations read in the last pass (a few µs of Python; no tensor op)."""
    local = _TABLES
    key = local.key
    if key is None or key[0] is not cos or key[1] is not sin or key[2] != _version(cos) or key[3] != _version(sin):
        local.key, local.tables, local.impls = (cos, sin, _version(cos), _version(sin)), None, {}
    return local


def step_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos4, sin4)``: ``cos`` ``[batch, tokens, head_dim]`` as ``[batch, 1, tokens, head_dim]``, and
    ``sin`` likewise with its first half negated, so ``x * cos4 + roll(x, head_dim / 2) * sin4``
    is ``x * cos + rotate_half(x) * sin``. Made once per forward pass (:func:`_begin_pass`), for the
    Python path only: river-int4's C++ calls take ``cos`` / ``sin`` as they come."""
    local = _begin_pass(cos, sin)
    if local.tables is None:
        half = sin.shape[-1] // 2
        local.tables = (cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1))
    return local.tables


def _pass_attn_implementation(config) -> str:
    """``config``'s attention implementation, read once per forward pass (:func:`_begin_pass` starts
    a pass's set; a transformers config's attribute read costs ~15 µs, once per layer otherwise)."""
    impls = _TABLES.impls
    impl = impls.get(id(config))
    if impl is None or impl[0] is not config:
        impl = impls[id(config)] = (config, attn_implementation(config))
    return impl[1]


def _feed_dtype(kernel: nn.Module) -> torch.dtype | None:
    """The dtype to hand ``kernel`` inside an fp32 model (its compute dtype, when it is one of
    :data:`_CASTING_KERNELS` and narrower than fp32), else None (it gets the model's dtype)."""
    if isinstance(kernel, _CASTING_KERNELS) and kernel.compute_dtype in (torch.bfloat16, torch.float16):
        return kernel.compute_dtype
    return None


class FusedLlamaLayer(FusedExitLayer):
    """The fused exit layer of a Llama / Qwen2 / Mistral exit copy (module docstring).

    Called exactly like the architecture's decoder layer (``hidden_states [batch, tokens, hidden]``,
    ``attention_mask``, ``position_ids``, ``cache`` (or ``past_key_values``), ``use_cache``,
    ``position_embeddings`` = ``(cos, sin)`` each ``[batch, tokens, head_dim]``, other keyword
    arguments passed on to the cache's ``update``); returns ``[batch, tokens, hidden]`` in the
    input's dtype. With ``river_stack`` (the exit layers after this one, from its RiverLayer) it
    returns ``(output after the last layer it ran, how many layers it ran)``: all of them in one call
    when it can, else itself alone (1). A call it cannot serve (:meth:`serves`, no ``position_embeddings``, a rotary
    table narrower than ``head_dim``, a mask that is not a tensor) runs the architecture copy.
    """

    family = "llama"
    #: whether a decode step after the exit may run this layer and the exit layers after it in one
    #: call (:meth:`_stack_forward`; RiverLayer asks with ``river_stack``); False: one call pair a layer
    stacks = True

    def __init__(self, exit_copy: nn.Module, config):
        super().__init__(exit_copy)
        attn, mlp = exit_copy.self_attn, exit_copy.mlp
        d = self.head_dim = attn.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.rep = self.heads // self.kv_heads
        self.scaling = attn.scaling
        self.layer_index = attn.layer_idx
        self.hidden = config.hidden_size
        self.intermediate = getattr(mlp, "intermediate_size", None) or config.intermediate_size
        self.attn_config = config  # the exit copy's own (its attention implementation is read per call)
        fused_qkv = attn._modules.get(FUSED_NAMES[GROUPS[0]])
        fused_gu = mlp._modules.get(FUSED_NAMES[GROUPS[1]])
        kernels = {
            "qkv": (fused_qkv.linear,) if fused_qkv is not None else (attn.q_proj, attn.k_proj, attn.v_proj),
            "o": (attn.o_proj,),
            "gu": (fused_gu.linear,) if fused_gu is not None else (mlp.gate_proj, mlp.up_proj),
            "down": (mlp.down_proj,),
        }
        # plain references into the architecture copy (its child), not modules of this layer
        self.__dict__["kernels"] = kernels
        self.__dict__["feeds"] = {k: _feed_dtype(mods[0]) if len({_feed_dtype(m) for m in mods}) == 1 else None
                                  for k, mods in kernels.items()}
        self.__dict__["norms"] = (exit_copy.input_layernorm, exit_copy.post_attention_layernorm)
        self.qk_size = (self.heads + self.kv_heads) * d
        # every product one river-int4 module (q/k/v and gate/up stacked): in fp32 models the layer is
        # two C++ calls around the cache update (_int4_forward)
        self.int4_calls = all(len(mods) == 1 and isinstance(mods[0], RiverInt4Linear) for mods in kernels.values())

    def _product(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """The product(s) ``key`` of ``x`` (concatenated when separate), in the kernel's compute dtype
        (one cast in, none out) when it computes narrower than fp32 inside an fp32 model."""
        feed = self.feeds[key]
        if feed is not None and x.dtype == torch.float32:
            x = x.to(feed)
        mods = self.kernels[key]
        if len(mods) == 1:
            return mods[0](x)
        return torch.cat([m(x) for m in mods], dim=-1)

    def _norm(self, index: int, x: torch.Tensor) -> torch.Tensor:
        norm = self.norms[index]
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache: bool | None = False, position_embeddings=None, river_stack=None, **kwargs):
        if river_stack is not None:  # RiverLayer asks this layer to run the exit layers after it too
            out = self._stack_forward(river_stack, hidden_states, attention_mask, cache, position_embeddings, kwargs)
            if out is not None:
                return out, len(river_stack) + 1
            return self.forward(hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings,
                                **kwargs), 1
        past = kwargs.pop("past_key_values", None)
        if cache is None:
            cache = past
        if position_embeddings is not None:
            cos, sin = position_embeddings
            _begin_pass(cos, sin)
            impl = _pass_attn_implementation(self.attn_config)
        if (position_embeddings is None or impl not in _ATTENTION or not self.serves()
                or position_embeddings[0].shape[-1] != self.head_dim
                or (attention_mask is not None and not isinstance(attention_mask, torch.Tensor))):
            return self.architecture(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                     cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
                                     **kwargs)
        batch, tokens, _ = hidden_states.shape
        d, heads, kv = self.head_dim, self.heads, self.kv_heads
        dtype = hidden_states.dtype
        if (self.int4_calls and dtype == torch.float32 and cos.dtype == torch.float32 and cos.dim() == 3
                and cos.shape[0] in (1, batch) and cos.shape[1] == tokens):
            return self._int4_forward(hidden_states, cache, attention_mask, position_ids, use_cache, cos, sin,
                                      impl, kwargs)
        cos4, sin4 = step_tables(cos, sin)
        qkv = self._product("qkv", self._norm(0, hidden_states))

        # attention: one product, rotary on q and k at once, K/V into the shared cache slot
        qkv = qkv.view(batch, tokens, heads + 2 * kv, d).transpose(1, 2)
        qk, values = qkv.split((heads + kv, kv), dim=1)  # [batch, heads, tokens, head_dim] views
        # the model's dtype (cos4's); not addcmul: its fused multiply-add rounds differently from the
        # architecture's q * cos + rotate_half(q) * sin, and bf16 re-rounding can amplify that
        qk = qk * cos4 + qk.roll(d // 2, dims=-1) * sin4
        query, keys = qk.split((heads, kv), dim=1)
        values = values.to(dtype)
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_index,
                                        kwargs={"position_ids": position_ids, "use_cache": use_cache, **kwargs})
        query, keys, values, mask, causal, gqa = self._sdpa_inputs(attention_mask, impl, query, keys, values)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scaling,
                                              is_causal=causal, enable_gqa=gqa)
        attn = attn.reshape(batch, heads, tokens, d).transpose(1, 2).reshape(batch, tokens, heads * d)
        hidden_states = hidden_states + self._product("o", attn)  # one add, in the model's dtype

        # MLP: one gate/up product, silu(gate) * up in the model's dtype
        gu = self._product("gu", self._norm(1, hidden_states))
        gate, up = gu.split(self.intermediate, dim=-1)
        act = F.silu(gate.to(dtype)) * up
        return hidden_states + self._product("down", act)

    def _sdpa_inputs(self, mask, impl: str, query, keys, values):
        """``(query, keys, values, mask, is_causal, enable_gqa)`` as transformers' ``sdpa`` attention
        (``sdpa_attention_forward`` of transformers 5.24 / 5.25) hands them to SDPA, from ``query``
        ``[batch, heads, tokens, head_dim]`` and the cache's ``keys`` / ``values``, by transformers'
        own helpers (:func:`~river_hf.compat.sdpa_gqa`): ``enable_gqa`` when there is no mask; with a
        mask and one query token, each K/V head's query heads packed as its rows
        (``[batch, kv_heads, heads / kv_heads, head_dim]``); with a mask and more tokens, K/V
        repeated per query head. The causal flag with no
        mask and several tokens (``sdpa`` only: eager with no mask attends to every key), with an
        empty static cache's prefill cropped. SDPA's output has ``batch * heads * tokens`` rows of
        ``head_dim`` in the head order either way."""
        tokens = query.shape[2]
        query, keys, values, mask, gqa = sdpa_gqa(query, keys, values, mask, self.rep)
        causal = impl == "sdpa" and tokens > 1 and mask is None
        if causal and keys.shape[2] > tokens:  # an empty static cache's prefill (transformers' crop)
            keys, values = keys[:, :, :tokens], values[:, :, :tokens]
        return query, keys, values, mask, causal, gqa

    def _int4_forward(self, hidden_states, cache, attention_mask, position_ids, use_cache, cos, sin, impl, kwargs):
        """The layer in two C++ calls of river-int4's extension around the cache's own ``update``
        (every product one :class:`~river_hf.quant.river_int4.RiverInt4Linear`, fp32): the input
        norm, the q/k/v product and rotary; then attention, ``h = x + o(attn)``, the gate/up product
        of ``norm(h)`` and ``h + down(silu(gate) * up)``. Rotary and the residual adds do the Python
        path's multiplies and adds in its order; the norms, silu and one-token attention (a mask
        none or ``[batch or 1, 1, 1, keys]``, :func:`.exit_stack.one_token_mask`) are River's own loops, the same
        functions up to float rounding order; attention over more tokens is SDPA."""
        batch, tokens, hidden = hidden_states.shape
        ext = river_int4.extension()
        rows = hidden_states.reshape(batch * tokens, hidden)
        qkv, o, gu, down = (self.kernels[k][0] for k in ("qkv", "o", "gu", "down"))
        norm1, norm2 = self.norms
        query, keys, values = ext.attention_in(rows, qkv.packed, qkv.bias, qkv.group_size, norm1.weight,
                                               norm1.variance_epsilon, cos, sin, batch, tokens, self.heads,
                                               self.kv_heads, self.head_dim)
        if cache is not None:
            keys, values = cache.update(keys, values, self.layer_index,
                                        kwargs={"position_ids": position_ids, "use_cache": use_cache, **kwargs})
        one = tokens == 1 and self.head_dim % 8 == 0 and one_token_mask(attention_mask, batch, keys.shape[2])
        if one:  # River's own attention reads the cache slot and the mask as they are
            mask, causal, gqa = attention_mask, False, False
        else:
            query, keys, values, mask, causal, gqa = self._sdpa_inputs(attention_mask, impl, query, keys, values)
        out = ext.attention_out(query, keys, values, mask, causal, self.scaling, gqa, one, rows, o.packed, o.bias,
                                o.group_size, gu.packed, gu.bias, gu.group_size, norm2.weight, norm2.variance_epsilon,
                                down.packed, down.bias, down.group_size)
        return out.view(batch, tokens, hidden)

    def _stack_forward(self, following, hidden_states, attention_mask, cache, position_embeddings, kwargs):
        """This layer and the exit layers ``following`` it (a decode step after the exit) in one call of
        river-int4's extension, or None when that call cannot serve them (:func:`.exit_stack.stack_forward`:
        the same numbers and the same KV cache as layer by layer)."""
        if not self.stacks:
            return None
        if cache is None:
            cache = kwargs.get("past_key_values")
        return stack_forward(self, following, hidden_states, attention_mask, cache, position_embeddings, _ATTENTION)

    def extra_repr(self) -> str:
        separate = [k for k, mods in self.kernels.items() if len(mods) > 1]
        return super().extra_repr() + (f", separate products: {separate}" if separate else "")


class LlamaFamily(ExitLayerFamily):
    """Llama, Qwen2 and Mistral decoder layers (:class:`FusedLlamaLayer`): told by the config's
    ``model_type`` and the layer's structure (children, norms, activation, attention)."""

    name = "llama"
    model_types = ("llama", "qwen2", "mistral")

    def refusal(self, layer: nn.Module, config) -> str | None:
        if config is None:
            return "the layer's attention keeps no config"
        model_type = getattr(config, "model_type", None)
        if model_type not in self.model_types:
            return f"model type {model_type!r} is not one of {', '.join(self.model_types)}"
        impl = attn_implementation(config)
        if impl not in _ATTENTION:
            return f"attention implementation {impl!r} (served: {', '.join(_ATTENTION)})"
        if set(layer._modules) != _LAYER_CHILDREN:
            return f"decoder layer children {sorted(layer._modules)}, expected {sorted(_LAYER_CHILDREN)}"
        attn, mlp = layer.self_attn, layer.mlp
        if not _ATTN_CHILDREN <= set(attn._modules) <= _ATTN_CHILDREN | {FUSED_NAMES[GROUPS[0]]}:
            return f"attention children {sorted(attn._modules)} (a q/k norm or other extra module)"
        if not _MLP_CHILDREN <= set(mlp._modules) <= _MLP_CHILDREN | {FUSED_NAMES[GROUPS[1]]}:
            return f"MLP children {sorted(mlp._modules)}"
        probe = torch.linspace(-6.0, 6.0, 13)
        if getattr(config, "hidden_act", None) not in ("silu", "swish") or not torch.equal(mlp.act_fn(probe),
                                                                                          F.silu(probe)):
            return f"activation {getattr(config, 'hidden_act', None)!r} is not silu"
        if getattr(config, "pretraining_tp", 1) not in (None, 1):
            return "pretraining_tp > 1"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            weight = getattr(norm, "weight", None)
            if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (config.hidden_size,) or not isinstance(
                    getattr(norm, "variance_epsilon", None), float):
                return f"norm {type(norm).__name__} is not an RMSNorm with weight [hidden] and variance_epsilon"
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        d = getattr(attn, "head_dim", None)
        if not isinstance(d, int) or d % 2 or heads % kv or not getattr(attn, "is_causal", False):
            return "attention is not causal grouped-query attention with an even head_dim"
        if not all(hasattr(attn, n) for n in ("scaling", "layer_idx")):
            return "attention has no scaling or layer_idx"
        want = [heads * d, kv * d, kv * d]
        outs = [getattr(getattr(attn, n), "out_features", w) for n, w in zip(("q_proj", "k_proj", "v_proj"), want)]
        if outs != want:  # a kernel module that does not say its width is checked by the build check
            return f"q/k/v widths {outs}, expected {want}"
        return None

    def dtype(self, layer: nn.Module) -> torch.dtype:
        """The input norm's weight dtype (a quantized kernel's parameters may be in its compute dtype)."""
        return layer.input_layernorm.weight.dtype

    def build(self, exit_copy: nn.Module, config) -> FusedLlamaLayer:
        return FusedLlamaLayer(exit_copy, config)

    def check_kwargs(self, exit_copy: nn.Module, config, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """Default RoPE (θ = 10000) tables of ``positions``: any rotary tables compare the two
        implementations, the model's own are not needed."""
        d = exit_copy.self_attn.head_dim
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
        freqs = positions[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return {"attention_mask": None, "position_ids": positions, "use_cache": True,
                "position_embeddings": (emb.cos().to(dtype), emb.sin().to(dtype))}


LLAMA_FAMILY = register_family(LlamaFamily())
