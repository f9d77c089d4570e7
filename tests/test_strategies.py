"""The KV-absence baselines (river/strategies.py) on tiny random configs.

First the exactness switch for every strategy on every family (τ > 1: the unmodified tokens), then
each baseline's K/V handling against a hand-written reference over 3 decode steps, with the exits
scripted per decode pass (:class:`ScriptedExit`) so every case is reached on purpose.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from river_hf import RiverCache, RiverConfig, RiverError, enable_river
from river_hf.river import ExitRule, ExitRuleList
from river_hf.river.strategies import STRATEGIES
from test_river_core import COMMON, FAMILIES, batch_inputs, tiny_model

GEN = dict(do_sample=False)
PROMPT = 10


class ScriptedExit(ExitRule):
    """Decode pass n (0-based, prefill not counted: it stays on the backbone) exits after
    ``exits[n]`` backbone layers; None or a pass past the script: stay."""

    def __init__(self, exits):
        self.exits = list(exits)
        self.passes = -1

    def __call__(self, layer_idx, hidden_in, hidden_out, token_mask):
        if layer_idx == 0:
            self.passes += 1
        want = self.exits[self.passes] if self.passes < len(self.exits) else None
        return want is not None and layer_idx + 1 == want


def river(base, strategy, tau=2.0, **kw):
    return enable_river(copy.deepcopy(base), tau=tau, min_layer=1, backend=kw.pop("backend", "int4"),
                        prefill=kw.pop("prefill", "backbone"), strategy=strategy, progress=False, **kw)


def scripted(model, exits):
    model.river.rules = ExitRuleList([ScriptedExit(exits)])
    return model


def ids(length=PROMPT, seed=1):
    torch.manual_seed(seed)
    return torch.randint(3, 256, (1, length))


def generate(model, prompt, new, cache=None):
    cache = cache if cache is not None else RiverCache(config=model.config)
    out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, cache=cache, **GEN)
    return out, cache


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_strategy_is_exact_above_one(family, strategy):
    base = tiny_model(family)
    model = river(base, strategy, prefill="route")
    single = ids(20)  # past Gemma3's sliding window of 8
    assert torch.equal(model.generate(single, max_new_tokens=12, **GEN), base.generate(single, max_new_tokens=12, **GEN))
    batch = batch_inputs()
    assert torch.equal(model.generate(**batch, max_new_tokens=8, **GEN), base.generate(**batch, max_new_tokens=8, **GEN))
    assert model.river_stats["strategy"] == strategy


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_baseline_generates_when_every_step_exits(family, strategy):
    """τ = -2: every decode step exits after one layer, batched with padding too (the cache slots
    then differ per layer); the right number of tokens comes out."""
    base = tiny_model(family)
    model = river(base, strategy, prefill="route")
    with pytest.warns(UserWarning, match="negative"):
        out = model.generate(ids(20), max_new_tokens=12, min_new_tokens=12, river_tau=-2.0, **GEN)
    stats = model.river_stats
    assert out.shape[1] == 32
    if strategy == "recompute":  # every pass after an exit re-feeds it through all layers
        counts = stats["exit_layer_counts"]
        assert abs(counts[1] - counts[-1]) <= 1  # alternating (the prompt pass exits too here)
        assert counts[1] + counts[-1] == stats["forward_passes"]
    else:
        assert stats["mean_exit_layer"] == 1
    with pytest.warns(UserWarning, match="negative"):
        out = model.generate(**batch_inputs(), max_new_tokens=6, min_new_tokens=6, river_tau=-2.0, **GEN)
    assert out.shape == (2, 18)


def llama(attn="sdpa"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON), attn_implementation=attn).eval()
    model.generation_config.pad_token_id = 0
    return model


def reference_cache(base, tokens):
    """The unmodified model's K/V for ``tokens`` (every position through every layer)."""
    cache = DynamicCache(config=base.config)
    with torch.no_grad():
        base(tokens, cache=cache)
    return cache


