"""R-Stitch: exactness switches (τ < 0 = LLM, τ ≥ 1 = SLM), source/cache consistency at a mid τ,
pair validation, the latency estimator, custom_generate and the CLI, on tiny random Qwen2 pairs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM

from river_hf.errors import RiverError
from river_hf.stitch import (
    CUSTOM_GENERATE_DIR,
    LLM,
    SLM,
    LatencyEstimator,
    check_pair,
    generate,
    normalized_entropy,
    shared_vocab_size,
)


def tiny_qwen(hidden: int, layers: int, vocab: int, seed: int, dtype=torch.float32) -> Qwen2ForCausalLM:
    """Tiny random Qwen2; a large initializer_range makes next-token distributions peaked enough
    that normalized entropies spread over (0, 1)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


V = 96  # shared (tokenizer) vocabulary of the tiny pairs


# (slm vocab rows, llm vocab rows): same size, LLM padded, both padded differently
PAIRS = {"same": (V, V), "llm_padded": (V, V + 32), "both_padded": (V + 16, V + 40)}


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request):
    sv, lv = PAIRS[request.param]
    return tiny_qwen(32, 2, sv, seed=1), tiny_qwen(64, 3, lv, seed=2), request.param


def _prompt(seed=0, n=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (1, n), generator=g)


def _reference(model, ids, n, **kw):
    """The model's own ``generate``, restricted to the shared vocabulary (padded rows suppressed)."""
    rows = model.config.vocab_size
    sup = list(range(V, rows)) if rows > V else None
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, suppress_tokens=sup, pad_token_id=0, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tau_negative_is_llm_greedy(pair, seed):
    slm, llm, _ = pair
    ids = _prompt(seed)
    ref = _reference(llm, ids, 24, do_sample=False)
    out = generate(slm, llm, ids, tau=-1.0, max_new_tokens=24, vocab_size=V, return_dict_in_generate=True)
    assert out.sequences.tolist() == ref.tolist()
    assert out.sources.tolist() == [[LLM] * 24]
    assert out.stats.slm_forwards == 0 and out.stats.llm_tokens == 24


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tau_one_is_slm_greedy(pair, seed):
    slm, llm, _ = pair
    ids = _prompt(seed)
    ref = _reference(slm, ids, 24, do_sample=False)
    for tau in (1.0, 5.0):
        out = generate(slm, llm, ids, tau=tau, max_new_tokens=24, vocab_size=V, return_dict_in_generate=True)
        assert out.sequences.tolist() == ref.tolist()
        assert out.sources.tolist() == [[SLM] * 24]
        assert out.stats.llm_forwards == 0 and out.stats.handovers == 0


def test_default_vocab_is_smaller_config_and_unpadded_pair_matches_plain_generate():
    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    assert shared_vocab_size(slm, llm) == V
    ids = _prompt(3)
    ref = llm.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert generate(slm, llm, ids, tau=-0.5, max_new_tokens=16).tolist() == ref.tolist()


def test_sampling_switches_match_generate_with_same_processors():
    """τ < 0 with do_sample / temperature / top_k / top_p and the same seed samples the LLM's tokens."""
    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    ids = _prompt(4)
    kw = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(123)
    ref = llm.generate(ids, max_new_tokens=16, min_new_tokens=16, pad_token_id=0, **kw)
    torch.manual_seed(123)
    out = generate(slm, llm, ids, tau=-1.0, max_new_tokens=16, **kw)
    assert out.tolist() == ref.tolist()
    torch.manual_seed(7)
    ref = slm.generate(ids, max_new_tokens=16, min_new_tokens=16, pad_token_id=0, **kw)
    torch.manual_seed(7)
    assert generate(slm, llm, ids, tau=1.0, max_new_tokens=16, **kw).tolist() == ref.tolist()


def test_user_logits_processor_is_applied():
    """A LogitsProcessor passed by the user acts on both models (here: forbid token ids >= 10)."""

    def forbid(input_ids, scores):
        scores = scores.clone()
        scores[:, 10:] = -float("inf")
        return scores

    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    ids = _prompt(5)
    for tau in (-1.0, 1.0):
        out = generate(slm, llm, ids, tau=tau, max_new_tokens=10, logits_processor=LogitsProcessorList([forbid]))
        assert max(out[0, ids.shape[1] :].tolist()) < 10


