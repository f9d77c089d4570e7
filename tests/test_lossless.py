"""Lossless River (the exit path drafts, the backbone verifies, one cache), per-call state and
RiverCache.crop, on tiny random configs of every supported family.

The exit layers are 4-bit (``int4``: the first candidate kernel, tests do not autotune) and τ = -2
makes every draft leave the backbone after ``min_layer`` layers, so drafts are often wrong and
the verify/reject path is exercised; the tokens must still be the unmodified model's.
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from river_hf import RiverCache, RiverConfig, RiverError, enable_river
from test_river_core import FAMILIES, tiny_config, tiny_model

GEN = dict(do_sample=False)


def river_copy(model, tau=-2.0, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # negative tau warns by design
        return enable_river(copy.deepcopy(model), tau=tau, min_layer=kw.pop("min_layer", 2), backend=kw.pop("backend", "int4"),
                            progress=False, **kw)


def prompt(length=12, seed=1):
    torch.manual_seed(seed)
    return torch.randint(3, 256, (1, length))


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_greedy_equals_unmodified(family):
    base = tiny_model(family)
    river = river_copy(base)
    # Gemma3's sliding window is 8: a 20-token prompt and 40 new tokens run far past it
    for ids in (prompt(12), prompt(20, seed=2)):
        ref = base.generate(ids, max_new_tokens=40, **GEN)
        with river.river_mode("lossless"):
            out = river.generate(ids, max_new_tokens=40, **GEN)
        assert torch.equal(out, ref)
        s = river.river_stats
        assert s["mode"] == "lossless" and s["new_tokens"] == 40
        lossless = s["lossless"]
        assert lossless["rounds"] > 0 and lossless["drafted"] >= lossless["accepted"]
        assert 0.0 <= lossless["acceptance_rate"] <= 1.0
        assert s["mean_exit_layer"] == 2  # every draft pass left after min_layer=2 backbone layers


class _StopAtLength:
    """A custom stopping criterion (not max_length): fires once the sequence has ``n`` tokens."""

    def __init__(self, n):
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, dtype=torch.bool)


def test_lossless_stops_where_a_criterion_fires_inside_a_round():
    """transformers' assisted loop asks stopping criteria once per round; River asks them token by
    token (FirstStop) and cuts the output there, so it stops where the unmodified model does."""
    from transformers import StoppingCriteriaList

    base = tiny_model("qwen2")
    river = river_copy(base, backend="copy")  # every draft accepted: long rounds that jump past the stop
    ids = prompt(10)
    for stop_len in (13, 17, 18):
        crit = StoppingCriteriaList([_StopAtLength(stop_len)])
        ref = base.generate(ids, max_new_tokens=30, stopping_criteria=crit, **GEN)
        with river.river_mode("lossless"):
            out = river.generate(ids, max_new_tokens=30, stopping_criteria=StoppingCriteriaList([_StopAtLength(stop_len)]),
                                 return_dict_in_generate=True, output_scores=True, **GEN)
        assert ref.shape[1] == stop_len and torch.equal(out.sequences, ref)
        assert len(out.scores) == stop_len - ids.shape[1]
        assert river.river_stats["new_tokens"] == stop_len - ids.shape[1]


def test_lossless_rejects_some_drafts_and_stops_at_eos_inside_a_draft():
    base = tiny_model("llama")
    river = river_copy(base)
    ids = prompt(12)
    ref = base.generate(ids, max_new_tokens=40, **GEN)
    with river.river_mode("lossless"):
        river.generate(ids, max_new_tokens=40, **GEN)
    assert river.river_stats["lossless"]["acceptance_rate"] < 1.0
    # an EOS the unmodified model emits late in its answer, so it falls inside some draft
    new = ref[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 6 and t not in new[:i])
    ref_eos = base.generate(ids, max_new_tokens=40, eos_token_id=eos, pad_token_id=0, **GEN)
    with river.river_mode("lossless"):
        out = river.generate(ids, max_new_tokens=40, eos_token_id=eos, pad_token_id=0, **GEN)
    assert torch.equal(out, ref_eos) and out[0, -1] == eos


def test_lossless_with_exact_drafts_accepts_everything():
    """``copy`` exit layers equal the backbone: every draft must be accepted."""
    base = tiny_model("qwen2")
    river = river_copy(base, backend="copy")
    ids = prompt(10)
    ref = base.generate(ids, max_new_tokens=24, **GEN)
    with river.river_mode("lossless"):
        out = river.generate(ids, max_new_tokens=24, **GEN)
    assert torch.equal(out, ref)
    assert river.river_stats["lossless"]["acceptance_rate"] == 1.0


def test_lossless_batch_falls_back_to_the_backbone_and_warns():
    base = tiny_model("llama")
    river = river_copy(base)
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (2, 10))
    ref = base.generate(ids, max_new_tokens=12, pad_token_id=0, **GEN)
    with river.river_mode("lossless"), pytest.warns(UserWarning, match="one sequence at a time"):
        out = river.generate(ids, max_new_tokens=12, pad_token_id=0, **GEN)
    assert torch.equal(out, ref)
    stats = river.river_stats
    assert stats["exit_fraction"] == 0.0 and "lossless" not in stats and stats["mode"] == "backbone"
    with river.river_mode("lossless"), pytest.warns(UserWarning, match="num_beams=2"):  # another reason warns again
        river.generate(ids[:1], max_new_tokens=4, num_beams=2, **GEN)


def test_lossless_refuses_another_drafter():
    base = tiny_model("llama")
    river = river_copy(base)
    with river.river_mode("lossless"), pytest.raises(RiverError, match="assistant_model"):
        river.generate(prompt(), max_new_tokens=4, assistant_model=base, **GEN)
    from transformers import GenerationConfig
    with river.river_mode("lossless"), pytest.raises(RiverError, match="prompt_lookup_num_tokens"):
        river.generate(prompt(), generation_config=GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=3))


def test_lossless_from_the_config_round_trips(tmp_path):
    base = tiny_model("llama")
    river = river_copy(base, config=RiverConfig(lossless=True, draft_tokens=3, draft_schedule="constant"))
    assert river.river.mode == "lossless"
    ids = prompt()
    ref = base.generate(ids, max_new_tokens=20, **GEN)
    out = river.generate(ids, max_new_tokens=20, **GEN)
    assert torch.equal(out, ref) and river.river_stats["mode"] == "lossless"
    assert max(1, river.river_stats["lossless"]["drafts_per_verify"]) <= 3  # constant schedule: k stays 3
    with river.river_mode("route"):
        river.generate(ids, max_new_tokens=5, **GEN)
    assert river.river_stats["mode"] == "route"
    d = river.river_config.to_dict()
    assert RiverConfig.from_dict(d).lossless is True and RiverConfig.from_dict(d).draft_tokens == 3
    with pytest.raises(RiverError, match="draft_tokens"):
        RiverConfig(draft_tokens=0)
    with pytest.raises(RiverError, match="draft_schedule"):
        RiverConfig(draft_schedule="sometimes")


def test_lossless_verify_kernels_give_the_same_tokens():
    base = tiny_model("llama")
    ids = prompt()
    ref = base.generate(ids, max_new_tokens=30, **GEN)
    for kernel in ("torch", "onednn"):
        river = river_copy(base, config=RiverConfig(lossless=True, verify_kernel=kernel))
        assert torch.equal(river.generate(ids, max_new_tokens=30, **GEN), ref)


def test_lossless_with_prompt_lookup_rounds_equals_unmodified():
    base = tiny_model("llama")
    river = river_copy(base, config=RiverConfig(lossless=True, prompt_lookup_tokens=5))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # the last 2-gram occurred before: lookup proposes 7, 8, ...
    ref = base.generate(ids, max_new_tokens=30, **GEN)
    out = river.generate(ids, max_new_tokens=30, **GEN)
    assert torch.equal(out, ref)
    ll = river.river_stats["lossless"]
    assert ll["lookup_rounds"] > 0 and ll["lookup_drafted"] > 0
    with pytest.raises(RiverError, match="prompt_lookup_tokens"):
        RiverConfig(prompt_lookup_tokens=-1)


# -- sampling -----------------------------------------------------------------------------------


def _chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; categories with expected count < 5 are pooled."""
    n = observed.sum()
    expected = expected_p * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat.double() / 2))


