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


def test_lossless_batch_with_a_history_dependent_setting_falls_back_to_the_backbone_and_warns():
    """(A batch without one drafts: tests/test_lossless_batch.py.)"""
    base = tiny_model("llama")
    river = river_copy(base)
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (2, 10))
    ref = base.generate(ids, max_new_tokens=12, pad_token_id=0, repetition_penalty=1.2, **GEN)
    with river.river_mode("lossless"), pytest.warns(UserWarning, match="cannot draft this call.*RepetitionPenalty"):
        out = river.generate(ids, max_new_tokens=12, pad_token_id=0, repetition_penalty=1.2, **GEN)
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
    from river_hf.quant.dense import onednn_available

    base = tiny_model("llama")
    ids = prompt()
    ref = base.generate(ids, max_new_tokens=30, **GEN)
    for kernel in ("torch", "onednn"):
        river = river_copy(base, config=RiverConfig(lossless=True, verify_kernel=kernel))
        assert torch.equal(river.generate(ids, max_new_tokens=30, **GEN), ref)
        info = river.river_stats["lossless"]["verify_kernel"]
        mode = river.__dict__.get("_river_verify_linear", (None,))[0]
        if kernel == "onednn" and onednn_available():
            # the packed kernel really ran the verify passes' backbone Linears, and says what it costs
            assert info["kernel"] == "onednn-prepacked" and mode and mode.calls_rerouted > 0
            assert info["packed_bytes"] == sum(m.weight.numel() * 4 for m in river.river_backbone_modules()
                                               if isinstance(m, torch.nn.Linear))
        else:
            assert info["kernel"] == "torch" and info["packed_bytes"] == 0 and not mode


def _other_weights(model, seed):
    torch.manual_seed(seed)
    other = AutoModelForCausalLM.from_config(model.config).eval()
    other.generation_config.pad_token_id = 0
    return other


@pytest.mark.parametrize("how", ["load_state_dict", "assign_data", "inplace_data"])
def test_lossless_after_a_weight_change_equals_the_plain_model_with_the_new_weights(how):
    """The verify kernel packs the backbone's weights once; a later change of the weights
    (load_state_dict, ``param.data = ...``, an in-place change through ``.data`` as PEFT's merge
    does, which the version counter does not see) must be verified with the new weights."""
    from river_hf.quant.dense import onednn_available

    if not onednn_available():
        pytest.skip("no oneDNN in this torch: nothing is packed")
    base = tiny_model("llama")
    river = river_copy(base, config=RiverConfig(lossless=True, verify_kernel="onednn"))
    ids = prompt()
    assert torch.equal(river.generate(ids, max_new_tokens=20, **GEN), base.generate(ids, max_new_tokens=20, **GEN))
    new = _other_weights(base, seed=7)
    target = river_hf_plain(river)
    with torch.no_grad():
        if how == "load_state_dict":
            target.load_state_dict(new.state_dict())
        else:
            for (name, p), q in zip(target.named_parameters(), new.parameters()):
                if how == "assign_data":
                    p.data = q.detach().clone()
                else:
                    p.data.copy_(q.detach())  # bypasses p's version counter
    ref = new.generate(ids, max_new_tokens=20, **GEN)
    assert not torch.equal(ref, base.generate(ids, max_new_tokens=20, **GEN))  # the change matters
    out = river.generate(ids, max_new_tokens=20, **GEN)
    assert torch.equal(out, ref)
    info = river.river_stats["lossless"]["verify_kernel"]
    assert info["kernel"] == "onednn-prepacked" and info["repacked"] > 0
    river.generate(ids, max_new_tokens=4, **GEN)
    assert river.river_stats["lossless"]["verify_kernel"]["repacked"] == 0  # nothing changed since


def river_hf_plain(river):
    from river_hf import plain_model

    return plain_model(river)


def test_plain_model_shares_the_backbone_weights_and_gives_the_unmodified_tokens():
    from river_hf import plain_model

    for family in FAMILIES:
        base = tiny_model(family)
        river = river_copy(base, tau=0.5)
        plain = plain_model(river)
        assert type(plain) is type(base)
        shared = {id(p) for p in river.parameters()}
        assert all(id(p) in shared for p in plain.parameters())  # the same tensors: no second copy
        ids = prompt(12)
        assert torch.equal(plain.generate(ids, max_new_tokens=12, **GEN), base.generate(ids, max_new_tokens=12, **GEN))
    with pytest.raises(RiverError, match="River model"):
        plain_model(base)


