"""``river-hf serve``'s running batch in route mode: requests join between decode steps and leave
when finished, each row getting the tokens it gets alone.

Tiny random models (fp32, int8 exit copies so the two paths give different tokens) drive
:class:`~river_hf.serve.batch.RunningBatch` through joins and departures at chosen steps; the
server tests check that a short request that arrives while a long one runs is answered first, with
its solo answer.
"""

from __future__ import annotations

import json
import threading
import types

import pytest
import torch
from test_batch_exit import MIXED_TAU, river
from test_river_core import tiny_model
from test_serve import _concurrently, serving
from transformers import DynamicCache

from river_hf.river.layer import LOSSLESS
from river_hf.serve.batch import RunningBatch, RunningRow, join_rows, keep_rows, unsupported, warpers_for

PROMPT_LENGTHS = [12, 9, 5, 7]
NEW = 6


def prompts() -> list[list[int]]:
    torch.manual_seed(3)
    return [torch.randint(3, 256, (n,)).tolist() for n in PROMPT_LENGTHS]


def request(prompt, *, do_sample=False, temperature=None, top_p=None, seed=None):
    settings = types.SimpleNamespace(prompt_ids=tuple(prompt), do_sample=do_sample, temperature=temperature,
                                     top_p=top_p, seed=seed, max_tokens=NEW, stop=(), stream=False)
    return types.SimpleNamespace(settings=settings)


def new_row(model, job) -> RunningRow:
    return RunningRow(job, [], *warpers_for(job.settings, model.generation_config), started=0.0)


def run_staggered(model, jobs, joins: dict[int, list[int]]) -> tuple[list[list[int]], list[tuple]]:
    """Drive a running batch: before pass ``s`` the jobs ``joins[s]`` join (one prefill pass), a
    row leaves once it has ``NEW`` tokens. Returns each job's tokens and each decode step's
    per-row exit layers."""
    batch = RunningBatch(model, pad_id=0)
    rows = {}
    steps = []
    s = 0
    while s in joins or any(k > s for k in joins) or batch.rows:
        if s in joins:
            fresh = [new_row(model, jobs[i]) for i in joins[s]]
            rows.update(zip(joins[s], fresh))
            batch.admit(fresh)
        else:
            batch.step()
            steps.append(tuple(r.exits[-1] for r in batch.rows))
        batch.retire([len(r.ids) < NEW for r in batch.rows])
        if batch.rows:  # the cut leaves no column that is padding in every row
            assert bool(batch.mask[:, 0].any()) and batch.cache.get_seq_length() == batch.mask.shape[1]
        s += 1
    return [rows[i].ids for i in range(len(jobs))], steps


def solo(model, prompt) -> list[int]:
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


JOINS = {0: [0], 3: [1, 2], 6: [3]}  # row 0 runs alone, two join mid-way (one longer prompt), one as row 0 leaves


def test_rows_that_join_and_leave_between_steps_get_their_solo_river_tokens():
    model = river("llama", tau=MIXED_TAU["llama"])
    model.generation_config.eos_token_id = None  # every row runs NEW tokens, in the batch and alone
    ps = prompts()
    got, steps = run_staggered(model, [request(p) for p in ps], JOINS)
    assert any(len(set(exits)) > 1 for exits in steps), f"rows must exit at different layers: {steps}"
    assert max(map(len, steps)) == 4  # row 3 joined while row 0 still ran
    assert got == [solo(model, p) for p in ps]


def test_tau_above_one_running_batch_is_the_plain_model():
    model = river("llama", tau=2.0)
    plain = tiny_model("llama")
    for m in (model, plain):
        m.generation_config.eos_token_id = None
    ps = prompts()
    got, steps = run_staggered(model, [request(p) for p in ps], JOINS)
    assert all(e == model.river.num_layers for exits in steps for e in exits)  # never left the backbone
    assert got == [solo(plain, p) for p in ps]


def test_a_seeded_sampled_request_draws_the_same_tokens_alone_and_in_a_batch():
    model = river("llama", tau=MIXED_TAU["llama"])
    model.generation_config.eos_token_id = None
    ps = prompts()
    sampled = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=11)
    alone, _ = run_staggered(model, [request(ps[0], **sampled)], {0: [0]})
    together, _ = run_staggered(model, [request(p) for p in ps[1:]] + [request(ps[0], **sampled)],
                                {0: [0, 1], 2: [2, 3]})
    assert together[3] == alone[0]
    other, _ = run_staggered(model, [request(ps[0], **{**sampled, "seed": 12})], {0: [0]})
    assert other != alone[0]


