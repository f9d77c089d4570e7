"""Why dLLM-Cache's wall speedup on CPU stays below its layer-FLOPs ratio: GEMM speed per row count.

    PYTHONPATH=src python benchmarks/diffusion_gemm_rows.py [--size 300m] [--threads 2] [--repeats 5]

The layer-FLOPs ratio of ``benchmarks/diffusion_bench.py`` assumes every matrix product runs at the
same FLOP rate. An uncached denoising step multiplies every weight matrix by all ``prompt + gen``
rows (256 in the benchmark's setting); a cached partial step by the few response rows it
recomputes (rho x gen = 32 at rho = 0.25) and, for the V-verify, the V projection by the ``gen``
rows (128). On a CPU a product with 32 rows runs at a lower FLOP rate than one with 256 (the
weights are streamed for fewer FLOPs; fewer rows to block over), so the same FLOPs take longer.

For each distinct Linear shape of the random LLaDA-layout model this times ``F.linear`` at 32, 64,
128 and 256 rows (median of ``--repeats`` rounds of 20 calls, rounds in alternating shape order,
one process) and reports GFLOP/s and the *row efficiency* ``rate(M) / rate(256)``, weighted by
each shape's share of a decoder layer's FLOPs. The wall speedup the cache can reach with these
kernels is about the FLOPs ratio times the efficiency at its row count. Writes JSON next to the
diffusion results (``docs/results/diffusion_gemm_rows_<size>_cpu.json``, temp file + rename).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROWS = (32, 64, 128, 256)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="300m", help="test model size of river_hf.diffusion.build_test_model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="calls per timed round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 3:
        ap.error("--repeats must be >= 3")
    from river_hf.diffusion import build_test_model

    torch.set_num_threads(args.threads)
    model = build_test_model("llada", args.size, seed=0)
    layer0 = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".0." in f".{n}."]
    counts: dict[tuple, int] = {}
    for lin in layer0:  # the Linears of one decoder layer (the head is timed apart: its row count is the block's)
        counts[tuple(lin.weight.shape)] = counts.get(tuple(lin.weight.shape), 0) + 1
    del model
    weights = {shape: torch.randn(*shape) for shape in counts}
    inputs = {(shape, m): torch.randn(m, shape[1]) for shape in counts for m in ROWS}
    times: dict[tuple, list[float]] = {key: [] for key in inputs}
    keys = list(inputs)
    for key in keys:  # warm-up
        for _ in range(3):
            torch.nn.functional.linear(inputs[key], weights[key[0]])
    for rnd in range(args.repeats):
        for key in (keys if rnd % 2 == 0 else keys[::-1]):
            x, w = inputs[key], weights[key[0]]
            t = time.perf_counter()
            for _ in range(args.calls):
                torch.nn.functional.linear(x, w)
            times[key].append((time.perf_counter() - t) / args.calls)
    rows = []
    for (shape, m), ts in times.items():
        med = statistics.median(ts)
        rows.append({"shape": list(shape), "per_layer": counts[shape], "rows": m, "seconds_median": med,
                     "seconds_runs": ts, "gflop_s": 2 * m * shape[0] * shape[1] / med / 1e9})
    rate = {(tuple(r["shape"]), r["rows"]): r["gflop_s"] for r in rows}
    flops = {shape: counts[shape] * shape[0] * shape[1] for shape in counts}
    total = sum(flops.values())
    efficiency = {m: sum(flops[s] / total * rate[(s, m)] / rate[(s, 256)] for s in counts) for m in ROWS}
    report = {"command": "python " + " ".join(sys.argv), "size": args.size, "threads": args.threads,
              "repeats": args.repeats, "calls": args.calls, "torch": torch.__version__, "rows": rows,
              "row_efficiency_vs_256": efficiency,
              "note": "row efficiency = FLOP rate at M rows / FLOP rate at 256 rows, weighted by each shape's "
                      "share of a decoder layer's FLOPs"}
    out = args.out or f"docs/results/diffusion_gemm_rows_{args.size}_cpu.json"
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, out)
    for r in rows:
        print(f"{tuple(r['shape'])} x{r['per_layer']} M={r['rows']:4d}: {r['gflop_s']:6.1f} GFLOP/s "
              f"({1e3 * r['seconds_median']:.2f} ms, {min(r['seconds_runs']) * 1e3:.2f}-{max(r['seconds_runs']) * 1e3:.2f})")
    print("row efficiency vs 256 rows:", {m: round(e, 2) for m, e in efficiency.items()})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
