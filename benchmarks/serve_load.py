"""Bounded load test of three OpenAI-compatible servers of one model, on 127.0.0.1 only.

Servers, started one after the other (never two at once, so they do not share the CPU), each on a
free loopback port, stopped by this script:

- ``plain``: ``transformers serve FOLDER`` (transformers' own server on the unmodified model: the
  folder ``river_hf.resolve(MODEL)`` converted, fp32 on CPU);
- ``plain-cb``: the same with ``--continuous-batching`` (transformers' paged-attention continuous
  batching of the unmodified model);
- ``river``: ``river-hf serve MODEL`` (River route mode, the model's default settings; waiting
  requests with the same sampling settings run as one ``generate`` batch);
- ``river-fifo``: ``river-hf serve MODEL --fifo`` (one request at a time; not in the default list);
- ``lossless``: ``river-hf serve MODEL --lossless`` (always one request at a time).

Each gets one untimed warm-up request, then exactly ``--requests`` streamed chat completions
(greedy, ``--max-tokens`` new tokens at most, prompts cycled from ``PROMPTS``) sent by
``--clients`` client threads, each sending its next request when its previous one ends. Every
phase stops by itself: no new request after ``--time-limit`` seconds per server (unsent ones are
counted as errors), and each request times out at the limit. Per server: requests, errors,
latency p50/p95 (request sent to last byte, s), TTFT p50/p95 (to the first content chunk, s),
throughput (completion tokens of all requests / wall time of the phase, tokens/s; the usage the
stream reports, else the answer text's tokens by the model's own tokenizer: transformers serve streams no usage) and, for the
River servers, the mean of the per-call ``river`` figures (decode tokens/s, mean exit layer or
acceptance rate, seconds queued, requests per batch). JSON (with the command) + PNG.

    python benchmarks/serve_load.py --model smollm2-135m --requests 32 --clients 4 --max-tokens 64 \\
        --out docs/results/serve_load_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVERS = ("plain", "plain-cb", "river", "river-fifo", "lossless")
DEFAULT_SERVERS = ("plain-cb", "river", "lossless")
PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Name three colors and one fruit of each color.",
    "Explain in two sentences what a hash table is.",
    "What is 17 times 23?",
    "Write a haiku about the sea.",
    "List the first five planets from the sun.",
    "How do I reverse a list in Python?",
)
HOST = "127.0.0.1"
COLORS = {"plain": "gray", "plain-cb": "black", "river": "tab:blue", "river-fifo": "tab:cyan", "lossless": "tab:green"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(kind: str, model: str, port: int) -> list[str]:
    """The command line of server ``kind`` on ``port`` (loopback only)."""
    bin_dir = Path(sys.executable).parent
    if kind in ("plain", "plain-cb"):
        from river_hf import resolve

        return [str(bin_dir / "transformers"), "serve", resolve(model, progress=False), "--host", HOST, "--port",
                str(port), "--device", "cpu", "--dtype", "float32",
                *(["--continuous-batching"] if kind == "plain-cb" else [])]
    flags = {"lossless": ["--lossless"], "river-fifo": ["--fifo"]}.get(kind, [])
    return [str(bin_dir / "river-hf"), "serve", model, "--host", HOST, "--port", str(port), "--device", "cpu",
            "--no-progress", *flags]


def wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> float:
    """Poll GET /v1/models until it answers 200; returns the seconds it took. Raises RuntimeError
    when the server exits or does not answer within ``timeout`` s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            c = http.client.HTTPConnection(HOST, port, timeout=5)
            c.request("GET", "/v1/models")
            if c.getresponse().status == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer within {timeout} s")