def test_verify_kernel_packs_only_what_fits_and_times_an_mlp_shape(monkeypatch, tmp_path):
    from river_hf.quant.dense import PrepackedLinear, onednn_available
    from river_hf.river import verify_kernel

    if not onednn_available():
        pytest.skip("no oneDNN in this torch")
    torch.manual_seed(0)  # a head (64x512) of another shape than the MLP's projections (64x96, 96x64)
    base = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).eval()
    base.generation_config.pad_token_id = 0
    need = sum(m.weight.numel() * 4 for m in base.modules() if isinstance(m, torch.nn.Linear))
    # too little memory: nothing packed, for 'onednn' a warning, and the reason in river_stats
    monkeypatch.setattr(verify_kernel, "available_memory_bytes", lambda: need)
    river = river_copy(base, config=RiverConfig(lossless=True, verify_kernel="onednn"))
    with pytest.warns(UserWarning, match="needs .* GB, more than 50%"):
        river.generate(prompt(), max_new_tokens=8, **GEN)
    info = river.river_stats["lossless"]["verify_kernel"]
    assert info["kernel"] == "torch" and info["packed_bytes"] == 0 and "memory available" in info["why"]
    # enough memory, 'auto': one measurement on the most common backbone shape (the MLP's), not the head
    # (F.linear against oneDNN only: river-fp32's part of the choice is tests/test_river_fp32.py's)
    monkeypatch.setattr(verify_kernel, "river_fp32_works", lambda: False)
    monkeypatch.setattr(verify_kernel, "available_memory_bytes", lambda: 100 * need)
    timed = []
    prompt_winner = {"torch": 2.0, "onednn": 1.0}
    one_row_winner = {"torch": 2.0, "onednn": 1.0}
    monkeypatch.setattr(PrepackedLinear, "measure", staticmethod(
        lambda i, o, rows, **kw: timed.append((i, o, rows)) or dict(
            prompt_winner if rows == verify_kernel.PROMPT_TIMED_ROWS else one_row_winner if rows == 1
            else {"torch": 2.0, "onednn": 1.0})))
    monkeypatch.delenv("RIVER_HF_AUTOTUNE", raising=False)
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path))  # the one tuner's kernels.json, not the user's
    river = river_copy(base, config=RiverConfig(lossless=True, verify_kernel="auto"))
    ids = prompt(24)  # a prompt pass of more rows than any verify (max_draft_tokens + 1 = 16)
    assert torch.equal(river.generate(ids, max_new_tokens=8, **GEN), base.generate(ids, max_new_tokens=8, **GEN))
    head = base.get_output_embeddings()
    # the verify rows, then (oneDNN won there) the prompt rows and one row, on the same shape; never the head;
    # then the rows the cost schedule's verify cost curve adds
    assert [t[2] for t in timed] == [16, verify_kernel.PROMPT_TIMED_ROWS, 1, 8, 32, 64]
    assert timed[0][:2] != (head.in_features, head.out_features)
    shapes = [(m.in_features, m.out_features) for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert timed[0][:2] == timed[1][:2] == timed[2][:2] == max(set(shapes), key=lambda s: shapes.count(s) * s[0] * s[1]) == (64, 96)
    info = river.river_stats["lossless"]["verify_kernel"]
    assert info["kernel"] == "onednn-prepacked" and info["packed_bytes"] > 0 and info["shape"] == "%dx%d" % timed[0][:2]
    assert info["prompt"] == "onednn-prepacked" and info["prompt_timing_us"] == {"torch": 2.0, "onednn": 1.0}
    assert info["one_row"] == "onednn-prepacked" and info["one_row_timing_us"] == {"torch": 2.0, "onednn": 1.0}
    mode = river._river_verify_linear[0]
    assert mode.min_rows == 1  # the prompt pass's one-row LM head call goes to the copy too
    before = mode.calls_rerouted
    with river.river_mode("backbone"), mode:  # a 24-row pass goes through the packed copy
        river(ids)
    assert mode.calls_rerouted > before
    # the decisions are cached with the exit kernels' timings: another model of the same shapes measures nothing
    from river_hf.quant.autotune import read_cache

    dense = sorted(e.get("rows", 1) for e in read_cache(tmp_path / "kernels.json")[0].values()
                   if sorted(e["candidates"]) == ["onednn", "torch"])  # (beside the exit kernels' entries)
    assert dense == sorted(verify_kernel.COST_ROWS) == [1, 8, 16, 32, 64, verify_kernel.PROMPT_TIMED_ROWS]
    river_copy(base, config=RiverConfig(lossless=True, verify_kernel="auto")).generate(prompt(), max_new_tokens=8, **GEN)
    assert len(timed) == 6
    # where F.linear wins at the prompt's rows and at one row, those calls stay on it: only verify rows are rerouted
    prompt_winner = one_row_winner = {"torch": 1.0, "onednn": 2.0}
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "other"))
    river = river_copy(base, config=RiverConfig(lossless=True, verify_kernel="auto"))
    assert torch.equal(river.generate(ids, max_new_tokens=8, **GEN), base.generate(ids, max_new_tokens=8, **GEN))
    info = river.river_stats["lossless"]["verify_kernel"]
    assert info["kernel"] == "onednn-prepacked" and info["prompt"] == "torch" and info["one_row"] == "torch"
    assert river._river_verify_linear[0].max_rows == 16 and river._river_verify_linear[0].min_rows == 2


