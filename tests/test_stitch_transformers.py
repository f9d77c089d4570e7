"""R-Stitch behaves like ``model.generate`` (issue 14): every GenerationConfig field is honoured
through transformers' own processors / stopping criteria (checked against ``generate`` at the
exactness switches τ < 0 and τ ≥ 1) or refused by name; streamers get the calls ``generate``
makes, as tokens are accepted; stats are returned, not written onto the model; SmallBatchLinear is
entered only for float32 CPU weights. Tiny random Qwen2 pairs sharing one 96-token vocabulary."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import (
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)
from transformers.generation.streamers import BaseStreamer

import river_hf.stitch.generation as gen_mod
from river_hf.errors import RiverError
from river_hf.stitch import CUSTOM_GENERATE_DIR, LLM, SLM, generate

from test_stitch import V, _prompt, _word_tokenizer, tiny_qwen

N = 12  # new-token budget of the comparisons


@pytest.fixture(scope="module")
def models():
    return tiny_qwen(32, 2, V, seed=1), tiny_qwen(64, 3, V, seed=2)


@pytest.fixture(scope="module")
def tok():
    t = _word_tokenizer([f"w{i}" for i in range(V - 2)])
    assert len(t) == V
    return t


def _path(model, ids, n=N):
    """The model's own greedy continuation (new token ids) without any special setting."""
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