def test_join_and_keep_rows_pad_on_the_left_and_cut_common_padding():
    model = river("llama", tau=2.0)
    cache_a, cache_b = DynamicCache(config=model.config), DynamicCache(config=model.config)
    ids = torch.randint(3, 256, (1, 7))
    with torch.no_grad():
        model(input_ids=ids, cache=cache_a, use_cache=True)
        model(input_ids=ids[:, :3], cache=cache_b, use_cache=True)
    mask = join_rows(cache_a, torch.ones(1, 7, dtype=torch.long), cache_b, torch.ones(1, 3, dtype=torch.long))
    assert mask.tolist() == [[1] * 7, [0] * 4 + [1] * 3]
    keys = cache_a.layers[0].keys
    assert keys.shape[0] == 2 and keys.shape[2] == 7 and torch.equal(keys[1, :, :4], torch.zeros_like(keys[1, :, :4]))
    assert torch.equal(keys[1, :, 4:], cache_b.layers[0].keys[0])
    kept = keep_rows(cache_a, mask, [1])  # the long row leaves: its four columns were padding for the other
    assert kept.tolist() == [[1] * 3] and torch.equal(cache_a.layers[0].keys, cache_b.layers[0].keys)


def test_what_the_running_batch_cannot_serve_is_named():
    assert unsupported(river("llama", tau=0.7)) is None
    assert "sliding-window" in unsupported(river("gemma3", tau=0.7))
    assert "one exit decision per batch" in unsupported(river("llama", tau=0.7, strategy="skipdecode"))
    model = river("llama", tau=0.7)
    with model.river.override(mode=LOSSLESS):
        assert "lossless" in unsupported(model)
    model.generation_config.no_repeat_ngram_size = 3
    assert "no_repeat_ngram_size" in unsupported(model)


# -- the server ---------------------------------------------------------------------------------------


def test_a_short_request_that_arrives_mid_answer_joins_and_finishes_first(tiny):
    """The running batch of the server: a 2-token request sent while a 400-token one streams is
    answered before it (it joined between steps, it did not wait for the long answer), with the
    text it gets alone; both report the step batching and a batch size above one."""
    from river_hf.serve.app import build_app

    app = build_app(*tiny, "tiny", max_tokens_limit=512)
    assert app.state.scheduler.batching == "step"
    with serving(app) as client:
        short_alone = client.post("/v1/completions", prompt="Short one", max_tokens=2)
        started, order = threading.Event(), []

        def ask(i):
            if i == 0:
                c = client.connection()
                c.request("POST", "/v1/completions", json.dumps({"prompt": "A long answer", "max_tokens": 400,
                                                                 "temperature": 0, "stream": True}),
                          {"Content-Type": "application/json"})
                r = c.getresponse()
                lines = [r.readline()]
                started.set()
                lines += r.read().splitlines()
                c.close()
                order.append("long")
                return [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
            assert started.wait(120)
            body = client.post("/v1/completions", prompt="Short one", max_tokens=2)
            order.append("short")
            return body

        long_chunks, short = _concurrently(ask, 2)
    assert order == ["short", "long"], order
    assert short["choices"][0]["text"] == short_alone["choices"][0]["text"]
    assert short["river"]["batching"] == "step" and short["river"]["batch_size"] > 1
    assert long_chunks[-1]["usage"]["completion_tokens"] == 400


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM

    model = RiverForCausalLM.from_pretrained(tiny_folder, tau=2.0, backend="copy", progress=False).eval()
    model.generation_config.eos_token_id = None  # the random model's answers run to max_tokens
    return model, AutoTokenizer.from_pretrained(tiny_folder)


def test_lossless_servers_batch_whole_calls(tiny):
    from river_hf.serve.scheduler import Scheduler

    model, tok = tiny
    with model.river.override(mode=LOSSLESS):
        scheduler = Scheduler(model, tok, max_batch_size=4, lossless=True)
    assert scheduler.batching == "call" and "lossless" in scheduler.step_refusal
    assert Scheduler(model, tok, max_batch_size=1).batching == "fifo"