def test_draft_length_never_exceeds_max_draft_tokens(monkeypatch):
    """``copy`` exit layers: every draft accepted, so the heuristic schedule grows k by 2 per round;
    the cap holds it at max_draft_tokens (and the verify rows at max_draft_tokens + 1)."""
    from river_hf.river.lossless import ExitPathDrafter

    seen = []
    original = ExitPathDrafter.update_candidate_strategy

    def spy(self, input_ids, scores, num_matches):
        seen.append(self._drafted_now)
        return original(self, input_ids, scores, num_matches)

    monkeypatch.setattr(ExitPathDrafter, "update_candidate_strategy", spy)
    base = tiny_model("qwen2")
    base.generation_config.eos_token_id = None
    config = RiverConfig(lossless=True, draft_tokens=2, max_draft_tokens=5, draft_schedule="heuristic")
    river = river_copy(base, backend="copy", config=config)
    ids = prompt(10)
    out = river.generate(ids, max_new_tokens=40, **GEN)
    assert torch.equal(out, base.generate(ids, max_new_tokens=40, **GEN))
    assert max(seen) == 5 and seen.count(5) >= 3
    assert river.river_stats["lossless"]["verify_kernel"]["max_rows"] == 6
    with pytest.raises(RiverError, match="max_draft_tokens"):
        RiverConfig(draft_tokens=4, max_draft_tokens=3)


def test_lossless_decides_on_the_merged_generation_config():
    """num_beams / num_return_sequences set on the model's generation_config are in force for a call
    that passes its own GenerationConfig without them: the call must fall back to the backbone."""
    from transformers import GenerationConfig

    base = tiny_model("llama")
    river = river_copy(base, config=RiverConfig(lossless=True))
    river.generation_config.num_beams = 2
    base.generation_config.num_beams = 2
    ids = prompt()
    ref = base.generate(ids, generation_config=GenerationConfig(max_new_tokens=6, do_sample=False))
    with pytest.warns(UserWarning, match="num_beams=2"):
        out = river.generate(ids, generation_config=GenerationConfig(max_new_tokens=6, do_sample=False))
    assert torch.equal(out, ref) and river.river_stats["mode"] == "backbone"


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


