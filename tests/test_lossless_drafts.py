"""Lossless drafts (issue 23): the draft-path setting, the frequent-vocabulary draft head (FR-Spec),
the adaptive prompt-lookup rule and the costs in backbone steps. Every setting must still give the
unmodified model's tokens; tiny random configs, plus SmolLM2 for the real tokenizer's frequencies."""

from __future__ import annotations

import pytest
import torch

from river_hf import RiverConfig, RiverError
from river_hf.river.draft_vocab import FrequentVocabHead, draft_head_for, frequent_token_ids, token_counts
from river_hf.river.lossless import LookupGate
from test_lossless import GEN, prompt, river_copy
from test_river_core import FAMILIES, tiny_model


class ByteTokenizer:
    """Enough of a tokenizer for the frequency count: one id per byte of UTF-8 (vocab 256), ids 0-2 special."""

    all_special_ids = [0, 1, 2]
    added_tokens_decoder: dict = {}

    def __len__(self):
        return 256

    def get_vocab(self):
        return {f"<{i}>": i for i in range(256)}

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(t.encode("utf-8")) for t in texts]}


@pytest.fixture(scope="module")
def freq_cache(tmp_path_factory):
    """One cache folder for this module's frequency counts (counted once, then read)."""
    path = tmp_path_factory.mktemp("river_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIVER_HF_CACHE", str(path))
        yield path


def test_frequent_ids_are_the_most_frequent_plus_specials_aligned_to_128(freq_cache):
    tok = ByteTokenizer()
    counts = token_counts(tok)
    assert counts.sum() > 100_000  # the standard library's sources were counted
    assert list(freq_cache.glob("token_freq/*.json"))  # and cached, written by rename
    again = token_counts(tok)
    assert torch.equal(counts, again)
    ids = frequent_token_ids(tok, 20)
    assert ids.numel() == 128 and torch.equal(ids, torch.unique(ids))
    assert {0, 1, 2} <= set(ids.tolist())
    top = torch.sort(counts, descending=True, stable=True).indices[:20]
    assert set(top.tolist()) <= set(ids.tolist())
    assert ord(" ") in ids.tolist() and ord("e") in ids.tolist()  # the commonest bytes of code and prose
    with pytest.raises(RiverError, match="draft_vocab"):
        frequent_token_ids(tok, 0)


def test_frequent_vocab_head_scores_its_rows_and_minus_inf_elsewhere():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    ids = torch.tensor([0, 5, 7, 299])
    draft = FrequentVocabHead(head, ids)
    x = torch.randn(1, 2, 16)
    out = draft(x)
    full = head(x)
    assert out.shape == (1, 2, 300) and out.dtype == torch.float32
    assert torch.allclose(out[..., ids], full[..., ids])
    rest = torch.ones(300, dtype=torch.bool)
    rest[ids] = False
    assert torch.isinf(out[..., rest]).all() and (out[..., rest] < 0).all()


SETTINGS = [
    dict(draft_path="exit"),
    dict(draft_tau=0.0, draft_min_layer=1),
    dict(draft_vocab=100),
    dict(draft_path="exit", draft_vocab=100),
    dict(prompt_lookup_tokens=5, prompt_lookup_rule="adaptive"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_every_draft_setting_gives_the_unmodified_tokens(family, settings, freq_cache):
    base = tiny_model(family)
    river = river_copy(base, config=RiverConfig(lossless=True, **settings))
    if settings.get("draft_vocab"):
        draft_head_for(river, settings["draft_vocab"], ByteTokenizer())  # a tiny config has no tokenizer of its own
    for ids in (prompt(12), torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]])):
        ref = base.generate(ids, max_new_tokens=30, **GEN)
        out = river.generate(ids, max_new_tokens=30, **GEN)
        assert torch.equal(out, ref)
    ll = river.river_stats["lossless"]
    assert ll["draft_path"] == settings.get("draft_path", "route")
    rc = river.river_config  # the draft settings the call ran with, as a user reads them back
    assert (ll["draft_schedule"], ll["draft_tokens"], ll["max_draft_tokens"]) == (
        rc.draft_schedule, rc.draft_tokens, rc.max_draft_tokens)
    if settings.get("draft_vocab"):
        assert ll["draft_vocab"] == 128
    if settings.get("draft_path") == "exit":
        assert ll["mean_draft_exit_layer"] in (0, None)  # no backbone layer in a draft pass
    if settings.get("draft_min_layer") == 1:
        assert ll["mean_draft_exit_layer"] == 1  # τ 0 exits right after the first backbone layer


