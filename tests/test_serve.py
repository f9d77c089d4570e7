"""``river-hf serve`` on SmolLM2-135M: two real servers per module (River, River lossless) on free
loopback ports, in subprocesses started by the real command; OpenAI-style requests over HTTP
(stdlib ``http.client``), streaming and not, 4 concurrent clients, bad requests, a client that
leaves mid-stream, and a clean stop. Plus what ``transformers serve`` does with a saved River
folder, and the refusal of continuous batching.
"""

from __future__ import annotations

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


class Server:
    """One ``river-hf serve`` subprocess; ``url`` once its ready line is printed."""

    def __init__(self, *flags: str):
        self.proc = subprocess.Popen([RIVER_HF, "serve", MODEL, "--port", "0", "--no-progress", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        self.host = self.port = None
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline and "ready on http://" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
        assert "ready on http://" in line, f"server did not start: {line!r} {''.join(self.stderr)[-2000:]}"
        self.host, self.port = line.split("http://", 1)[1].split()[0].split(":")
        self.port = int(self.port)

    def connection(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None) -> tuple[int, dict]:
        c = self.connection()
        data = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
        c.request(method, path, data, {"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        c.close()
        return r.status, json.loads(raw)

    def chat(self, messages, **fields) -> dict:
        status, body = self.request("POST", "/v1/chat/completions",
                                    {"messages": messages, "max_tokens": TOKENS, "temperature": 0, **fields})
        assert status == 200, body
        return body

    def stream(self, messages, **fields) -> list[dict]:
        """The chunks of a streamed chat completion (``data: [DONE]`` excluded)."""
        c = self.connection()
        c.request("POST", "/v1/chat/completions",
                  json.dumps({"messages": messages, "max_tokens": TOKENS, "temperature": 0, "stream": True, **fields}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        chunks = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
        c.close()
        return chunks

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def servers():
    """(River server, River lossless server), started together; stopped (and checked) at the end."""
    river, lossless = Server(), Server("--lossless")
    try:
        river.wait_ready()
        lossless.wait_ready()
        yield river, lossless
    finally:
        codes = [s.stop() for s in (river, lossless)]
    assert codes == [0, 0], f"the servers did not stop cleanly: {codes}"


def _content(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def _plain_answer(smollm2, messages) -> str:
    model, tok = smollm2
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.real_model
def test_models_lists_the_served_name_as_soon_as_ready(servers):
    river, _ = servers
    status, body = river.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["status"] == {"value": "loaded"}
    assert river.request("GET", "/health") == (200, {"status": "ok"})


@pytest.mark.real_model
def test_chat_completion_json_and_stream_carry_the_calls_river_stats(servers):
    river, _ = servers
    body = river.chat(QUESTION, model=MODEL)
    assert body["model"] == MODEL and "Paris" in body["choices"][0]["message"]["content"]
    stats = body["river"]
    assert stats["mode"] == "route" and stats["num_layers"] == 30
    assert stats["new_tokens"] == body["usage"]["completion_tokens"] == TOKENS
    assert 0 < stats["mean_exit_layer"] < 30 and stats["decode_tokens_per_s"] > 0 and stats["queued_seconds"] >= 0

    chunks = river.stream(QUESTION)
    assert _content(chunks) == body["choices"][0]["message"]["content"]  # greedy: the same answer
    assert [("river" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]  # the last chunk only
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["river"]["new_tokens"] == TOKENS

    status, legacy = river.request("POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
    assert status == 200 and legacy["river"]["new_tokens"] == legacy["usage"]["completion_tokens"] == 4


@pytest.mark.real_model
def test_four_concurrent_clients_each_get_their_answer_alone(servers):
    river, _ = servers
    alone = [river.chat([{"role": "user", "content": p}])["choices"][0]["message"]["content"] for p in PROMPTS]
    results: dict[int, dict] = {}

    def client(i):
        results[i] = river.chat([{"role": "user", "content": PROMPTS[i]}])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [results[i]["choices"][0]["message"]["content"] for i in range(len(PROMPTS))] == alone
    # each answer carries its own call's statistics; the calls ran one at a time, so some waited
    assert all(results[i]["river"]["new_tokens"] == results[i]["usage"]["completion_tokens"] for i in results)
    assert max(results[i]["river"]["queued_seconds"] for i in results) > 0.1


@pytest.mark.real_model
def test_bad_requests_get_a_4xx_with_a_message_and_the_server_keeps_serving(servers):
    river, _ = servers
    path = "/v1/chat/completions"
    cases = {
        "malformed JSON": '{"messages": [',
        "missing messages": {"max_tokens": 4},
        "empty messages": {"messages": []},
        "negative max_tokens": {"messages": QUESTION, "max_tokens": -3},
        "absurd max_tokens": {"messages": QUESTION, "max_tokens": 10**9},
        "max_tokens not a number": {"messages": QUESTION, "max_tokens": "many"},
        "unknown model": {"model": "gpt-4", "messages": QUESTION, "max_tokens": 4},
    }
    for name, body in cases.items():
        status, answer = river.request("POST", path, body)
        assert 400 <= status < 500 and answer.get("detail"), (name, status, answer)
    assert "8192" in str(river.request("POST", path, cases["absurd max_tokens"])[1]["detail"])

    # a client that leaves mid-stream: its generation is cancelled, the next request is answered
    c = river.connection()
    c.request("POST", path, json.dumps({"messages": QUESTION, "max_tokens": 400, "stream": True}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    c.sock.close()
    c.close()
    start = time.monotonic()
    body = river.chat(QUESTION, max_tokens=2)
    assert body["river"]["new_tokens"] == 2 and time.monotonic() - start < 60
    assert river.proc.poll() is None


@pytest.mark.real_model
def test_lossless_answers_equal_the_plain_transformers_model(servers, smollm2):
    _, lossless = servers
    for i, prompt in enumerate(PROMPTS[:2]):
        messages = [{"role": "user", "content": prompt}]
        expected = _plain_answer(smollm2, messages)
        body = lossless.chat(messages)
        assert body["choices"][0]["message"]["content"] == expected
        assert body["river"]["mode"] == "lossless" and body["river"]["acceptance_rate"] is not None
        if i == 0:  # the stream releases each round once the next arrives, cut where generate ended
            chunks = lossless.stream(messages)
            assert _content(chunks) == expected and chunks[-1]["river"]["mode"] == "lossless"


def test_cli_refuses_continuous_batching_and_a_port_in_use_in_one_line(capsys):
    import socket

    from river_hf.cli import main

    def run(*args):
        code = main(["serve", MODEL, *args])
        return code, capsys.readouterr().err

    code, err = run("--continuous-batching")
    assert code == 2 and err.count("\n") == 1 and "one exit decision per pass" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, err = run("--port", str(s.getsockname()[1]))
    assert code == 2 and "in use" in err and err.count("\n") == 1
    code, err = run("--draft-tokens", "3")
    assert code == 2 and "--lossless" in err
    code, err = run("--lossless", "--prefill", "backbone")
    assert code == 2 and err.count("\n") == 1 and "drop --prefill or --lossless" in err


def test_generate_batch_is_refused_with_the_reason():
    from transformers import LlamaConfig

    from river_hf import RiverError, RiverForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1)
    model = RiverForCausalLM.from_config(config, tau=0.5, backend="copy", progress=False)
    with pytest.raises(RiverError, match="one exit decision per pass"):
        model.generate_batch(inputs=[[1, 2, 3]])


def test_transformers_serve_loads_a_river_folder_with_trust_remote_code(tmp_path, tiny_folder):
    """``transformers serve FOLDER --trust-remote-code`` loads through its ModelManager, which tries
    ``AutoModelForDecision`` first: the folder's auto_map sends it to River's class. Without the flag
    it is the plain model (as documented). A fresh process: a remote class, once loaded, stays
    registered with the Auto class in that process."""
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM

    folder = tmp_path / "river"
    RiverForCausalLM.from_pretrained(tiny_folder, tau=0.5, backend="copy", progress=False).save_pretrained(
        folder, tokenizer=AutoTokenizer.from_pretrained(tiny_folder))
    script = textwrap.dedent(f"""
        from transformers.cli.serving.model_manager import ModelManager
        from river_hf import RiverForCausalLM
        for trust in (False, True):
            manager = ModelManager(device="cpu", trust_remote_code=trust, force_model={str(folder)!r})
            model = manager.loaded_models[{str(folder)!r}].model
            print(trust, type(model).__name__, isinstance(model, RiverForCausalLM))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n")[:2] == ["False LlamaForCausalLM False", "True RiverLlamaForCausalLM True"]
