"""River routing on tiny random configs of every supported family (architecture coverage).

The first test of every change: τ > 1 reproduces the unmodified model token for token, single and
batched with left padding. With the ``copy`` backend the exit layers equal the backbone layers, so
even a model that exits at every step must reproduce the unmodified tokens: that checks routing and
KV share without any quantization error in the way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, MistralConfig, Qwen2Config
from transformers import Gemma3TextConfig

from river_hf import RiverCache, RiverError, RiverForCausalLM, disable_river, enable_river
from river_hf.river import ExitRule, ExitRuleList, MinLayerRule, StateTransitionSimilarityRule
from river_hf.river import state_transition_similarity

COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_config(family: str):
    if family == "llama":
        return LlamaConfig(**COMMON)
    if family == "qwen2":
        return Qwen2Config(**COMMON)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=None)
    if family == "gemma3":
        # sliding window 8 < prompt length: exercises the sliding-window cache layers
        return Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=8, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    raise ValueError(family)


FAMILIES = ["llama", "qwen2", "mistral", "gemma3"]


def tiny_model(family: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    model.generation_config.pad_token_id = 0
    return model


def batch_inputs():
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (2, 12))
    mask = torch.ones_like(ids)
    ids[1, :5] = 0  # left padding on the second row
    mask[1, :5] = 0
    return {"input_ids": ids, "attention_mask": mask}


GEN = dict(max_new_tokens=10, do_sample=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
def test_tau_above_one_is_token_identical(family, batched):
    model = tiny_model(family)
    inputs = batch_inputs() if batched else {k: v[:1] for k, v in batch_inputs().items()}
    ref = model.generate(**inputs, **GEN)
    enable_river(model, tau=2.0, progress=False)
    out = model.generate(**inputs, **GEN)
    assert torch.equal(out, ref)
    assert model.river_stats["exit_fraction"] == 0.0
    assert model.river_stats["mean_exit_layer"] == model.river.num_layers


@pytest.mark.filterwarnings("ignore:tau=-2 is negative")
@pytest.mark.parametrize("family", FAMILIES)
def test_exiting_through_identical_copies_is_token_identical(family):
    """Exit at every step (τ = -2) through unquantized copies: routing + KV share change nothing."""
    model = tiny_model(family)
    inputs = batch_inputs()
    ref = model.generate(**inputs, **GEN)
    enable_river(model, tau=-2.0, min_layer=1, backend="copy", progress=False)
    out = model.generate(**inputs, **GEN)
    assert torch.equal(out, ref)
    stats = model.river_stats
    assert stats["exit_fraction"] == 1.0 and stats["mean_exit_layer"] == 1.0
    assert stats["prefill_exit_layer"] == 1


@pytest.mark.filterwarnings("ignore:tau=-2 is negative")
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_exit_layers_share_the_kv_cache(family):
    from transformers import DynamicCache

    inputs = batch_inputs()
    ref_cache = DynamicCache(config=tiny_config(family))
    tiny_model(family).generate(**inputs, **GEN, cache=ref_cache)
    model = enable_river(tiny_model(family), tau=-2.0, min_layer=2, progress=False)
    cache = RiverCache(config=model.config)
    model.generate(**inputs, **GEN, cache=cache)
    L = model.river.num_layers
    for i, (layer, ref) in enumerate(zip(cache.layers, ref_cache.layers)):
        # every slot holds KV for the same positions as the unmodified model's, whichever path served it
        assert layer.keys.shape == ref.keys.shape, f"layer {i} misses KV entries"
        assert layer.values.shape == ref.values.shape
    served = cache.served_by_exit(L)
    assert served.shape == (GEN["max_new_tokens"], L)
    assert not served[:, :2].any() and served[:, 2:].all()
    assert cache.step_tokens[0] == inputs["input_ids"].shape[1]


@pytest.mark.filterwarnings("ignore:tau=-2 is negative")
def test_river_stats_and_return_dict():
    model = enable_river(tiny_model("llama"), tau=-2.0, min_layer=3, progress=False)
    inputs = {k: v[:1] for k, v in batch_inputs().items()}
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    assert out.sequences.shape[1] == inputs["input_ids"].shape[1] + 6
    s = model.river_stats
    assert s["decode_steps"] == 5 and s["new_tokens"] == 6
    assert s["exit_layer_counts"][3] == 5 and sum(s["exit_layer_counts"]) == 5
    assert s["tokens_per_s"] > 0 and s["weight_bytes_per_token"] > 0 and s["bandwidth_gb_s"] > 0


def test_sampling_with_tau_above_one_matches_unmodified_sampling():
    model = tiny_model("qwen2")
    inputs = {k: v[:1] for k, v in batch_inputs().items()}
    torch.manual_seed(7)
    ref = model.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=20)
    enable_river(model, tau=1.5, progress=False)
    torch.manual_seed(7)
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=True, top_k=20), ref)


@pytest.mark.filterwarnings("ignore:tau=-2 is negative")
def test_modes_and_set_tau():
    model = enable_river(tiny_model("llama"), tau=2.0, progress=False)
    inputs = {k: v[:1] for k, v in batch_inputs().items()}
    with model.river_mode("exit"):
        model.generate(**inputs, **GEN)
    assert model.river_stats["mean_exit_layer"] == 0
    model.set_river_tau(-2.0)
    model.generate(**inputs, **GEN)
    assert model.river_stats["exit_fraction"] == 1.0
    with model.river_mode("backbone"):
        model.generate(**inputs, **GEN)
    assert model.river_stats["exit_fraction"] == 0.0
    with pytest.raises(ValueError):
        with model.river_mode("sideways"):
            pass
    with model.river_mode("exit") as same, model.river_strategy("recompute") as also:
        assert same is model and also is model
    # called without `with` it changes nothing; it says so instead of failing silently
    with pytest.warns(RuntimeWarning, match=r"river_mode\('lossless'\) acts only inside a `with` block"):
        model.river_mode("lossless")
        import gc
        gc.collect()
    with pytest.warns(RuntimeWarning, match="river_strategy"):
        assert "acts only in `with model.river_strategy('skipdecode')" in repr(model.river_strategy("skipdecode"))
        gc.collect()
    with pytest.raises(ValueError):  # an unknown mode is refused at the call, not only on entering
        model.river_mode("sideways")


def test_rules_compose_in_order():
    h = torch.randn(1, 3, 8)
    rules = ExitRuleList([MinLayerRule(3), StateTransitionSimilarityRule(-2.0)])
    assert rules(0, h, h, None) is False  # vetoed by the minimum layer
    assert rules(2, h, h, None) is True
    assert ExitRuleList([StateTransitionSimilarityRule(0.5)])(0, h, -h, None) is False
    assert ExitRuleList()(0, h, h, None) is False  # nobody decides: stay


def test_similarity_ignores_padding_positions():
    h_in = torch.ones(1, 3, 4)
    h_out = h_in.clone()
    h_out[0, 0] = -1.0  # a padding position pointing the other way
    mask = torch.tensor([[False, True, True]])
    assert state_transition_similarity(h_in, h_out) == pytest.approx(-1.0)
    assert state_transition_similarity(h_in, h_out, mask) == pytest.approx(1.0)


def test_bad_input_errors():
    with pytest.raises(RiverError, match="tau must be a number"):
        enable_river(tiny_model("llama"), tau="fast", progress=False)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128))
    with pytest.raises(RiverError, match="not supported"):
        enable_river(gpt2, tau=0.9, progress=False)
    model = enable_river(tiny_model("llama"), tau=0.9, progress=False)
    with pytest.raises(RiverError, match="already enabled"):
        enable_river(model, tau=0.9)
    with pytest.raises(RiverError, match="backend"):
        enable_river(tiny_model("llama"), tau=0.9, backend="int3", progress=False)


def test_original_layers_are_kept_as_backbone():
    model = tiny_model("llama")
    before = copy.deepcopy(model.model.layers[1].state_dict())
    enable_river(model, tau=0.9, progress=False)
    after = model.model.layers[1].backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.model.layers[1].exit_layer.self_attn.layer_idx == 1


# -- issue 14: behave like transformers ---------------------------------------------------------

NEGATIVE_TAU = "ignore:tau=-2 is negative"  # τ = -2 forces an exit at every step on purpose


@pytest.mark.filterwarnings(NEGATIVE_TAU)
def test_tau_per_call_leaves_the_model_tau_alone():
    from transformers import GenerationConfig

    model = enable_river(tiny_model("llama"), tau=2.0, min_layer=2, progress=False)
    rules = model.river.rules
    inputs = batch_inputs()
    model.generate(**inputs, **GEN, river_tau=-2.0)
    assert model.river_stats["exit_fraction"] == 1.0 and model.river_stats["mean_exit_layer"] == 2
    assert model.river.rules is rules and model.river_config.tau == 2.0
    model.generate(**inputs, **GEN)
    assert model.river_stats["exit_fraction"] == 0.0
    # as a GenerationConfig attribute (the way transformers takes assistant_early_exit)
    model.generate(**inputs, generation_config=GenerationConfig(river_tau=-2.0, pad_token_id=0, **GEN))
    assert model.river_stats["exit_fraction"] == 1.0
    model.generation_config.river_tau = -2.0  # the model's own generation defaults
    model.generate(**inputs, **GEN)
    assert model.river_stats["exit_fraction"] == 1.0
    model.generate(**inputs, **GEN, river_tau=2.0)  # the call's argument wins
    assert model.river_stats["exit_fraction"] == 0.0
    assert model.river.rules is rules and model.river_config.tau == 2.0
    with pytest.raises(RiverError, match="tau must be a number"):
        model.generate(**inputs, **GEN, river_tau="fast")
    assert model.river.rules is rules


@pytest.mark.filterwarnings(NEGATIVE_TAU)
def test_set_river_tau_replaces_only_the_similarity_threshold():
    model = enable_river(tiny_model("llama"), rules=[MinLayerRule(3), StateTransitionSimilarityRule(2.0)],
                         progress=False)
    model.set_river_tau(-2.0)
    assert [type(r).__name__ for r in model.river.rules] == ["MinLayerRule", "StateTransitionSimilarityRule"]
    assert model.river.rules[0].min_layer == 3 and model.river.rules[1].tau == -2.0
    assert model.river_config.tau == -2.0 and model.river_config.rules[1]["tau"] == -2.0
    model.generate(**batch_inputs(), **GEN)
    assert model.river_stats["exit_fraction"] == 1.0 and model.river_stats["mean_exit_layer"] == 3  # min_layer kept


def test_tau_without_a_similarity_rule_is_refused():
    model = enable_river(tiny_model("llama"), rules=[MinLayerRule(2)], progress=False)
    with pytest.raises(RiverError, match="no StateTransitionSimilarityRule"):
        model.set_river_tau(0.5)
    with pytest.raises(RiverError, match="no StateTransitionSimilarityRule"):
        model.generate(**batch_inputs(), **GEN, river_tau=0.5)
    assert [type(r).__name__ for r in model.river.rules] == ["MinLayerRule"]


def test_negative_tau_warns_once():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = enable_river(tiny_model("llama"), tau=-0.5, min_layer=2, progress=False)
    assert [str(w.message) for w in caught if "negative" in str(w.message)] == [
        str(caught[0].message)], "one warning, no more"
    assert "after min_layer=2" in str(caught[0].message) and caught[0].filename == __file__
    with pytest.warns(UserWarning, match="tau=-2 is negative"):
        model.set_river_tau(-2.0)


def test_min_layer_must_be_below_the_layer_count():
    with pytest.raises(RiverError, match="has 4 decoder layers"):
        enable_river(tiny_model("llama"), tau=0.9, min_layer=4, progress=False)
    with pytest.raises(RiverError, match="has 4 decoder layers"):
        enable_river(tiny_model("llama"), rules=[MinLayerRule(7), StateTransitionSimilarityRule(0.9)], progress=False)
    assert enable_river(tiny_model("llama"), tau=0.9, min_layer=3, progress=False).river.num_layers == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_disable_river_gives_back_the_original_model(family):
    model = tiny_model(family)
    cls, head = type(model), model.get_output_embeddings()
    layers = list(model.model.layers)
    inputs = batch_inputs()
    ref = model.generate(**inputs, **GEN)
    assert enable_river(model, tau=0.3, min_layer=1, progress=False) is model
    model.generate(**inputs, **GEN)
    assert disable_river(model) is model
    assert type(model) is cls and not isinstance(model, RiverForCausalLM)
    assert all(a is b for a, b in zip(model.model.layers, layers)) and model.get_output_embeddings() is head
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks
    assert not hasattr(model, "river") and not hasattr(model, "river_config")
    assert torch.equal(model.generate(**inputs, **GEN), ref)
    with pytest.raises(RiverError, match="not enabled"):
        disable_river(model)
    enable_river(model, tau=2.0, progress=False)  # and it can be enabled again
    assert torch.equal(model.generate(**inputs, **GEN), ref)


def test_river_for_causal_lm_is_the_class_of_river_models():
    plain = tiny_model("qwen2")
    assert not isinstance(plain, RiverForCausalLM)
    model = enable_river(plain, tau=2.0, progress=False)
    assert isinstance(model, RiverForCausalLM) and isinstance(model, type(plain).__mro__[1])
    with pytest.raises(RiverError, match="not by calling the class"):
        type(model)(model.config)


@pytest.mark.parametrize("family", FAMILIES)
def test_from_config(family):
    torch.manual_seed(0)
    model = RiverForCausalLM.from_config(tiny_config(family), tau=2.0, min_layer=1, backend="copy", progress=False)
    assert isinstance(model, RiverForCausalLM) and not model.training
    assert type(model).__name__ == "River" + type(tiny_model(family)).__name__
    assert model.river_config.tau == 2.0 and model.river_config.backend == "copy"
    model.generation_config.pad_token_id = 0
    # same seed, same weights: the unmodified model's tokens
    assert torch.equal(model.generate(**batch_inputs(), **GEN), tiny_model(family).generate(**batch_inputs(), **GEN))


class _RecordingRule(ExitRule):
    """Records the token mask each decision sees; never decides."""

    def __init__(self):
        self.masks = []

    def __call__(self, layer_idx, hidden_in, hidden_out, token_mask):
        self.masks.append(None if token_mask is None else token_mask.clone())
        return None


@pytest.mark.filterwarnings(NEGATIVE_TAU)
@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_is_exact_and_masks_padding(family):
    inputs = batch_inputs()
    static = dict(GEN, cache_implementation="static")
    ref = tiny_model(family).generate(**inputs, **static)
    model = enable_river(tiny_model(family), tau=2.0, progress=False)
    assert torch.equal(model.generate(**inputs, **static), ref)
    copies = enable_river(tiny_model(family), tau=-2.0, min_layer=1, backend="copy", progress=False)
    with pytest.warns(UserWarning, match="negative"):
        pass_through = copies.generate(**inputs, **static, river_tau=-3.0)
    assert torch.equal(pass_through, ref) and copies.river_stats["exit_fraction"] == 1.0
    # the exit decision sees the padding of the prompt pass although generate hands the decoder a 4-D mask
    recorder = _RecordingRule()
    model.river.rules = ExitRuleList([recorder, StateTransitionSimilarityRule(2.0)])
    model.generate(**inputs, **static)
    prefill_mask = recorder.masks[0]
    assert prefill_mask is not None and torch.equal(prefill_mask, inputs["attention_mask"].bool())
    assert recorder.masks[-1] is None  # decode steps: every new token is real


def test_torch_compile_is_refused():
    from transformers import CompileConfig

    model = enable_river(tiny_model("llama"), tau=2.0, progress=False)
    inputs = batch_inputs()
    with pytest.raises(RiverError, match="cannot be compiled"):
        torch.compile(model, backend="eager")(**inputs)
    with pytest.raises(RiverError, match="cannot be compiled"):
        model.generate(**inputs, **GEN, cache_implementation="static", compile_config=CompileConfig(backend="eager"))
    assert model(**inputs).logits.shape == (2, 12, 256)  # uncompiled, it still runs


def test_one_checked_settings_path_for_every_entry_point(tmp_path):
    """from_pretrained, from_config and enable_river take River's settings through one checked path
    (river.config.river_settings): each takes every setting by name, an unknown keyword of enable_river
    is one RiverError naming the settings, and offloading is refused outside from_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from river_hf import RiverError, RiverForCausalLM, enable_river
    from river_hf.river.config import RIVER_SETTINGS

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1)
    settings = dict(tau=0.7, min_layer=1, backend="copy", exit_head="copy", prefill="backbone", lossless=True,
                    strategy="river", prompt_kernel=False, exit_layer_impl="auto", backbone_kernel="torch",
                    backbone_grid="off")
    assert set(settings) | {"offload_from", "offload_dir"} == set(RIVER_SETTINGS)
    built = RiverForCausalLM.from_config(config, progress=False, **settings)
    plain = LlamaForCausalLM(config).eval()
    plain.save_pretrained(tmp_path / "plain")
    loaded = RiverForCausalLM.from_pretrained(tmp_path / "plain", progress=False, **settings)
    enabled = enable_river(LlamaForCausalLM(config).eval(), progress=False, **settings)
    for model in (built, loaded, enabled):
        c = model.river_config
        assert (c.tau, c.min_layer, c.backend, c.exit_head, c.prefill, c.lossless) == (0.7, 1, "copy", "copy", "backbone",
                                                                                      True)
        assert c.backbone_kernel == "torch"
    with pytest.raises(RiverError, match="unknown keyword argument.*taus"):
        enable_river(LlamaForCausalLM(config).eval(), taus=0.9, progress=False)
    with pytest.raises(RiverError, match="offload_from"):
        RiverForCausalLM.from_config(config, offload_from=1, progress=False)