def test_recompute_fills_the_skipped_layers_in_the_next_pass():
    """Decode pass 1 exits after 1 layer; pass 2 feeds [g1, g2] through all 4 layers (it may not
    exit); pass 3 exits after 2 layers; pass 4 feeds [g3, g4] through all layers. Afterwards every
    layer holds exactly the unmodified model's K/V for the whole sequence, and g5 is the
    unmodified model's next token."""
    base = llama()
    model = scripted(river(base, "recompute"), [1, 2])  # the rule is asked only in passes that may exit
    out, cache = generate(model, ids(), 5)
    assert model.river_stats["exit_layer_counts"] == [0, 1, 1, 0, 2]
    assert cache.step_tokens == [PROMPT, 2, 2] and cache.exit_layers == [4, 4, 4]  # re-fed passes replaced exited ones
    ref = reference_cache(base, out[:, :-1])
    for layer, want in zip(cache.layers, ref.layers):
        assert layer.keys.shape[-2] == PROMPT + 4
        torch.testing.assert_close(layer.keys, want.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values, want.values, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert base(out[:, :-1]).logits[0, -1].argmax() == out[0, -1]


def test_recompute_cuts_back_sliding_window_layers():
    """Gemma3 with a sliding window of 8: exited tokens are re-fed past the window; afterwards the
    cache equals the unmodified model's (sliding layers keep their last window - 1 positions)."""
    base = tiny_model("gemma3")
    model = scripted(river(base, "recompute"), [1, 1])  # passes 1 and 3 exit, 2 and 4 re-feed them
    out, cache = generate(model, ids(12), 5)
    ref = reference_cache(base, out[:, :-1])
    for layer, want in zip(cache.layers, ref.layers):
        n = want.keys.shape[-2]
        torch.testing.assert_close(layer.keys[..., -n:, :], want.keys, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert base(out[:, :-1]).logits[0, -1].argmax() == out[0, -1]


def test_skipdecode_exit_layers_never_increase():
    """Pass 1 exits after 3 layers, pass 2 would stay (capped at 3), pass 3 exits after 1, pass 4
    would exit after 2 (capped at 1): exit layers 3, 3, 1, 1; a layer's cache slot holds the
    prompt plus the tokens that reached it, and the shallow layers equal the unmodified K/V."""
    base = llama()
    model = scripted(river(base, "skipdecode"), [3, None, 1, 2])
    out, cache = generate(model, ids(), 5)
    assert cache.exit_layers == [4, 3, 3, 1, 1]
    reached = [PROMPT + sum(e > j for e in cache.exit_layers[1:]) for j in range(4)]
    assert [layer.keys.shape[-2] for layer in cache.layers] == reached == [PROMPT + 4, PROMPT + 2, PROMPT + 2, PROMPT]
    ref = reference_cache(base, out[:, :PROMPT + 4])
    torch.testing.assert_close(cache.layers[0].keys, ref.layers[0].keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.layers[3].keys, ref.layers[3].keys[..., :PROMPT, :], rtol=1e-5, atol=1e-5)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rms(x, weight, eps, gemma):
    """RMSNorm over the last dim, as the family defines it (Gemma 3: fp32, scale 1 + weight)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + weight.float()) if gemma else y * weight


def _perturb_norms_and_biases(model):
    """Random norm weights and projection biases (from_config leaves Gemma's norms at 0 and
    Qwen2's biases at 0, where a reference that dropped them would still agree)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_state_propagation_writes_the_skipped_layers_projections_of_the_exit_state(family):
    """Every decode pass exits after layer 0; each skipped layer's cache slot must hold, at that
    position, input norm -> K/V projection (+ bias) -> k-norm -> rotary of the exit hidden state,
    computed here by hand from each layer's own weights: Llama (no bias, one rope theta), Qwen2
    (k/v projection biases), Gemma 3 (norms scale by 1 + weight, a k-norm per head, and the local
    rope theta on sliding layers, the global one on full layers; the sliding layers' slots keep
    only their last window - 1 positions)."""
    base = _perturb_norms_and_biases(tiny_model(family))
    model = scripted(river(base, "state-propagation"), [1, 1, 1])
    exit_states = []
    hook = model.model.layers[0].register_forward_hook(lambda m, a, o: exit_states.append(o.detach().clone()))
    out, cache = generate(model, ids(), 4)
    hook.remove()
    cfg = base.config
    gemma = family == "gemma3"
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    total = PROMPT + 3  # positions fed: the prompt and 3 decode passes
    if family == "qwen2":
        assert base.model.layers[1].self_attn.k_proj.bias.abs().sum() > 0  # the bias is there to be dropped
    for step, h in enumerate(exit_states[1:]):  # [0] is the prompt pass
        pos = PROMPT + step
        for j in range(1, 4):
            layer = base.model.layers[j]
            attn = layer.self_attn
            x = _rms(h[0, 0], layer.input_layernorm.weight, cfg.rms_norm_eps, gemma)
            k = x @ attn.k_proj.weight.T
            v = x @ attn.v_proj.weight.T
            if attn.k_proj.bias is not None:
                k, v = k + attn.k_proj.bias, v + attn.v_proj.bias
            k, v = k.view(-1, d), v.view(-1, d)
            if gemma:
                k = _rms(k, attn.k_norm.weight, cfg.rms_norm_eps, True)
                theta = cfg.rope_parameters[cfg.layer_types[j]]["rope_theta"]
            else:
                theta = cfg.rope_parameters["rope_theta"]
            inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
            emb = torch.cat([pos * inv_freq] * 2)
            k = k * emb.cos() + _rotate_half(k) * emb.sin()
            slot = cache.layers[j]
            at = pos - total + slot.keys.shape[-2]  # sliding layers keep the last positions only
            torch.testing.assert_close(slot.keys[0, :, at], k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(slot.values[0, :, at], v, rtol=1e-5, atol=1e-5)
    kept = [layer.keys.shape[-2] for layer in cache.layers]
    assert kept == ([cfg.sliding_window - 1, total] * 2 if gemma else [total] * 4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_kv_mask_gives_absent_positions_zero_attention_weight(attn):
    """Pass 1 exits after 1 layer (its token is absent at layers 1-3), pass 2 after 2 (absent at
    2-3), pass 3 goes through: at layer 3 both positions get attention weight exactly 0, at layer
    1 only pass 1's; every other position a positive weight. sdpa (no mask given for one-token
    steps: River builds it) and eager (an additive mask, narrowed) give the same tokens."""
    base = llama(attn)
    model = scripted(river(base, "kv-mask"), [1, 2, None])
    weights = {}

    def capture(j):
        def hook(module, args, kwargs, output):
            q = kwargs["hidden_states"].shape[1]
            if q == 1:
                weights.setdefault(j, []).append(output[1])
        return hook

    handles = []
    if attn == "eager":
        handles = [model.model.layers[j].backbone.self_attn.register_forward_hook(capture(j), with_kwargs=True)
                   for j in range(4)]
    out, cache = generate(model, ids(), 4)
    for h in handles:
        h.remove()
    p1, p2 = PROMPT, PROMPT + 1  # positions of the tokens fed by decode passes 1 and 2
    assert cache.river_absent[3][0, [p1, p2]].tolist() == [True, True]
    assert cache.river_absent[1][0, [p1, p2]].tolist() == [True, False]
    assert all(layer.keys.shape[-2] == PROMPT + 3 for layer in cache.layers)
    if attn == "eager":
        w3 = weights[3][-1][0, :, 0]  # pass 3 at layer 3: [heads, kv]
        assert torch.all(w3[:, [p1, p2]] == 0) and torch.all(w3[:, :p1] > 0) and torch.all(w3[:, p2 + 1:] > 0)
        w1 = weights[1][-1][0, :, 0]
        assert torch.all(w1[:, p1] == 0) and torch.all(w1[:, p2] > 0)
    other = scripted(river(llama("eager" if attn == "sdpa" else "sdpa"), "kv-mask"), [1, 2, None])
    assert torch.equal(generate(other, ids(), 4)[0], out)


def test_kv_mask_sliding_window_layers_follow_their_window():
    """Gemma3 (sliding window 8, layers sliding/full/sliding/full), exits past the window, against
    an independent reference: the plain model (eager) over the whole sequence in one pass, each
    layer's attention mask replaced by one built here from the exit script alone: causal, the
    window on sliding layers (q - 8 < k <= q), and no key at a position whose pass exited before
    that layer. The positions whose pass ran every layer must then predict River's next token, and
    every layer's cache slot (the sliding ones: their last window - 1 positions) must hold the
    reference K/V at every present position. River with sdpa (it builds the mask) and with eager
    (it narrows the model's additive one) both."""
    from test_river_core import tiny_config

    script = [1, 3, 1, None, 2, None, None]  # exit after this many layers, per decode pass
    prompt, new, num_layers = 12, 8, 4
    cfg = tiny_config("gemma3")
    window = cfg.sliding_window
    total = prompt + len(script)  # positions fed; the last new token is never fed
    exit_after = {prompt + n: e for n, e in enumerate(script) if e is not None}  # position -> exit layer
    absent = torch.zeros(num_layers, total, dtype=torch.bool)
    for p, e in exit_after.items():
        absent[e:, p] = True
    q = torch.arange(total)[:, None]
    k = torch.arange(total)[None, :]
    allowed = {}
    for j, kind in enumerate(cfg.layer_types):
        a = (k <= q) & ~absent[j][None, :]
        if kind == "sliding_attention":
            a &= k > q - window
        # a query whose own K/V is absent at j is never read again (absence only deepens): let it
        # see itself so no row is empty (an all -inf row would give NaN)
        allowed[j] = a | (absent[j][:, None] & (k == q))

    torch.manual_seed(0)
    ref_model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()

    def set_mask(j):
        def pre(module, args, kwargs):
            m = torch.zeros(1, 1, total, total).masked_fill(~allowed[j], torch.finfo(torch.float32).min)
            return args, {**kwargs, "attention_mask": m}
        return pre

    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
        model = scripted(river(base, "kv-mask"), script)
        out, cache = generate(model, ids(prompt), new)
        assert out.shape[1] == total + 1
        for j in range(num_layers):  # the marks River kept are the ones the script implies
            assert torch.equal(cache.river_absent.get(j, torch.zeros(1, total, dtype=torch.bool))[0], absent[j])
        handles = [layer.self_attn.register_forward_pre_hook(set_mask(j), with_kwargs=True)
                   for j, layer in enumerate(ref_model.model.layers)]
        ref_cache = DynamicCache(config=cfg)
        with torch.no_grad():
            logits = ref_model(out[:, :total], cache=ref_cache).logits[0]
        for h in handles:
            h.remove()
        full_depth = [prompt - 1] + [prompt + n for n, e in enumerate(script) if e is None]
        assert full_depth == [11, 15, 17, 18]
        assert logits[full_depth].argmax(-1).tolist() == out[0, [p + 1 for p in full_depth]].tolist()
        for j, (layer, want) in enumerate(zip(cache.layers, ref_cache.layers)):
            n = want.keys.shape[-2]
            assert n == (window - 1 if cfg.layer_types[j] == "sliding_attention" else total)
            present = ~absent[j, -n:]
            torch.testing.assert_close(layer.keys[0, :, -n:][:, present], want.keys[0][:, present], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(layer.values[0, :, -n:][:, present], want.values[0][:, present], rtol=1e-4, atol=1e-5)


def test_strategy_settings_and_refusals(tmp_path):
    base = tiny_model("llama")
    with pytest.raises(RiverError, match="strategy must be one of"):
        RiverConfig(strategy="calm")
    with pytest.raises(RiverError, match="needs strategy 'river'"):
        RiverConfig(strategy="kv-mask", lossless=True)
    assert RiverConfig.from_dict(RiverConfig(strategy="skipdecode").to_dict()).strategy == "skipdecode"
    model = river(base, "river")
    with pytest.raises(RiverError, match="unknown River strategy"):
        with model.river_strategy("nope"):
            pass
    with model.river_strategy("kv-mask"), model.river_mode("lossless"):
        with pytest.raises(RiverError, match="lossless mode drafts with River's exit layers"):
            model.generate(ids(), max_new_tokens=3, **GEN)
    with model.river_strategy("recompute"):
        with pytest.raises(RiverError, match="needs a dynamic KV cache"):
            model.generate(ids(), max_new_tokens=3, cache_implementation="static", river_tau=0.0, **GEN)
    model.set_river_strategy("state-propagation")
    assert model.river_config.strategy == "state-propagation" and model.river.strategy.name == "state-propagation"
    model.save_pretrained(tmp_path / "saved")
    from river_hf import RiverForCausalLM
    loaded = RiverForCausalLM.from_pretrained(str(tmp_path / "saved"), progress=False)
    assert loaded.river_config.strategy == "state-propagation" and loaded.river.strategy.name == "state-propagation"


def test_exit_mode_counts_the_exit_layers_bytes_whatever_strategy_is_set():
    """river_mode("exit") runs every layer's exit copy and the exit head; a baseline strategy set for
    route mode does not change what those passes read (it was counted as the baseline's bytes)."""
    base = tiny_model("llama")
    river = enable_river(copy.deepcopy(base), tau=0.9, backend="int4", progress=False)
    ids = torch.randint(3, 200, (1, 8))
    with river.river_mode("exit"):
        river.generate(ids, max_new_tokens=6, do_sample=False)
    assert river.river_stats["weight_bytes_per_token"] == river.river_step_bytes(0, "river")
    for name in ("skipdecode", "recompute", "kv-mask", "state-propagation"):
        with river.river_strategy(name), river.river_mode("exit"):
            river.generate(ids, max_new_tokens=6, do_sample=False)
        assert river.river_stats["weight_bytes_per_token"] == river.river_step_bytes(0, "river") != river.river_step_bytes(0, name)