def test_draft_vocab_without_a_tokenizer_is_one_clear_error():
    river = river_copy(tiny_model("llama"), config=RiverConfig(lossless=True, draft_vocab=64))
    with pytest.raises(RiverError, match="needs the model's tokenizer"):
        river.generate(prompt(8), max_new_tokens=4, **GEN)


def test_lossless_stats_give_costs_in_backbone_steps_and_acceptance_per_source():
    base = tiny_model("qwen2")
    river = river_copy(base, config=RiverConfig(lossless=True, prompt_lookup_tokens=4))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10]])
    river.generate(ids, max_new_tokens=30, **GEN)
    ll = river.river_stats["lossless"]
    assert ll["backbone_step_seconds"] > 0
    assert ll["draft_cost_steps"] > 0 and ll["verify_cost_steps"] > 0
    src = ll["by_source"]
    assert src["exit_path"]["rounds"] == ll["rounds"] and src["prompt_lookup"]["rounds"] == ll["lookup_rounds"]
    assert ll["lookup_rounds"] > 0 and src["prompt_lookup"]["verify_cost_steps"] > 0
    for s in src.values():
        if s["drafted"]:
            assert s["acceptance_rate"] == s["accepted"] / s["drafted"]
            assert s["tokens_per_verify"] == (s["accepted"] + s["rounds"]) / s["rounds"]


def test_lookup_gate_declines_lookup_while_it_is_slower_and_retries():
    gate = LookupGate("adaptive")
    assert gate.use()  # no exit-path round timed yet
    gate.update("exit", 8, 1.0)  # 8 tokens per second from exit-path rounds
    for _ in range(LookupGate.WARMUP):
        assert gate.use()  # warm-up rounds are always proposed
        gate.update("lookup", 1, 1.0)  # 1 token per second: much slower
    decisions = [gate.use() for _ in range(LookupGate.RETRY)]
    assert decisions == [False] * (LookupGate.RETRY - 1) + [True]  # declined, then one retry
    assert gate.declined == LookupGate.RETRY - 1
    for _ in range(5):
        gate.update("lookup", 40, 1.0)  # lookup became faster (a stretch that repeats its context)
    assert gate.use()
    always = LookupGate("always")
    always.update("exit", 8, 1.0)
    always.update("lookup", 0, 100.0)
    assert all(always.use() for _ in range(20))
    with pytest.raises(RiverError, match="prompt_lookup_rule"):
        LookupGate("sometimes")


@pytest.mark.parametrize("bad, match", [
    (dict(draft_path="backbone"), "draft_path"), (dict(draft_tau="x"), "tau"), (dict(draft_min_layer=0), "draft_min_layer"),
    (dict(draft_vocab=-1), "draft_vocab"), (dict(draft_vocab=True), "draft_vocab"),
    (dict(prompt_lookup_rule="never"), "prompt_lookup_rule")])
def test_bad_draft_settings_are_refused(bad, match):
    with pytest.raises(RiverError, match=match):
        RiverConfig(**bad)


def test_draft_settings_round_trip():
    config = RiverConfig(draft_path="exit", draft_tau=0.5, draft_min_layer=3, draft_vocab=32768,
                         prompt_lookup_tokens=10, prompt_lookup_rule="adaptive")
    again = RiverConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    rules = again.build_draft_rules()
    assert rules.to_list() == RiverConfig(min_layer=3, tau=0.5).build_rules().to_list()
    assert RiverConfig().build_draft_rules() is None