def _fresh_next(model, seq):
    """Next-token (argmax, normalized entropy) of ``model`` on ``seq`` without any cache."""
    logits = model(input_ids=seq).logits[:, -1, :V]
    return int(logits.argmax(-1)), float(normalized_entropy(logits)[0])


@pytest.mark.parametrize("seed", [0, 1])
def test_mid_tau_mixes_sources_and_matches_uncached_rescoring(seed):
    """At a mid τ both models write tokens, and the stitched output is exactly what the switching
    rule gives when every step is re-scored from scratch by both models (no KV cache): so the two
    caches, the catch-up prefills and the roll-back are consistent. float64 keeps ties away."""
    slm = tiny_qwen(32, 2, V + 8, seed=11, dtype=torch.float64)
    llm = tiny_qwen(64, 3, V + 24, seed=12, dtype=torch.float64)
    ids = _prompt(seed, n=5)
    n = 24
    with torch.no_grad():
        # τ = median SLM entropy along the SLM's own greedy path: some tokens pass, some do not
        seq, hs = ids, []
        for _ in range(n):
            tok, h = _fresh_next(slm, seq)
            hs.append(h)
            seq = torch.cat([seq, torch.tensor([[tok]])], 1)
        tau = sorted(hs)[len(hs) // 2]
        out = generate(slm, llm, ids, tau=tau, max_new_tokens=n, vocab_size=V, return_dict_in_generate=True)

        # reference: the paper's rule, every distribution recomputed from the full prefix
        seq, active, sources, ents = ids, SLM, [], []
        while len(sources) < n:
            if active == SLM:
                tok, h = _fresh_next(slm, seq)
                if h > tau:
                    active = LLM
                    continue
                src = SLM
            else:
                tok, h = _fresh_next(llm, seq)
                src = LLM
                if h <= tau:
                    active = SLM
            seq = torch.cat([seq, torch.tensor([[tok]])], 1)
            sources.append(src)
            ents.append(h)
    assert out.sequences.tolist() == seq.tolist()
    assert out.sources[0].tolist() == sources
    assert out.entropies[0].tolist() == pytest.approx(ents, abs=1e-5)
    st = out.stats
    assert 0 < st.slm_tokens < n and 0 < st.llm_tokens < n, "τ should mix the two models"
    assert st.slm_tokens == sources.count(SLM) and st.llm_tokens == sources.count(LLM)
    switches = sum(1 for a, b in zip(sources, sources[1:]) if a != b)
    assert st.handovers >= switches > 0
    # every forward processed only tokens its model had not seen: cache lengths add up
    for name in ("slm", "llm"):
        log = [(t, c) for m, t, c, _ in st.forward_log if m == name]
        for (t0, c0), (t1, c1) in zip(log, log[1:]):
            assert c1 == c0 + t0
    assert st.slm_forwards + st.llm_forwards == len(st.forward_log)


def test_eos_stops_and_max_new_tokens_zero():
    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    ids = _prompt(6)
    full = generate(slm, llm, ids, tau=1.0, max_new_tokens=12)
    eos = int(full[0, ids.shape[1] + 3])
    first = full[0, ids.shape[1] :].tolist().index(eos)
    out = generate(slm, llm, ids, tau=1.0, max_new_tokens=12, eos_token_id=eos)
    assert out.tolist() == full[:, : ids.shape[1] + first + 1].tolist()
    with pytest.raises(RiverError, match="max_new_tokens"):  # generate refuses 0 too (GenerationConfig.validate)
        generate(slm, llm, ids, tau=0.5, max_new_tokens=0)


def test_left_padding_in_attention_mask_is_dropped():
    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    ids = _prompt(7)
    plain = generate(slm, llm, ids, tau=0.5, max_new_tokens=8)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], 1)
    out = generate(slm, llm, padded, attention_mask=mask, tau=0.5, max_new_tokens=8)
    assert out[:, 3:].tolist() == plain.tolist() and out[:, :3].tolist() == [[0, 0, 0]]