def sampling_model():
    """A tiny random Llama with 12 token ids (seed 0) for the distribution tests: every token is
    likely enough to count, and without EOS every sample runs its full length."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=12, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    base = AutoModelForCausalLM.from_config(config).eval()
    base.generation_config.pad_token_id = 0
    base.generation_config.eos_token_id = None
    return base


def test_lossless_sampling_matches_the_unmodified_distribution():
    """The second new token is the first one a verify round decides (the first comes from the
    prefill). Its exact marginal under the unmodified model, sum_t1 p(t1) p(t2 | t1), is computed
    from the backbone; 1500 lossless samples must fit it. False-alarm rate of the test: 0.1 %
    (reject when the chi-square p-value < 1e-3). The same sampler, seeded, gives the same 20 tokens twice."""
    base = sampling_model()
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
    with river.river_mode("lossless"):  # and the samples of this distribution are reproducible with a seed
        again = []
        for _ in range(2):
            torch.manual_seed(123)
            again.append(river.generate(ids, **{**gen, "max_new_tokens": 20}))
    assert torch.equal(again[0], again[1])


def test_lossless_sampling_with_three_drafts_and_top_k_top_p_matches_the_unmodified_distribution():
    """Rounds of k = 3 exit-path drafts (constant schedule) under temperature, top-k and top-p: the
    first verify round decides new tokens 2..4, so the 3rd and 4th new tokens come from chains of
    accepted drafts, rejections and the residual distribution norm(max(p - q, 0)). Their exact
    marginals under the unmodified model with the same processors, sum over t1..t3 of
    p(t1) p(t2|t1) p(t3|t1 t2) [p(t4|t1 t2 t3)], are computed from the backbone over all 12^3
    prefixes; 800 lossless samples must fit each (chi-square, p-value > 1e-3 each)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    base = sampling_model()
    river = river_copy(base, config=RiverConfig(draft_tokens=3, max_draft_tokens=3, draft_schedule="constant"))
    ids = torch.tensor([[3, 5, 7, 4]])
    temperature, top_k, top_p = 3.0, 8, 0.9
    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)])
    vocab = base.config.vocab_size

    def next_p(prefixes):  # processed next-token distributions, float64 [n, vocab]
        with torch.no_grad():
            logits = base(prefixes).logits[:, -1].float()
        return torch.softmax(warp(prefixes, logits), -1).double()

    grid = torch.cartesian_prod(*[torch.arange(vocab)] * 3)  # all (t1, t2, t3)
    p1 = next_p(ids)[0]
    p2 = next_p(torch.cat([ids.repeat(vocab, 1), torch.arange(vocab)[:, None]], 1))  # [t1, t2]
    p3 = next_p(torch.cat([ids.repeat(vocab * vocab, 1), grid[::vocab, :2]], 1)).view(vocab, vocab, vocab)
    p4 = next_p(torch.cat([ids.repeat(grid.shape[0], 1), grid], 1)).view(vocab, vocab, vocab, vocab)
    joint3 = p1[:, None, None] * p2[:, :, None] * p3  # [t1, t2, t3]
    marginal3 = joint3.sum((0, 1))
    marginal4 = (joint3[..., None] * p4).sum((0, 1, 2))
    for dist in (p2, p3, p4):  # top-k really removes tokens at every step
        assert int((dist.reshape(-1, vocab) == 0).sum(-1).min()) >= vocab - top_k
    counts3 = torch.zeros(vocab, dtype=torch.float64)
    counts4 = torch.zeros(vocab, dtype=torch.float64)
    # 5 new tokens: the first round's k = 3 is not cut by the length limit (max_length - cur_len - 1)
    gen = dict(max_new_tokens=5, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    accepted = drafted = outside = 0
    sizes = set()
    torch.manual_seed(1)
    with river.river_mode("lossless"):
        for _ in range(800):
            out = river.generate(ids, **gen)
            t1, t2, t3, t4 = out[0, ids.shape[1]:ids.shape[1] + 4].tolist()
            outside += int(p2[t1, t2] == 0) + int(p3[t1, t2, t3] == 0) + int(p4[t1, t2, t3, t4] == 0)
            counts3[t3] += 1
            counts4[t4] += 1
            ll = river.river_stats["lossless"]
            accepted += ll["accepted"]
            drafted += ll["drafted"]
            sizes.add(ll["drafts_per_verify"])
    assert 0 < accepted < drafted, "both acceptance and rejection must occur"
    assert 3.0 in sizes  # the first verify round judged three drafts
    assert outside == 0  # never a token that top-k / top-p removed after its prefix
    assert _chi2_pvalue(counts3, marginal3) > 1e-3
    assert _chi2_pvalue(counts4, marginal4) > 1e-3


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


@pytest.mark.parametrize("how", ["load_state_dict", "inplace_data"])
def test_exit_layers_follow_a_weight_change(how):
    """Route mode quantizes the backbone's weights into exit copies once; after the weights change
    the exit path must be the one built from the new weights (the same tokens as River enabled on
    the new weights), not the old copies."""
    base = tiny_model("qwen2")
    river = river_copy(base, tau=-2.0, exit_head="int4")  # every step leaves after 2 layers: exit copies decide
    new = _other_weights(base, seed=11)
    fresh = river_copy(new, tau=-2.0, exit_head="int4")
    ids = prompt()
    with river.river_mode("route"), fresh.river_mode("route"):
        before = river.generate(ids, max_new_tokens=16, **GEN)
        target = river_hf_plain(river)
        with torch.no_grad():
            if how == "load_state_dict":
                target.load_state_dict(new.state_dict())
            else:
                for p, q in zip(target.parameters(), new.parameters()):
                    p.data.copy_(q.detach())
        ref = fresh.generate(ids, max_new_tokens=16, **GEN)
        assert not torch.equal(ref, before)
        out = river.generate(ids, max_new_tokens=16, **GEN)
        assert torch.equal(out, ref)
        assert river.river_stats["exit_copies_rebuilt"] == [f"layers.{i}" for i in range(4)] + ["lm_head"]
        river.generate(ids, max_new_tokens=4, **GEN)
        assert "exit_copies_rebuilt" not in river.river_stats


def test_the_backbone_step_timing_of_a_first_call_stays_out_of_its_stats():
    """The first lossless call of a model times a few backbone steps (the unit of draft/verify cost);
    those passes are not the call's: its forward passes and weight bytes per token equal a second,
    identical call's (a fresh-user trial saw 7 passes and 3.5 GB per token on the first call, 3 and
    0.8 GB later, and a GB/s above the machine's bandwidth)."""
    river = river_copy(tiny_model("llama"), config=RiverConfig(lossless=True))
    ids = prompt()
    firsts = []
    for _ in range(2):
        river.generate(ids, max_new_tokens=6, **GEN)
        stats = river.river_stats
        firsts.append((stats["forward_passes"], stats["weight_bytes_per_token"]))
    assert river.__dict__.get("_river_backbone_step") is not None  # the timing ran, in the first call
    assert firsts[0] == firsts[1]
