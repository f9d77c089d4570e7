"""``river-hf serve --lossless`` batches: concurrent lossless requests run as one batched
lossless call (River's own loop, ``river/lossless_batch.py``) and each answer is the one the
request gets alone.

The scheduler directly on a tiny random River Llama (τ = -2: every draft leaves after one layer,
so drafts are often rejected and rows advance by different amounts), with every request queued
before the inference thread starts (one call, deterministic); and an in-process server on
SmolLM2-135M for real answers over HTTP, JSON and streamed.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_serve import MODEL, PROMPTS, _concurrently, _content, serving  # noqa: E402


@pytest.fixture(scope="module")
def tiny_lossless(tiny_folder):
    """(model, tokenizer): a tiny random River Llama in lossless mode, τ -2, exits after layer 1."""
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a negative τ warns by design
        model = RiverForCausalLM.from_pretrained(tiny_folder, tau=-2.0, min_layer=1, lossless=True,
                                                 progress=False).eval()
    return model, AutoTokenizer.from_pretrained(tiny_folder)


def _serve(model, tokenizer, settings: list) -> tuple[list, list[list[int]], int]:
    """Queue one job per ``settings`` entry, then start a lossless scheduler (batches of up to 4):
    ``(results, streamed token ids per job, generate calls made)``."""
    from river_hf.serve.scheduler import Job, Scheduler

    scheduler = Scheduler(model, tokenizer, max_batch_size=4, lossless=True)
    results, streamed = [None] * len(settings), [[] for _ in settings]
    finished = [threading.Event() for _ in settings]

    def deliver(i, event):
        kind, payload = event
        if kind == "tokens":
            streamed[i].extend(payload)
            return
        results[i] = payload
        finished[i].set()

    for i, s in enumerate(settings):
        scheduler.submit(Job(s, lambda e, i=i: deliver(i, e)))
    scheduler.start()
    try:
        assert all(f.wait(300) for f in finished)
    finally:
        scheduler.stop()
    return results, streamed, scheduler.calls


def _settings(tokenizer, texts, max_tokens, stop=()):
    from river_hf.serve.requests import Settings

    return [Settings(prompt_ids=tuple(tokenizer(t).input_ids), max_tokens=m, do_sample=False, temperature=None,
                     top_p=None, stop=tuple(stop), stream=True) for t, m in zip(texts, max_tokens)]


def test_queued_lossless_requests_run_as_one_batch_and_each_gets_its_answer_alone(tiny_lossless):
    """Four greedy requests of different prompt lengths and ``max_tokens``: one generate call in
    lossless mode (batch 4), each answer and its streamed tokens equal to the request's answer
    alone and to the plain model's greedy tokens; then the same with a stop string that ends one
    answer early (the batched call is given no stop strings and cuts each answer afterwards)."""
    from river_hf import plain_model

    model, tok = tiny_lossless
    texts = ["one", "two three four five six", "seven eight nine", "ten eleven twelve thirteen fourteen fifteen"]
    settings = _settings(tok, texts, (12, 6, 16, 9))
    results, streamed, calls = _serve(model, tok, settings)
    assert calls == 1
    alone = [_serve(model, tok, [s])[0][0] for s in settings]
    plain = plain_model(model)
    for s, r, sent, a in zip(settings, results, streamed, alone):
        assert r.river["mode"] == "lossless" and r.river["batch_size"] == 4 and r.river["acceptance_rate"] < 1
        assert r.ids == a.ids == sent and r.finish_reason == a.finish_reason
        assert a.river["batch_size"] == 1 and r.river["new_tokens"] == len(r.ids)
        with torch.no_grad():
            ref = plain.generate(torch.tensor([s.prompt_ids]), max_new_tokens=s.max_tokens, do_sample=False)
        assert r.ids == ref[0, len(s.prompt_ids):].tolist()[:len(r.ids)]

    text = tok.decode(results[2].ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]  # a piece of the middle of answer 2
    settings = _settings(tok, texts, (12, 6, 16, 9), stop=[stop])
    results, _, calls = _serve(model, tok, settings)
    alone = [_serve(model, tok, [s])[0][0] for s in settings]
    assert calls == 1 and results[2].finish_reason == "stop" and len(results[2].ids) < 16
    assert [r.ids for r in results] == [a.ids for a in alone]
    assert [r.finish_reason for r in results] == [a.finish_reason for a in alone]


@pytest.mark.real_model
def test_concurrent_lossless_clients_are_batched_and_each_gets_its_answer_alone():
    """SmolLM2-135M in lossless mode over HTTP: four concurrent chat requests (different
    ``max_tokens``) run in batches (a batch size above 1 is reported, mode lossless), and each
    answer, JSON or streamed, equals the request's answer alone."""
    from river_hf.serve.app import build_app, load_model

    model, tokenizer = load_model(MODEL, river_kwargs={"lossless": True}, progress=False)

    def ask(client, i, stream=False):
        fields = dict(messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=6 + 2 * i)
        if stream:
            chunks, _ = client.stream("/v1/chat/completions", **fields)
            return _content(chunks), chunks[-1]["river"]
        body = client.chat(**fields)
        return body["choices"][0]["message"]["content"], body["river"]

    with serving(build_app(model, tokenizer, MODEL, max_batch_size=4)) as client:
        alone = [ask(client, i) for i in range(len(PROMPTS))]
        together = _concurrently(lambda i: ask(client, i), len(PROMPTS))
        streamed = _concurrently(lambda i: ask(client, i, stream=True), len(PROMPTS))
    assert [t for t, _ in together] == [t for t, _ in alone] == [t for t, _ in streamed]
    assert all(r["mode"] == "lossless" for _, r in alone + together + streamed)
    assert max(r["batch_size"] for _, r in together) > 1 and max(r["batch_size"] for _, r in streamed) > 1