def one_request(port: int, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One streamed greedy chat completion; latency, TTFT, completion tokens, the ``river`` key."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True})
    start = time.perf_counter()
    out = {"prompt": prompt, "error": None, "ttft": None, "completion_tokens": 0, "river": None, "text": "",
           "chunks": 0}
    try:
        c = http.client.HTTPConnection(HOST, port, timeout=max(timeout, 1.0))
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
        else:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = str(chunk["error"])
                    break
                delta = (chunk.get("choices") or [{}])[0].get("delta", {})
                if delta.get("content"):
                    out["text"] += delta["content"]
                    out["chunks"] += 1
                    if out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - start
                if chunk.get("usage"):
                    out["completion_tokens"] = chunk["usage"]["completion_tokens"]
                if "river" in chunk:
                    out["river"] = chunk["river"]
        c.close()
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["latency"] = time.perf_counter() - start
    return out


def load_phase(port: int, n_requests: int, clients: int, max_tokens: int, time_limit: float) -> dict:
    """``n_requests`` requests from ``clients`` threads; nothing is sent after ``time_limit`` s."""
    todo: queue.Queue = queue.Queue()
    for i in range(n_requests):
        todo.put(PROMPTS[i % len(PROMPTS)])
    results: list[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = start + time_limit

    def client() -> None:
        while time.perf_counter() < deadline:
            try:
                prompt = todo.get_nowait()
            except queue.Empty:
                return
            res = one_request(port, prompt, max_tokens, deadline - time.perf_counter())
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=time_limit + 30)
    wall = time.perf_counter() - start
    unsent = n_requests - len(results)
    return {"wall_seconds": wall, "results": results, "unsent": unsent}


def _pct(values: list[float], q: float):
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(phase: dict, count_tokens=None) -> dict:
    """Per-server figures of a load phase; ``count_tokens(text) -> int`` counts the completion tokens of
    a server whose stream reports no usage (transformers serve), else its content chunks are counted."""
    ok = [r for r in phase["results"] if r["error"] is None]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    # a server whose stream sends no usage (transformers serve): its answer text re-tokenized
    counted_by = "usage" if all(r["completion_tokens"] for r in ok) else (
        "the model's tokenizer" if count_tokens else "content chunks")
    tokens = sum(r["completion_tokens"] if counted_by == "usage" else
                 count_tokens(r["text"]) if count_tokens else r["chunks"] for r in ok)
    out = {
        "requests": len(phase["results"]) + phase["unsent"],
        "answered": len(ok),
        "errors": len(phase["results"]) - len(ok) + phase["unsent"],
        "error_messages": sorted({r["error"] for r in phase["results"] if r["error"]})[:5],
        "wall_seconds": phase["wall_seconds"],
        "completion_tokens": tokens, "tokens_counted_by": counted_by,
        "throughput_tokens_per_s": tokens / phase["wall_seconds"] if phase["wall_seconds"] > 0 else None,
        "latency_p50_s": _pct(lat, 0.5), "latency_p95_s": _pct(lat, 0.95),
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
        # greedy: every answer to one prompt should be the same text; the first one seen is kept
        "answers": {p: next(r["text"] for r in ok if r["prompt"] == p) for p in sorted({r["prompt"] for r in ok})},
    }
    rivers = [r["river"] for r in ok if r["river"]]
    if rivers:
        def mean(key):
            vals = [r[key] for r in rivers if r.get(key) is not None]
            return statistics.fmean(vals) if vals else None

        out["river"] = {k: mean(k) for k in ("decode_tokens_per_s", "mean_exit_layer", "acceptance_rate",
                                             "tokens_per_verify", "queued_seconds", "seconds", "batch_size")}
        out["river"]["mode"] = rivers[0].get("mode")
    return out


def token_counter(model: str):
    """``text -> number of tokens`` with the model's own tokenizer (no special tokens added)."""
    from transformers import AutoTokenizer

    from river_hf import resolve

    tok = AutoTokenizer.from_pretrained(resolve(model, progress=False))
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def run_server(kind: str, args) -> dict:
    port = free_port()
    cmd = server_command(kind, args.model, port)
    log = open(Path(args.out).with_suffix(f".{kind}.log"), "w") if args.keep_logs else subprocess.DEVNULL
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        ready = wait_ready(proc, port, args.start_timeout)
        print(f"[serve_load] {kind}: ready in {ready:.1f} s on port {port}; warm-up ...", file=sys.stderr, flush=True)
        warm = one_request(port, PROMPTS[0], args.max_tokens, args.time_limit)
        if warm["error"]:
            raise RuntimeError(f"{kind}: the warm-up request failed: {warm['error']}")
        print(f"[serve_load] {kind}: {args.requests} requests from {args.clients} clients ...", file=sys.stderr, flush=True)
        summary = summarize(load_phase(port, args.requests, args.clients, args.max_tokens, args.time_limit),
                            count_tokens=token_counter(args.model))
        summary.update(command=" ".join(cmd[1:]), ready_seconds=ready)
        return summary
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not subprocess.DEVNULL:
            log.close()


def plot(report: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from river_hf.files import save_figure

    kinds = [k for k in SERVERS if k in report["servers"]]
    rows = [report["servers"][k] for k in kinds]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(kinds, [r["throughput_tokens_per_s"] or 0 for r in rows], color=[COLORS[k] for k in kinds])
    ax1.set_ylabel("completion tokens/s, all clients")
    ax1.set_title(f"throughput, {report['clients']} clients")
    x = range(len(kinds))
    ax2.bar([i - 0.2 for i in x], [r["latency_p50_s"] or 0 for r in rows], width=0.4, label="p50")
    ax2.bar([i + 0.2 for i in x], [r["latency_p95_s"] or 0 for r in rows], width=0.4, label="p95")
    ax2.set_xticks(list(x), kinds)
    ax2.set_ylabel("request latency (s)")
    ax2.set_title(f"latency, {report['max_tokens']} tokens max")
    ax2.legend()
    errors = ", ".join(f"{k}: {r['errors']} errors" for k, r in zip(kinds, rows))
    fig.suptitle(f"{report['model']}: {report['requests']} requests per server ({errors})"
                 + (" - SMOKE RUN" if report.get("smoke") else ""))
    fig.tight_layout()
    save_figure(fig, png)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--servers", default=",".join(DEFAULT_SERVERS), help=f"comma list of {', '.join(SERVERS)}")
    p.add_argument("--requests", type=int, default=32, help="requests per server")
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds of load per server, at most")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to be ready")
    p.add_argument("--smoke", action="store_true", help="label the result a smoke run (not a measurement)")
    p.add_argument("--keep-logs", action="store_true", help="write each server's output next to --out")
    p.add_argument("--out", required=True, help="JSON path (the PNG is written next to it)")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in SERVERS]
    if unknown or args.requests < 1 or args.clients < 1 or args.max_tokens < 1 or args.time_limit <= 0:
        p.error(f"bad arguments (unknown servers {unknown}; counts must be >= 1, the time limit > 0)")

    from river_hf.eval.common import versions
    from river_hf.files import write_json

    report = {"command": "python benchmarks/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "smoke": args.smoke, "model": args.model, "requests": args.requests, "clients": args.clients,
              "max_tokens": args.max_tokens, "time_limit_s": args.time_limit, "host": HOST,
              "date": time.strftime("%Y-%m-%d"), "cpu_count": os.cpu_count(),
              "load_average_at_start": os.getloadavg()[0], "versions": versions(), "servers": {}}
    for kind in kinds:
        report["servers"][kind] = run_server(kind, args)
        s = report["servers"][kind]
        print(f"[serve_load] {kind}: {s['answered']}/{s['requests']} answered, {s['errors']} errors, "
              f"{s['throughput_tokens_per_s']:.2f} tokens/s, latency p50 {s['latency_p50_s']:.2f} s "
              f"p95 {s['latency_p95_s']:.2f} s", file=sys.stderr, flush=True)
    for base in ("plain", "plain-cb"):
        ref = report["servers"].get(base, {})
        for kind, s in report["servers"].items():
            if kind in ("plain", "plain-cb"):
                continue
            if ref.get("throughput_tokens_per_s") and s.get("throughput_tokens_per_s"):
                s[f"throughput_vs_{base.replace('-', '_')}"] = s["throughput_tokens_per_s"] / ref["throughput_tokens_per_s"]
            if ref.get("answers"):  # same prompt, greedy: the answers the unmodified model gives
                same = [p for p, text in s["answers"].items() if ref["answers"].get(p) == text]
                s[f"answers_equal_to_{base.replace('-', '_')}"] = f"{len(same)}/{len(s['answers'])}"
    write_json(args.out, report)
    plot(report, str(Path(args.out).with_suffix(".png")))
    print(json.dumps({k: {m: v for m, v in s.items() if m not in ("error_messages", "command", "answers")}
                      for k, s in report["servers"].items()}, indent=1))
    return 0 if all(s["errors"] == 0 for s in report["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
