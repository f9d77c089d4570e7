"""``river-hf serve``: River's OpenAI-compatible server (FastAPI + uvicorn).

In-process servers (uvicorn in a thread, free loopback port, stdlib ``http.client``) on a tiny
random River model for the protocol (JSON and SSE shapes of both endpoints, ``[DONE]``, the
``river`` key, every refused request, stop strings, batching and FIFO), and on SmolLM2-135M for
real answers (River route mode, batched rows equal to their answers alone, a client that leaves
mid-stream). The real command (``river-hf serve ... --port 0``) in subprocesses: its ready line,
``--fifo``, lossless answers equal to the plain model's, a clean stop on SIGINT (batched lossless
requests: ``test_serve_lossless.py``). Plus what
``transformers serve`` does with a saved River folder.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "smollm2-135m"
RIVER_HF = str(Path(sys.executable).with_name("river-hf"))
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["What is the capital of France?", "Name three colors.", "What is 2+2?", "Say hello."]
TOKENS = 8
ENV = {**os.environ, "RIVER_HF_AUTOTUNE": "0"}


class Client:
    """OpenAI-style requests to a server at ``host:port`` (stdlib ``http.client``)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    def connection(self, timeout: float = 300) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None) -> tuple[int, dict]:
        c = self.connection()
        data = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
        c.request(method, path, data, {"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        c.close()
        return r.status, json.loads(raw)

    def post(self, path: str, **fields) -> dict:
        status, body = self.request("POST", path, {"max_tokens": TOKENS, "temperature": 0, **fields})
        assert status == 200, body
        return body

    def chat(self, messages, **fields) -> dict:
        return self.post("/v1/chat/completions", messages=messages, **fields)

    def stream(self, path: str, **fields) -> tuple[list[dict], str]:
        """The chunks of a streamed completion (``[DONE]`` excluded) and the raw SSE text."""
        c = self.connection()
        c.request("POST", path, json.dumps({"max_tokens": TOKENS, "temperature": 0, "stream": True, **fields}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        raw = r.read().decode()
        c.close()
        return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")], raw


@contextlib.contextmanager
def serving(app):
    """``app`` on a free 127.0.0.1 port in a uvicorn thread; yields a :class:`Client`."""
    import uvicorn

    from river_hf.serve.app import ReadyServer

    ready, where = threading.Event(), []
    server = ReadyServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"),
                         on_ready=lambda host, port: (where.append((host, port)), ready.set()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "the server did not start"
        yield Client(*where[0])
    finally:
        server.should_exit = True
        thread.join(60)
    assert not thread.is_alive()


def _content(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def _concurrently(fn, n: int) -> list:
    results: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return [results[i] for i in range(n)]


# -- the protocol, on a tiny random River model -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    """(model, tokenizer) of a tiny random River Llama, τ 2 (never exits), fp32 ``copy`` kernels."""
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM

    model = RiverForCausalLM.from_pretrained(tiny_folder, tau=2.0, backend="copy", progress=False).eval()
    return model, AutoTokenizer.from_pretrained(tiny_folder)


@pytest.fixture(scope="module")
def tiny_server(tiny):
    from river_hf.serve.app import build_app

    with serving(build_app(*tiny, "tiny", max_tokens_limit=64)) as client:
        yield client


def test_models_and_health(tiny_server):
    status, body = tiny_server.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"] and body["data"][0]["object"] == "model"
    assert tiny_server.request("GET", "/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_json_and_stream_answers_carry_the_river_key(tiny_server, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    fields = {"messages": QUESTION} if chat else {"prompt": "The capital of France is"}
    body = tiny_server.post(path, model="tiny", **fields)
    assert body["object"] == ("chat.completion" if chat else "text_completion") and body["model"] == "tiny"
    choice = body["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and text
    usage = body["usage"]
    assert usage["completion_tokens"] == TOKENS and usage["total_tokens"] == usage["prompt_tokens"] + TOKENS
    river = body["river"]
    assert river["mode"] == "route" and river["num_layers"] == 4 and river["batch_size"] == 1
    assert river["new_tokens"] == TOKENS and river["mean_exit_layer"] == 4.0 and river["queued_seconds"] >= 0

    chunks, raw = tiny_server.stream(path, **fields)
    assert raw.endswith("}\n\ndata: [DONE]\n\n") and raw.count("[DONE]") == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    streamed = _content(chunks) if chat else "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == text  # greedy: the same answer
    assert [("river" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]  # the last chunk only
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1]["river"]["new_tokens"] == chunks[-1]["usage"]["completion_tokens"] == TOKENS
    assert chunks[-1]["river"]["batch_size"] == 1
    if chat:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_bad_requests_get_a_4xx_with_a_message_and_the_server_keeps_serving(tiny_server):
    chat, legacy = "/v1/chat/completions", "/v1/completions"
    cases = {
        "malformed JSON": (chat, '{"messages": ['),
        "not an object": (chat, "[1, 2]"),
        "missing messages": (chat, {"max_tokens": 4}),
        "empty messages": (chat, {"messages": []}),
        "role wizard": (chat, {"messages": [{"role": "wizard", "content": "hi"}]}),
        "null content": (chat, {"messages": [{"role": "user", "content": None}]}),
        "image part": (chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}),
        "negative max_tokens": (chat, {"messages": QUESTION, "max_tokens": -3}),
        "absurd max_tokens": (chat, {"messages": QUESTION, "max_tokens": 10**9}),
        "max_tokens not a number": (chat, {"messages": QUESTION, "max_tokens": "many"}),
        "max_tokens a float": (legacy, {"prompt": "x", "max_tokens": 2.5}),
        "temperature -1": (chat, {"messages": QUESTION, "temperature": -1}),
        "temperature a string": (legacy, {"prompt": "x", "temperature": "hot"}),
        "top_p 5": (chat, {"messages": QUESTION, "top_p": 5}),
        "top_p 0": (legacy, {"prompt": "x", "top_p": 0}),
        "n 2": (chat, {"messages": QUESTION, "n": 2}),
        "stop not strings": (legacy, {"prompt": "x", "stop": [1]}),
        "logprobs": (legacy, {"prompt": "x", "logprobs": 3}),
        "missing prompt": (legacy, {"max_tokens": 4}),
        "empty prompt": (legacy, {"prompt": ""}),
        "prompt list": (legacy, {"prompt": ["a", "b"]}),
    }
    for name, (path, body) in cases.items():
        status, answer = tiny_server.request("POST", path, body)
        assert status == 422 and answer.get("detail"), (name, status, answer)
    assert "64" in tiny_server.request("POST", chat, cases["absurd max_tokens"][1])[1]["detail"]
    status, answer = tiny_server.request("POST", chat, {"model": "gpt-4", "messages": QUESTION})
    assert status == 404 and "not found" in answer["detail"]
    assert tiny_server.post(legacy, prompt="Hello", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_a_completion_prompt_is_a_string_or_a_list_holding_one(tiny_server):
    """OpenAI's list form of `prompt`: one string in a list is that prompt; several prompts or token
    ids get a 422 that says what is accepted (not "`prompt` is required")."""
    legacy = "/v1/completions"
    as_list = tiny_server.post(legacy, prompt=["The capital of France is"], max_tokens=3)
    as_string = tiny_server.post(legacy, prompt="The capital of France is", max_tokens=3)
    assert as_list["choices"][0]["text"] == as_string["choices"][0]["text"]  # greedy: the same answer
    assert as_list["usage"] == as_string["usage"]
    details = {name: tiny_server.request("POST", legacy, {"prompt": prompt}) for name, prompt in
               {"several": ["a", "b", "c"], "token ids": [1, 2, 3], "a number": 7, "missing": None}.items()}
    assert {status for status, _ in details.values()} == {422}
    assert "holds 3 prompts" in details["several"][1]["detail"]
    assert "one prompt per request" in details["several"][1]["detail"]
    assert "token ids is not supported" in details["token ids"][1]["detail"]
    assert details["a number"][1]["detail"] == "`prompt` must be a non-empty string, or a list holding one, got int 7"
    assert details["missing"][1]["detail"] == "`prompt` is required: a non-empty string, or a list holding one"


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
                                 "top_logprobs", "best_of", "frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_not_a_number_in_any_numeric_field(key, value):
    """JSON `true` / `false` where a number goes (Python's bool is an int: `true` would pass as 1,
    `false` as 0) is a 422 that names the field and says a boolean is not a number."""
    from fastapi import HTTPException

    from river_hf.serve.requests import check_request

    with pytest.raises(HTTPException) as e:
        check_request({"messages": QUESTION, key: value}, chat=True, max_tokens_limit=64)
    spelled = "true" if value else "false"
    assert e.value.status_code == 422 and e.value.detail.startswith(f"`{key}` must be ")
    assert e.value.detail.endswith(f"got {spelled} (a boolean is not a number)"), e.value.detail


def test_a_prompt_of_no_tokens_is_refused():
    from fastapi import HTTPException

    from river_hf.serve.requests import prepare

    class NoTokens:
        def __call__(self, text):
            return {"input_ids": []}

    with pytest.raises(HTTPException) as e:
        prepare({"prompt": " "}, NoTokens(), chat=False, max_tokens_limit=8, model_name=None)
    assert e.value.status_code == 422 and "0 tokens" in e.value.detail


def test_sampling_follows_openai_fields_over_the_model_defaults(tiny):
    from transformers import GenerationConfig

    from river_hf.serve.requests import prepare

    _, tok = tiny
    greedy_model, sampling_model = GenerationConfig(), GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9)

    def settings(config, **fields):
        return prepare({"prompt": "Hi", **fields}, tok, chat=False, max_tokens_limit=64, model_name=None,
                       generation_config=config)

    assert settings(greedy_model).do_sample is False and settings(greedy_model).max_tokens == 64
    assert (settings(sampling_model).temperature, settings(sampling_model).top_p) == (0.6, 0.9)
    assert settings(sampling_model, temperature=0).do_sample is False
    s = settings(greedy_model, temperature=0.7)
    assert (s.do_sample, s.temperature, s.top_p) == (True, 0.7, 1.0)
    assert settings(greedy_model, temperature=0).group() == settings(greedy_model, max_tokens=3).group()
    assert settings(greedy_model, stop="x").group() != settings(greedy_model).group()
    assert settings(greedy_model, seed=1).group() != settings(greedy_model, seed=1).group()  # seeded: alone


def test_stop_strings_end_the_answer_before_them(tiny_server):
    plain = tiny_server.post("/v1/completions", prompt="The colors are")
    text = plain["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    body = tiny_server.post("/v1/completions", prompt="The colors are", stop=[stop, "never-there"])
    assert body["choices"][0]["text"] == text[: text.index(stop)] and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] <= TOKENS
    chunks, _ = tiny_server.stream("/v1/completions", prompt="The colors are", stop=stop)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[: text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_answer_text_holds_back_a_possible_stop_string(tiny):
    from river_hf.serve.requests import AnswerText

    _, tok = tiny
    ids = tok("one two three four").input_ids
    text = AnswerText(tok, stop=(" thr",))
    sent = "".join(text.feed([i]) for i in ids)
    assert sent == "one two" and text.stopped and text.finish(ids) == ""


@pytest.mark.parametrize("kind", ["step", "call", "fifo"])
def test_batching_runs_waiting_requests_together_and_fifo_one_at_a_time(tiny, kind, monkeypatch):
    """``step``: route mode's running batch; ``call``: whole generate calls (what a model the
    running batch cannot serve gets, forced here); ``fifo``: one at a time."""
    from river_hf.serve import scheduler
    from river_hf.serve.app import build_app

    if kind == "call":
        monkeypatch.setattr(scheduler, "unsupported", lambda model: "forced by the test")
    prompts = [" ".join(["word"] * (i + 1)) for i in range(4)]  # different lengths: left padding

    def ask(client, i):
        return client.post("/v1/completions", prompt=prompts[i], max_tokens=4 + i)

    for batching in (kind != "fifo",):
        app = build_app(*tiny, "tiny", batching=batching, max_batch_size=3)
        assert app.state.scheduler.batching == kind
        with serving(app) as client:
            alone = [ask(client, i) for i in range(4)]
            together = _concurrently(lambda i: ask(client, i), 4)
        assert [b["choices"][0]["text"] for b in together] == [b["choices"][0]["text"] for b in alone]
        assert [b["usage"]["completion_tokens"] for b in together] == [4, 5, 6, 7]
        sizes = [b["river"]["batch_size"] for b in together]
        assert all(b["river"]["new_tokens"] == b["usage"]["completion_tokens"] for b in together)
        if kind == "step":
            assert max(sizes) > 1 and max(sizes) <= 3, sizes
            assert all(b["river"]["batching"] == "step" for b in together)
        elif kind == "call":
            assert max(sizes) > 1 and max(sizes) <= 3 and app.state.scheduler.calls < 8, sizes
        else:
            assert sizes == [1] * 4 and app.state.scheduler.calls == 8
            # the last served waited for the three calls before its own
            assert max(b["river"]["queued_seconds"] for b in together) > min(b["river"]["seconds"] for b in together)


# -- SmolLM2-135M: real answers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def river_smollm2():
    """(River SmolLM2-135M at its default settings, tokenizer), as ``river-hf serve`` loads it."""
    from river_hf.serve.app import load_model

    return load_model(MODEL, river_kwargs={}, progress=False)


@pytest.mark.real_model
def test_route_mode_answers_and_a_client_that_leaves_mid_stream(river_smollm2):
    from river_hf.serve.app import build_app

    with serving(build_app(*river_smollm2, MODEL)) as river:
        body = river.chat(QUESTION, model=MODEL)
        assert "Paris" in body["choices"][0]["message"]["content"]
        stats = body["river"]
        assert stats["mode"] == "route" and stats["num_layers"] == 30 and stats["batch_size"] == 1
        assert stats["new_tokens"] == body["usage"]["completion_tokens"] == TOKENS
        assert 0 < stats["mean_exit_layer"] < 30 and stats["decode_tokens_per_s"] > 0

        # a client that leaves mid-stream: its generation is cancelled, the next request is answered
        c = river.connection()
        c.request("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "max_tokens": 400, "stream": True}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        c.sock.close()
        c.close()
        start = time.monotonic()
        assert river.chat(QUESTION, max_tokens=2)["river"]["new_tokens"] == 2 and time.monotonic() - start < 60


@pytest.mark.real_model
def test_concurrent_clients_are_batched_and_each_gets_its_answer_alone(river_smollm2):
    """τ > 1 (River never exits): rows of the running batch equal their answers alone (up to fp32
    order). With τ ≤ 1 each row exits on its own, so a near-tie greedy token may still flip by the
    summation order of batched products (tests/test_serve_running_batch.py checks the mechanics)."""
    from river_hf.serve.app import build_app

    model, _ = river_smollm2
    tau = model.river_config.tau
    model.set_river_tau(2.0)
    try:
        with serving(build_app(*river_smollm2, MODEL)) as river:
            alone = [river.chat([{"role": "user", "content": p}]) for p in PROMPTS]
            together = _concurrently(lambda i: river.chat([{"role": "user", "content": PROMPTS[i]}]), len(PROMPTS))
    finally:
        model.set_river_tau(tau)
    assert [b["choices"][0]["message"]["content"] for b in together] == \
        [b["choices"][0]["message"]["content"] for b in alone]
    assert max(b["river"]["batch_size"] for b in together) > 1
    assert all(b["river"]["new_tokens"] == b["usage"]["completion_tokens"] for b in together)


# -- the real command -------------------------------------------------------------------------------------


class Server(Client):
    """One ``river-hf serve`` subprocess on a free port; ready once its ready line is printed."""

    def __init__(self, model: str, *flags: str):
        self.proc = subprocess.Popen([RIVER_HF, "serve", model, "--port", "0", "--no-progress", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        deadline, line = time.monotonic() + 300, ""
        while time.monotonic() < deadline and "ready on http://" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
        assert "ready on http://" in line, f"server did not start: {line!r} {''.join(self.stderr)[-2000:]}"
        self.ready_line = line
        host, port = line.split("http://", 1)[1].split()[0].split(":")
        super().__init__(host, int(port))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def test_cli_fifo_server_answers_and_stops_cleanly(tiny_folder):
    server = Server(tiny_folder, "--tau", "2", "--backend", "copy", "--fifo")
    try:
        assert "one request at a time" in server.ready_line
        body = server.post("/v1/completions", prompt="Hello", max_tokens=3)
        assert body["usage"]["completion_tokens"] == 3 and body["river"]["batch_size"] == 1
    finally:
        assert server.stop() == 0


@pytest.mark.real_model
def test_lossless_answers_equal_the_plain_transformers_model(smollm2):
    model, tok = smollm2
    server = Server(MODEL, "--lossless", "--continuous-batching")
    try:
        assert "River lossless" in server.ready_line and "batches of up to 8" in server.ready_line
        for i, prompt in enumerate(PROMPTS[:2]):
            messages = [{"role": "user", "content": prompt}]
            inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
            expected = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            body = server.chat(messages)
            assert body["choices"][0]["message"]["content"] == expected
            assert body["river"]["mode"] == "lossless" and body["river"]["acceptance_rate"] is not None
            if i == 0:  # the stream releases each round once the next arrives, cut where generate ended
                chunks, _ = server.stream("/v1/chat/completions", messages=messages)
                assert _content(chunks) == expected and chunks[-1]["river"]["mode"] == "lossless"
    finally:
        assert server.stop() == 0


def test_cli_refuses_a_port_in_use_and_bad_flags_in_one_line(capsys):
    import socket

    from river_hf.cli import main

    def run(*args):
        code = main(["serve", MODEL, *args])
        return code, capsys.readouterr().err

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, err = run("--port", str(s.getsockname()[1]))
    assert code == 2 and "in use" in err and err.count("\n") == 1
    code, err = run("--draft-tokens", "3")
    assert code == 2 and "--lossless" in err
    code, err = run("--draft-schedule", "constant")
    assert code == 2 and "add --lossless" in err and err.count("\n") == 1
    code, err = run("--lossless", "--prefill", "backbone")
    assert code == 2 and err.count("\n") == 1 and "drop --prefill or --lossless" in err
    with pytest.raises(SystemExit):
        main(["serve", MODEL, "--max-batch-size", "0"])
    with pytest.raises(SystemExit):
        main(["serve", MODEL, "--fifo", "--batching"])


def test_generate_batch_is_refused_with_the_reason():
    from transformers import LlamaConfig

    from river_hf import RiverError, RiverForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1)
    model = RiverForCausalLM.from_config(config, tau=0.5, backend="copy", progress=False)
    with pytest.raises(RiverError, match="one exit decision per pass"):
        model.generate_batch(inputs=[[1, 2, 3]])


def test_transformers_serve_loads_a_river_folder_with_trust_remote_code(tmp_path, tiny_folder):
    """``transformers serve FOLDER --trust-remote-code`` on 5.24 loads through its ModelManager,
    which tries ``AutoModelForDecision`` first: the folder's auto_map sends it to River's class;
    without the flag it is the plain model (as documented). transformers 5.25's loader
    (``ModelLoader``, the model in its own process) tries the decision class only for checkpoints
    with a decision head, so it serves the plain model either way. A fresh process: a remote class,
    once loaded, stays registered with the Auto class in that process."""
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM

    folder = tmp_path / "river"
    RiverForCausalLM.from_pretrained(tiny_folder, tau=0.5, backend="copy", progress=False).save_pretrained(
        folder, tokenizer=AutoTokenizer.from_pretrained(tiny_folder))
    script = textwrap.dedent(f"""
        from transformers.cli.serving import model_manager
        from river_hf import RiverForCausalLM
        for trust in (False, True):
            if hasattr(model_manager, "ModelLoader"):  # transformers >= 5.25
                loader = model_manager.ModelLoader(device="cpu", trust_remote_code=trust)
                model, _ = loader.load_model_and_processor({str(folder)!r})
            else:
                manager = model_manager.ModelManager(device="cpu", trust_remote_code=trust, force_model={str(folder)!r})
                model = manager.loaded_models[{str(folder)!r}].model
            print(trust, type(model).__name__, isinstance(model, RiverForCausalLM))
        print(hasattr(model_manager, "ModelLoader"))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split("\n")
    river = "LlamaForCausalLM False" if lines[2] == "True" else "RiverLlamaForCausalLM True"
    assert lines[:2] == ["False LlamaForCausalLM False", f"True {river}"]