# each case: name -> (function of the model's own greedy path -> generation kwargs)
CASES = {
    # EOS = the 3rd new token; min_new_tokens / min_length push it out (skipped before issue 14: the
    # EOS tensor was never prepared, so MinLength* processors were not built)
    "min_new_tokens": lambda p, n_in: dict(max_new_tokens=N, eos_token_id=p[2], min_new_tokens=8),
    "min_length": lambda p, n_in: dict(max_new_tokens=N, eos_token_id=p[2], min_length=n_in + 8),
    # crashed with AttributeError (_eos_token_tensor) before
    "bad_words_ids": lambda p, n_in: dict(max_new_tokens=N, bad_words_ids=[[p[1]], [p[3], p[4]]]),
    "exponential_decay_length_penalty": lambda p, n_in: dict(
        max_new_tokens=N, eos_token_id=p[9], exponential_decay_length_penalty=(2, 30.0)),
    # accepted and ignored before
    "max_length": lambda p, n_in: dict(max_length=n_in + 5),
    "forced_eos_token_id": lambda p, n_in: dict(max_new_tokens=6, forced_eos_token_id=p[0]),
    "begin_suppress_tokens": lambda p, n_in: dict(max_new_tokens=N, begin_suppress_tokens=[p[0]]),
    "repetition_and_ngram": lambda p, n_in: dict(max_new_tokens=N, repetition_penalty=3.0, no_repeat_ngram_size=2),
    "eos_list": lambda p, n_in: dict(max_new_tokens=N, eos_token_id=[p[5], p[4]]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tau,source", [(-1.0, LLM), (1.0, SLM)], ids=["llm", "slm"])
def test_generation_settings_act_as_in_generate(models, case, tau, source):
    slm, llm = models
    ids = _prompt(11)
    model = llm if source == LLM else slm
    kw = CASES[case](_path(model, ids), ids.shape[1])
    ref = model.generate(ids, do_sample=False, pad_token_id=0, **kw)
    out = generate(slm, llm, ids, tau=tau, return_dict_in_generate=True, **kw)
    assert out.sequences.tolist() == ref.tolist()
    assert out.sources.tolist() == [[source] * (ref.shape[1] - ids.shape[1])]


def test_settings_change_the_output(models):
    """The cases above are not vacuous: each one's output differs from the plain greedy one."""
    slm, llm = models
    ids = _prompt(11)
    plain = _path(llm, ids)
    for case, make in CASES.items():
        if case == "repetition_and_ngram" and len(set(plain)) == len(plain):
            continue  # nothing repeated: the penalty may leave the path as it is
        new = generate(slm, llm, ids, tau=-1.0, **make(plain, ids.shape[1]))[0, ids.shape[1] :].tolist()
        assert new != plain[: len(new)] or len(new) != N, case


def test_prefix_allowed_tokens_fn_and_generation_config_object(models):
    slm, llm = models
    ids = _prompt(12)
    allowed = lambda batch_id, seq: list(range(20, 40))  # noqa: E731
    cfg = GenerationConfig(max_new_tokens=8, do_sample=False)
    for tau, model in ((-1.0, llm), (1.0, slm)):
        ref = model.generate(ids, generation_config=cfg, prefix_allowed_tokens_fn=allowed, pad_token_id=0)
        out = generate(slm, llm, ids, tau=tau, generation_config=cfg, prefix_allowed_tokens_fn=allowed)
        assert out.tolist() == ref.tolist()
        assert all(20 <= t < 40 for t in out[0, ids.shape[1] :].tolist())


def test_stop_strings_need_and_use_the_tokenizer():
    """stop_strings were accepted and ignored; they need a tokenizer that decodes to text, here the
    257-token byte-level Qwen2 tokenizer of the CLI tests (and a pair with exactly that vocabulary)."""
    from test_stitch_cli import _byte_tokenizer

    tok = _byte_tokenizer()
    slm, llm = tiny_qwen(32, 2, len(tok), seed=1), tiny_qwen(64, 3, len(tok), seed=2)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(13))
    for tau, model in ((-1.0, llm), (1.0, slm)):
        path = _path(model, ids)
        # the first later token that is one printable ASCII character (other bytes are UTF-8 fragments)
        text = [tok.decode([t]) for t in path]
        k = next(i for i in range(1, N) if text[i].isascii() and text[i].isprintable())
        stop = text[k]
        ref = model.generate(ids, max_new_tokens=N, stop_strings=stop, tokenizer=tok, do_sample=False, pad_token_id=0)
        assert ref.shape[1] - ids.shape[1] <= k + 1 < N  # the stop string does end generate early
        out = generate(slm, llm, ids, tau=tau, max_new_tokens=N, stop_strings=stop, tokenizer=tok)
        assert out.tolist() == ref.tolist()
    with pytest.raises(RiverError, match="stop_strings need the tokenizer"):
        generate(slm, llm, ids, tau=0.5, max_new_tokens=N, stop_strings="ab")


def test_max_time_stops(models):
    """max_time was accepted and ignored; 1 ns is over after the first forward whatever the machine."""
    slm, llm = models
    ids = _prompt(14)
    out = generate(slm, llm, ids, tau=0.5, max_new_tokens=N, max_time=1e-9)
    assert out.shape[1] == ids.shape[1] + 1


def test_user_stopping_criteria_see_generate_input_ids(models):
    """A user criterion gets generate's input_ids (prompt with its padding + new tokens)."""

    class AtLength(StoppingCriteria):
        def __init__(self):
            self.lengths = []

        def __call__(self, input_ids, scores, **kw):
            self.lengths.append(input_ids.shape[1])
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 10, dtype=torch.bool)

    slm, llm = models
    ids = _prompt(15)  # 7 tokens
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones_like(ids)], 1)
    crit = AtLength()
    out = generate(slm, llm, padded, attention_mask=mask, tau=0.5, max_new_tokens=N,
                   stopping_criteria=StoppingCriteriaList([crit]))
    assert out.shape[1] == 10 and crit.lengths == [10]


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(do_sample=True, num_return_sequences=2), "num_return_sequences"),
        (dict(guidance_scale=2.0), "guidance_scale"),
        (dict(cache_implementation="static"), "cache_implementation"),
        (dict(token_healing=True), "token_healing"),
        (dict(prefill_chunk_size=4), "prefill_chunk_size"),
        (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
        (dict(return_dict_in_generate=True, output_attentions=True), "output_attentions"),
        (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
        (dict(num_beams=3), "num_beams"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    ],
)
def test_unsupported_settings_are_refused_by_name(models, kw, name):
    slm, llm = models
    with pytest.raises(RiverError, match=name):
        generate(slm, llm, _prompt(), tau=0.5, max_new_tokens=4, **kw)


def test_prompt_at_max_length_is_refused(models):
    slm, llm = models
    with pytest.raises(RiverError, match="max_length"):
        generate(slm, llm, _prompt(n=7), tau=0.5, max_length=7)


# ----------------------------------------------------------------------------- streamers


class Recorder(BaseStreamer):
    """Records every put (as a list) and, per put, how many forwards the two models had run."""

    def __init__(self, counter=None):
        self.puts, self.forwards_at_put, self.ended, self.counter = [], [], 0, counter

    def put(self, value):
        self.puts.append(value.tolist())
        self.forwards_at_put.append(self.counter[0] if self.counter else None)

    def end(self):
        self.ended += 1


def test_streamer_gets_the_calls_generate_makes(models):
    slm, llm = models
    ids = _prompt(16)
    for tau, model in ((-1.0, llm), (1.0, slm)):
        ref = Recorder()
        model.generate(ids, max_new_tokens=N, do_sample=False, pad_token_id=0, streamer=ref)
        got = Recorder()
        generate(slm, llm, ids, tau=tau, max_new_tokens=N, streamer=got)
        assert got.puts == ref.puts and got.ended == ref.ended == 1
        assert got.puts[0] == ids.tolist() and all(len(p) == 1 for p in got.puts[1:])


def test_streamer_gets_each_token_as_it_is_accepted(models):
    """At a mid τ every token is put before the next forward runs (so it is streamed when accepted,
    not at the end), and the puts spell out the returned sequence."""
    slm, llm = models
    count = [0]
    hooks = [m.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1)) for m in (slm, llm)]
    try:
        rec = Recorder(count)
        out = generate(slm, llm, _prompt(17), tau=0.5, max_new_tokens=N, streamer=rec, return_dict_in_generate=True)
    finally:
        for h in hooks:
            h.remove()
    new = out.sequences[0, _prompt(17).shape[1] :].tolist()
    assert [p[0] for p in rec.puts[1:]] == new
    f = rec.forwards_at_put
    assert f[0] == 0 and all(b > a for a, b in zip(f, f[1:])) and f[-1] == count[0]
    assert set(out.sources[0].tolist()) == {SLM, LLM}, "τ = 0.5 should mix the two models"


