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

from river_hf import RiverCache, RiverError, enable_river
from river_hf.river import ExitRuleList, MinLayerRule, StateTransitionSimilarityRule, state_transition_similarity

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