def test_bad_inputs_raise_river_error():
    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    with pytest.raises(RiverError, match="batches are not supported.*at its own positions.*once per prompt"):
        generate(slm, llm, torch.ones(2, 4, dtype=torch.long), tau=0.1, max_new_tokens=2)
    with pytest.raises(RiverError, match="attention_mask has shape"):
        generate(slm, llm, _prompt(), attention_mask=torch.ones(1, 3, dtype=torch.long), tau=0.1, max_new_tokens=2)
    with pytest.raises(RiverError, match="LongTensor of shape"):
        generate(slm, llm, _prompt()[0], tau=0.1, max_new_tokens=2)
    with pytest.raises(RiverError, match="empty"):
        generate(slm, llm, torch.ones(1, 0, dtype=torch.long), tau=0.1, max_new_tokens=2)
    with pytest.raises(RiverError, match="beam"):
        generate(slm, llm, _prompt(), tau=0.1, max_new_tokens=2, num_beams=2)
    with pytest.raises(RiverError, match="NaN"):
        generate(slm, llm, _prompt(), tau=float("nan"), max_new_tokens=2)
    with pytest.raises(RiverError, match="does not take output_router_logits"):
        generate(slm, llm, _prompt(), tau=0.1, max_new_tokens=2, output_router_logits=True)


def _word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + words)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="<eos>")


def test_pair_with_different_tokenizers_is_refused():
    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    a = _word_tokenizer([f"w{i}" for i in range(40)])
    b = _word_tokenizer([f"v{i}" for i in range(40)])
    check_pair(slm, llm, a, _word_tokenizer([f"w{i}" for i in range(40)]))  # same vocabulary: fine
    with pytest.raises(RiverError, match="different tokenizers"):
        check_pair(slm, llm, a, b)
    with pytest.raises(RiverError, match="different tokenizers"):
        generate(slm, llm, _prompt(), tau=0.1, max_new_tokens=2, tokenizer=b, assistant_tokenizer=a)
    slm.generation_config.eos_token_id = 5
    llm.generation_config.eos_token_id = 6
    with pytest.raises(RiverError, match="eos_token_id"):
        generate(slm, llm, _prompt(), tau=0.1, max_new_tokens=2)


def test_tokenizer_sets_shared_vocab_and_too_large_tokenizer_is_refused():
    slm, llm = tiny_qwen(32, 2, V + 8, seed=1), tiny_qwen(64, 3, V + 24, seed=2)
    tok = _word_tokenizer([f"w{i}" for i in range(50)])
    assert shared_vocab_size(slm, llm, tok) == len(tok) == 52
    with pytest.raises(RiverError, match="output layer"):
        shared_vocab_size(slm, llm, _word_tokenizer([f"w{i}" for i in range(200)]))


def test_normalized_entropy_bounds():
    assert float(normalized_entropy(torch.zeros(1, 50))[0]) == pytest.approx(1.0)
    one_hot = torch.full((1, 50), -1e4)
    one_hot[0, 3] = 0
    assert float(normalized_entropy(one_hot)[0]) == pytest.approx(0.0, abs=1e-6)
    h = normalized_entropy(torch.randn(4, 50))
    assert h.shape == (4,) and bool(((h > 0) & (h < 1)).all())


# ----------------------------------------------------------------------------- latency estimator


def test_latency_estimator_recovers_linear_model_and_round_trips(tmp_path):
    true = {"slm": {"prefill": (0.05, 0.002, 0.0001), "decode": (0.02, 0.0, 0.00005)},
            "llm": {"prefill": (0.2, 0.01, 0.0004), "decode": (0.08, 0.0, 0.0002)}}
    samples = []
    for name, ph in true.items():
        for n in (1, 4, 16, 64):
            for L in (0, 32, 128, 512):
                a, b, c = ph["decode" if n == 1 else "prefill"]
                samples.append((name, n, L, a + b * n + c * L))
    est = LatencyEstimator.fit(samples)
    for name, ph in true.items():
        for phase, coef in ph.items():
            assert est.coef[name][phase] == pytest.approx(list(coef), abs=1e-9)
    assert est.predict_forward("llm", 10, 100) == pytest.approx(0.2 + 0.1 + 0.04)
    log = [("slm", 20, 0, 9.9), ("llm", 21, 0, 9.9), ("slm", 1, 20, 9.9)]
    assert est.predict_log(log) == pytest.approx((0.05 + 0.04) + (0.2 + 0.21) + (0.02 + 0.001))
    assert est.predict_autoregressive("slm", 10, 3) == pytest.approx((0.05 + 0.002 * 10) + 2 * 0.02 + 0.00005 * (10 + 11))
    path = tmp_path / "est.json"
    est.save(path)
    assert LatencyEstimator.load(path).coef == est.coef
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"coef": {"slm": {"decode": [1, 2]}}}))
    with pytest.raises(RiverError, match="re-run the calibration"):
        LatencyEstimator.load(bad)
    with pytest.raises(RiverError):
        LatencyEstimator.load(tmp_path / "missing.json")
    with pytest.raises(RiverError, match="no fit"):
        est.predict_forward("other", 1, 1)