def test_text_streamer_and_iterator_streamer(models, tok, capsys):
    slm, llm = models
    ids = _prompt(18)
    out = generate(slm, llm, ids, tau=0.5, max_new_tokens=N, streamer=TextStreamer(tok, skip_prompt=True),
                   tokenizer=tok)
    text = tok.decode(out[0, ids.shape[1] :])
    assert capsys.readouterr().out == text + "\n"

    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "out", generate(slm, llm, ids, tau=0.5, max_new_tokens=N, streamer=streamer, tokenizer=tok)))
    worker.start()
    pieces = list(streamer)
    worker.join()
    assert "".join(pieces) == text and result["out"].tolist() == out.tolist()


def test_custom_generate_passes_streamer_and_prefix_fn(models):
    """custom_generate refused streamer and prefix_allowed_tokens_fn before; now they reach R-Stitch."""
    slm, llm = models
    ids = _prompt(19)
    allowed = lambda batch_id, seq: list(range(30, 60))  # noqa: E731
    rec = Recorder()
    out = llm.generate(ids, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=slm,
                       tau=0.5, max_new_tokens=8, streamer=rec, prefix_allowed_tokens_fn=allowed)
    direct = generate(slm, llm, ids, tau=0.5, max_new_tokens=8, prefix_allowed_tokens_fn=allowed)
    assert out.tolist() == direct.tolist()
    assert [p[0] for p in rec.puts[1:]] == out[0, ids.shape[1] :].tolist() and rec.ended == 1
    with pytest.raises(RiverError, match="negative_prompt_ids"):
        llm.generate(ids, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=slm,
                     tau=0.5, max_new_tokens=2, negative_prompt_ids=ids)


# ----------------------------------------------------------------------------- stats, SmallBatchLinear


def test_stats_are_returned_not_written_onto_the_model(models):
    slm, llm = models
    out = generate(slm, llm, _prompt(20), tau=0.5, max_new_tokens=6, return_dict_in_generate=True)
    assert out.stats.new_tokens == out.sources.shape[1]
    assert not hasattr(llm, "stitch_stats") and not hasattr(slm, "stitch_stats")


def test_small_batch_linear_is_entered_only_for_fp32_cpu_weights(monkeypatch):
    """bf16 weights: SmallBatchLinear would reroute nothing, so it is not entered at all (it was
    entered for every catch-up before); fp32 is covered in test_stitch.py."""
    entered = []

    class Spy(gen_mod.SmallBatchLinear):
        def __enter__(self):
            entered.append(1)
            return super().__enter__()

    monkeypatch.setattr(gen_mod, "SmallBatchLinear", Spy)
    slm, llm = tiny_qwen(32, 2, V, seed=11, dtype=torch.bfloat16), tiny_qwen(64, 3, V, seed=12, dtype=torch.bfloat16)
    out = generate(slm, llm, _prompt(3, n=5), tau=0.5, max_new_tokens=24, return_dict_in_generate=True)
    assert any(c > 0 and t > 1 for _, t, c, _ in out.stats.forward_log), "τ = 0.5 should make the models hand over"
    assert entered == []
    assert not gen_mod._small_batch_linear_helps(slm) and gen_mod._small_batch_linear_helps(tiny_qwen(32, 2, V, seed=1))