@pytest.mark.real_model
def test_smollm2_frequent_vocab_drafts_give_the_plain_models_tokens(smollm2_path):
    """The real tokenizer (loaded from the model's folder) and its frequencies: the plain model's
    tokens, a head of 8192 ids plus specials (aligned to 128), and nearly every token the model
    writes for a coding request lies in that set (FR-Spec's premise)."""
    from transformers import AutoTokenizer

    import dataclasses

    from river_hf import RiverForCausalLM, plain_model
    from river_hf.river.config import default_config

    config = dataclasses.replace(default_config(smollm2_path), draft_vocab=8192, prompt_lookup_tokens=0)
    model = RiverForCausalLM.from_pretrained(smollm2_path, river_config=config, progress=False)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = plain_model(model).generate(ids, max_new_tokens=16, **GEN)
    with model.river_mode("lossless"):
        out = model.generate(ids, max_new_tokens=16, **GEN)
    assert torch.equal(out, ref)
    ll = model.river_stats["lossless"]
    assert ll["draft_vocab"] % 128 == 0 and 8192 <= ll["draft_vocab"] < 8192 + 256
    frequent = set(model._river_draft_heads[8192][0].ids.tolist())
    written = ref[0, ids.shape[1]:].tolist()
    assert sum(t in frequent for t in written) >= 0.9 * len(written)


def test_sampling_with_a_frequent_vocab_draft_head_matches_the_unmodified_distribution():
    """Speculative sampling stays exact when the drafts can only propose 8 of the 12 ids (q = 0 on
    the rest: those tokens come only from the residual norm(max(p - q, 0))): rounds of k = 3 drafts
    under temperature, top-k and top-p; the 3rd new token's marginal under the unmodified model
    (over all 12^2 prefixes) must fit 800 lossless samples (chi-square p > 1e-3)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from river_hf.quant.dense import WeightFingerprint
    from test_lossless import _chi2_pvalue, sampling_model

    base = sampling_model()
    river = river_copy(base, config=RiverConfig(draft_tokens=3, max_draft_tokens=3, draft_schedule="constant", draft_vocab=8))
    head = river.get_output_embeddings().backbone
    river._river_draft_heads = {8: (FrequentVocabHead(head, torch.arange(8)), WeightFingerprint(head.weight))}
    ids = torch.tensor([[3, 5, 7, 4]])
    temperature, top_k, top_p = 3.0, 10, 0.95
    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)])
    vocab = 12

    def next_p(prefixes):
        with torch.no_grad():
            logits = base(prefixes).logits[:, -1].float()
        return torch.softmax(warp(prefixes, logits), -1).double()

    p1 = next_p(ids)[0]
    p2 = next_p(torch.cat([ids.repeat(vocab, 1), torch.arange(vocab)[:, None]], 1))
    grid = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    p3 = next_p(torch.cat([ids.repeat(grid.shape[0], 1), grid], 1)).view(vocab, vocab, vocab)
    marginal3 = (p1[:, None, None] * p2[:, :, None] * p3).sum((0, 1))
    assert float(marginal3[8:].sum()) > 0.05  # the ids the drafts cannot propose do occur
    counts = torch.zeros(vocab, dtype=torch.float64)
    gen = dict(max_new_tokens=5, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    accepted = drafted = 0
    torch.manual_seed(1)
    with river.river_mode("lossless"):
        for _ in range(800):
            out = river.generate(ids, **gen)
            counts[out[0, ids.shape[1] + 2]] += 1
            ll = river.river_stats["lossless"]
            accepted += ll["accepted"]
            drafted += ll["drafted"]
            assert ll["draft_vocab"] == 8
    assert 0 < accepted < drafted
    assert _chi2_pvalue(counts, marginal3) > 1e-3


def test_call_vocab_scores_the_calls_own_tokens_exactly_and_leaves_the_shared_set_alone():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    draft = FrequentVocabHead(head, torch.arange(128))
    call = draft.call_vocab()
    call.add(torch.tensor([[5, 200, 201, 200]]))  # 200 and 201 lie outside the frequent set
    assert sorted(call.ids.tolist()) == [200, 201]
    call.add(torch.tensor([[5, 200, 201, 200, 250, 7]]))  # only the part after the last call's length
    assert sorted(call.ids.tolist()) == [200, 201, 250]
    x = torch.randn(1, 1, 16)
    out = draft(x, call)
    assert torch.allclose(out[..., [200, 201, 250]], head(x)[..., [200, 201, 250]])
    assert torch.isinf(draft(x)[..., 200]).all()  # the shared head (another call) is unchanged
    assert int(draft.member.sum()) == 128
