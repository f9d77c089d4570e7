"""Where a kernel mode is entered, and what it costs: one-token decode steps of the plain model with
its Linears on the backbone's one-row kernel, the mode entered around the whole forward or around
each Linear only.

A ``TorchFunctionMode`` (``RiverFp32Linear``, ``PrepackedLinear``) reroutes only its own Linears'
``F.linear`` calls, but every torch call made inside it (norms, rotary, attention, views) goes
through its Python ``__torch_function__``. One process, one model load (the plain model over
``RiverForCausalLM.from_pretrained(--model)``'s backbone, ``river_hf.plain_model``); a random prompt of
``--prompt-tokens`` tokens is prefilled, then ``--steps`` one-token forward passes are timed
(median). Scopes, alternating in each of ``--rounds`` rounds after one untimed round:

- ``F.linear``: no mode;
- ``whole forward``: the mode entered around every pass;
- ``per Linear``: the mode entered around each Linear (``river_hf.bench_harness.linears_in_mode``,
  the scope River's backbone layers and lossless verifies use).

The mode is river-fp32 where its kernel runs here, else prepacked oneDNN (one row included). JSON + PNG.

    python benchmarks/probes/mode_scope.py --model qwen2.5-coder-0.5b \\
        --out docs/results/epyc-zen1-2core/mode_scope_qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True, help="JSON path (a PNG beside it)")
    args = ap.parse_args(argv)

    from transformers import DynamicCache

    from river_hf import RiverForCausalLM
    from river_hf.bench_harness.output import command_line
    from river_hf.quant.autotune import load_average
    from river_hf.bench_harness import linears_in_mode
    from river_hf.quant.dense import PrepackedLinear
    from river_hf.quant.dense_river import RiverFp32Linear, river_fp32_works
    from river_hf.river.plain import plain_model

    plain = plain_model(RiverForCausalLM.from_pretrained(args.model, progress=False))
    linears = [m for m in plain.modules() if isinstance(m, torch.nn.Linear)]
    kernel = "river-fp32" if river_fp32_works() else "onednn-prepacked"
    mode = RiverFp32Linear(linears) if kernel == "river-fp32" else PrepackedLinear(linears, min_rows=1, max_rows=8)
    ids = torch.randint(100, plain.config.vocab_size // 2, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))

    scopes = {"F.linear": contextlib.nullcontext, "whole forward": lambda: mode,
              "per Linear": lambda: linears_in_mode(linears, mode)}

    def step_seconds(scope) -> float:
        times = []
        with torch.no_grad(), scope():
            cache = DynamicCache(config=plain.config)
            nxt = plain(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(args.steps):
                start = time.perf_counter()
                nxt = plain(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    load_before = load_average()
    for scope in scopes.values():  # untimed round
        step_seconds(scope)
    runs = {name: [] for name in scopes}
    for r in range(args.rounds):
        for name in (list(scopes) if r % 2 == 0 else list(scopes)[::-1]):
            runs[name].append(step_seconds(scopes[name]) * 1e3)
    rows = {name: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "runs_ms": v}
            for name, v in runs.items()}
    report = {"command": command_line(argv), "model": args.model, "kernel": kernel, "prompt_tokens": args.prompt_tokens,
              "steps": args.steps, "rounds": args.rounds, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "load_avg_1m_before": load_before, "load_avg_1m_after": load_average(),
              "step_ms": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for name, row in rows.items():
        print(f"{name:>14}: {row['median_ms']:.1f} ms a step ({row['min_ms']:.1f}-{row['max_ms']:.1f})")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(5, 3))
    names = list(rows)
    ax.bar(names, [rows[n]["median_ms"] for n in names],
           yerr=[[rows[n]["median_ms"] - rows[n]["min_ms"] for n in names], [rows[n]["max_ms"] - rows[n]["median_ms"] for n in names]])
    ax.set_ylabel("ms per one-token step")
    ax.set_title(f"{args.model}: {kernel} mode scope")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