def test_lossless_sampling_matches_the_unmodified_distribution():
    """The second new token is the first one a verify round decides (the first comes from the
    prefill). Its exact marginal under the unmodified model, sum_t1 p(t1) p(t2 | t1), is computed
    from the backbone; 1500 lossless samples must fit it. False-alarm rate of the test: 0.1 %
    (reject when the chi-square p-value < 1e-3)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=12, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    base = AutoModelForCausalLM.from_config(config).eval()
    base.generation_config.pad_token_id = 0
    base.generation_config.eos_token_id = None  # every sample runs its full length
    river = river_copy(base)
    ids = torch.tensor([[3, 5, 7, 4]])
    temperature = 3.0  # random tiny logits are flat-ish; a high temperature keeps every token likely
    with torch.no_grad():
        p1 = torch.softmax(base(ids).logits[0, -1] / temperature, -1)
        nxt = torch.cat([ids.repeat(12, 1), torch.arange(12)[:, None]], 1)
        p2 = torch.softmax(base(nxt).logits[:, -1] / temperature, -1)
    marginal = (p1[:, None] * p2).sum(0).double()
    counts = torch.zeros(12, dtype=torch.float64)
    gen = dict(max_new_tokens=3, do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    accepted = drafted = 0
    torch.manual_seed(1)
    with river.river_mode("lossless"):
        for _ in range(1500):
            out = river.generate(ids, **gen)
            counts[out[0, ids.shape[1] + 1]] += 1
            accepted += river.river_stats["lossless"]["accepted"]
            drafted += river.river_stats["lossless"]["drafted"]
    assert 0 < accepted < drafted, "both acceptance and rejection must occur"
    assert _chi2_pvalue(counts, marginal) > 1e-3


def test_lossless_sampling_is_reproducible_with_a_seed():
    base = tiny_model("qwen2")
    river = river_copy(base)
    gen = dict(max_new_tokens=20, do_sample=True, temperature=1.5)
    outs = []
    with river.river_mode("lossless"):
        for _ in range(2):
            torch.manual_seed(123)
            outs.append(river.generate(prompt(), **gen))
    assert torch.equal(outs[0], outs[1])


# -- River as another model's assistant, per-call state, the cache -------------------------------


def test_river_as_assistant_model_of_another_model():
    base = tiny_model("llama")
    main = copy.deepcopy(base)
    river = river_copy(base, tau=0.5, min_layer=1)
    ids = prompt()
    ref = main.generate(ids, max_new_tokens=24, **GEN)
    out = main.generate(ids, max_new_tokens=24, assistant_model=river, **GEN)
    assert torch.equal(out, ref)
    stats = river.river_stats  # the assistant's last call: tokens it drafted, not forward passes
    assert stats["new_tokens"] >= 1 and stats["new_tokens"] == stats["forward_passes"] + 1


def test_two_threads_get_the_tokens_they_get_alone():
    base = tiny_model("qwen2")
    river = river_copy(base)
    jobs = {"route": (prompt(12, seed=4), "route"), "backbone": (prompt(12, seed=5), "backbone"),
            "lossless": (prompt(12, seed=6), "lossless")}

    def run(ids, mode):
        with river.river_mode(mode):
            return river.generate(ids, max_new_tokens=24, **GEN)

    alone = {name: run(*job) for name, job in jobs.items()}
    assert not torch.equal(alone["route"], base.generate(jobs["route"][0], max_new_tokens=24, **GEN)), \
        "route mode must differ from the backbone for the test to see leaks"
    results: dict = {}
    barrier = threading.Barrier(len(jobs))

    def worker(name):
        barrier.wait()
        results[name] = [run(*jobs[name]) for _ in range(3)]

    threads = [threading.Thread(target=worker, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in jobs:
        assert all(torch.equal(r, alone[name]) for r in results[name]), name


def test_forward_outside_generate_keeps_no_log():
    base = tiny_model("llama")
    river = river_copy(base)
    ids = prompt()
    for _ in range(5):
        river(ids)
    assert river.river._local.log is None
    with river.river.recording() as log:
        river(ids)
        river(ids)
    assert len(log) == 2 and river.river._local.log is None


def test_river_cache_crop_follows_transformers():
    base = tiny_model("gemma3")  # sliding-window layers too
    river = river_copy(base)
    cache = RiverCache(config=river.config)
    cache.activate_past_recording()  # sliding-window layers past their window can then roll back
    ids = prompt(12)
    river(ids, cache=cache, use_cache=True)  # 12 tokens, one step
    for t in range(3):  # three one-token steps
        river(ids[:, t : t + 1], cache=cache, use_cache=True)
    river(ids[:, :4], cache=cache, use_cache=True)  # a 4-token step (a verify pass)
    assert sum(cache.step_tokens) == cache.get_seq_length() == 19
    cache.crop(0)
    assert sum(cache.step_tokens) == 19 and len(cache.exit_layers) == 5
    cache.crop(-3)  # cuts into the 4-token step
    assert cache.get_seq_length() == 16 and cache.step_tokens == [12, 1, 1, 1, 1]
    cache.crop(-2)
    assert cache.get_seq_length() == 14 and cache.step_tokens == [12, 1, 1]
    assert len(cache.exit_layers) == len(cache.step_tokens)
    with pytest.raises(ValueError, match="positive"):
        cache.crop(5)