def test_latency_calibration_on_tiny_models_gives_usable_fit():
    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    est = LatencyEstimator.calibrate({"slm": slm, "llm": llm}, cache_lengths=(8, 24), chunk_sizes=(1, 1, 4, 8), progress=False)
    assert set(est.coef) == {"slm", "llm"} and set(est.coef["llm"]) == {"prefill", "decode"}
    assert est.meta["samples"] == {"slm/prefill": 6, "slm/decode": 4, "llm/prefill": 6, "llm/decode": 4}
    assert est.predict_autoregressive("llm", 16, 8) >= 0.0


# ----------------------------------------------------------------------------- custom_generate


def test_custom_generate_local_folder_runs_r_stitch():
    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    ids = _prompt(8)
    kw = dict(custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=slm, max_new_tokens=12)
    ref_llm = llm.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert llm.generate(ids, tau=-1.0, **kw).tolist() == ref_llm.tolist()
    ref_slm = slm.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert llm.generate(input_ids=ids, tau=1.0, **kw).tolist() == ref_slm.tolist()
    direct = generate(slm, llm, ids, tau=0.5, max_new_tokens=12, return_dict_in_generate=True)
    via = llm.generate(ids, tau=0.5, return_dict_in_generate=True, **kw)
    assert via.sequences.tolist() == direct.sequences.tolist() and via.sources.tolist() == direct.sources.tolist()
    with pytest.raises(RiverError, match="tau"):
        llm.generate(ids, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=slm)
    with pytest.raises(RiverError, match="assistant_model"):
        llm.generate(ids, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, tau=0.1)


def test_custom_generate_local_folder_needs_trust_remote_code():
    slm, llm = tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)
    with pytest.raises(ValueError, match="trust_remote_code"):
        llm.generate(_prompt(), custom_generate=CUSTOM_GENERATE_DIR, assistant_model=slm, tau=0.1, max_new_tokens=2)


def test_catch_up_forwards_use_small_batch_linear_and_give_the_same_tokens(monkeypatch):
    """fp32 catch-up forwards run under SmallBatchLinear (first prefills and one-token steps do
    not); turning it off gives the same tokens and sources."""
    import river_hf.stitch.generation as gen_mod
    from river_hf.quant.dense import SmallBatchLinear

    used = []

    class Spy(SmallBatchLinear):
        def __exit__(self, *exc):
            used.append(self.calls_rerouted)
            return super().__exit__(*exc)

    monkeypatch.setattr(gen_mod, "SmallBatchLinear", Spy)
    slm, llm = tiny_qwen(32, 2, V, seed=11), tiny_qwen(64, 3, V + 24, seed=12)
    ids = _prompt(3, n=5)
    outs = {}
    for on in (True, False):
        used.clear()
        outs[on] = generate(slm, llm, ids, tau=0.5, max_new_tokens=24, vocab_size=V, return_dict_in_generate=True,
                            small_batch_linear=on)
        catch_ups = [(t, c) for _, t, c, _ in outs[on].stats.forward_log if c > 0 and t > 1]
        assert catch_ups, "τ = 0.5 should make the models hand over"
        assert len(used) == (len(catch_ups) if on else 0)
        assert all(n > 0 for n in used)
    assert outs[True].sequences.tolist() == outs[False].sequences.tolist()
    assert outs[True].sources.tolist() == outs[False].sources.tolist()
