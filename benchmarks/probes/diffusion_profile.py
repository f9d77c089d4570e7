"""Where a dLLM-Cache step spends its time: torch-profiler breakdown per step kind, GEMM rates per row count.

    PYTHONPATH=src python benchmarks/probes/diffusion_profile.py [--size 1b] [--prompt-length 128] [--threads 2]

On the random-weight LLaDA-layout test model (``river_hf.diffusion.build_test_model``) this profiles
(``torch.profiler``, input shapes recorded) ``--repeats`` forwards of each step kind with the LM head
over ``--head-rows`` block positions (16 by default: the average number of still-masked positions of a
32-token block at one commit per step):

* ``uncached``: the unmodified forward over all ``P + G`` positions;
* ``full``: the cache's full refresh (the unmodified layers plus the feature copies);
* ``verify``: a V-verify step of (Kp, Kr, rho) = (50, 7, 0.25) (V for all ``G`` response rows, Q/K/O and
  the FFN for the ``rho * G`` selected rows);
* ``response``: a response refresh (all ``G`` response rows recomputed).

Each step kind's self CPU time is split into: the LM head (the product whose output width is the
vocabulary), the other matrix products grouped by their row count (with GFLOP/s), attention
(``scaled_dot_product_attention``) and everything else. Forwards of the kinds alternate from round to
round after one warm-up round; times are medians over rounds. Two derived figures answer where the gap
between wall speedup and FLOPs ratio comes from: ``gemm_efficiency`` (each row count's GFLOP/s over the
uncached forward's) and ``verify_if_uncached_rate`` (the V-verify step's time if all its products ran at
the uncached forward's GFLOP/s, everything else as measured).

Writes ``docs/results/diffusion_profile_<size>_p<P>_cpu.json`` (temp file + rename). The profiler adds a
little time per op; ratios taken in one run are what to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from river_hf.diffusion import DLLMCacheConfig, build_test_model
from river_hf.diffusion.cache import attach_cache
from river_hf.eval.common import write_json

def classify(events, vocab: int) -> dict:
    """Self CPU ms per category and GEMM FLOPs per row count, from the profiler events of one forward."""
    out: dict[str, float] = {"head_ms": 0.0, "attention_ms": 0.0, "other_ms": 0.0}
    gemm: dict[int, dict[str, float]] = {}
    for e in events:
        ms = e.self_cpu_time_total / 1e3
        shapes = e.input_shapes or []
        if e.key in ("aten::mm", "aten::addmm") and len(shapes) >= 2:
            (m, k), (_, n) = shapes[-2], shapes[-1]  # mm: [x, w]; addmm: [bias, x, w]
            if n == vocab:
                out["head_ms"] += ms
                continue
            g = gemm.setdefault(m, {"ms": 0.0, "gflop": 0.0, "calls": 0})
            g["ms"] += ms
            g["gflop"] += 2 * m * k * n * e.count / 1e9
            g["calls"] += e.count
        elif "scaled_dot_product" in e.key:
            out["attention_ms"] += ms
        else:
            out["other_ms"] += ms
    out["gemm"] = {str(m): {**g, "gflop_s": g["gflop"] / (g["ms"] / 1e3) if g["ms"] else None}
                   for m, g in sorted(gemm.items())}  # fmt: skip
    out["gemm_ms"] = sum(g["ms"] for g in gemm.values())
    out["total_ms"] = out["gemm_ms"] + out["head_ms"] + out["attention_ms"] + out["other_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1b")
    ap.add_argument("--prompt-length", type=int, default=128)
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--head-rows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = args.out or f"docs/results/diffusion_profile_{args.size}_p{args.prompt_length}_cpu.json"
    torch.set_num_threads(args.threads)
    model = build_test_model("llada", args.size, seed=0).eval()
    cfg = model.config
    p, g = args.prompt_length, args.gen_length
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.mask_token_id - 1, (1, p + g), generator=gen)
    x[:, p:] = cfg.mask_token_id
    keep = torch.arange(p, p + args.head_rows)
    cache_cfg = DLLMCacheConfig(50, 7, 0.25, small_batch_linear=False)

    def forward():
        return model(input_ids=x, logits_to_keep=keep).logits

    times: dict[str, list[dict]] = {k: [] for k in ("uncached", "full", "verify", "response")}

    def profiled(kind, rnd):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            forward()
        if rnd:  # round 0 warms up
            times[kind].append(classify(prof.key_averages(group_by_input_shape=True), cfg.vocab_size))

    def cached(rnd):
        with attach_cache(model, cache_cfg, p, None) as fc:
            for kind, before in (("full", -1), ("verify", 0), ("response", 6)):
                fc.step = before  # the step counter decides the kind: step % Kp, step % Kr
                fc.next_step()
                assert fc.kind == kind, (fc.kind, kind)
                profiled(kind, rnd)

    with torch.inference_mode():
        for rnd in range(args.repeats + 1):
            parts = [lambda: profiled("uncached", rnd), lambda: cached(rnd)]
            for part in parts if rnd % 2 == 0 else parts[::-1]:
                part()
            print(f"round {rnd}/{args.repeats} done", flush=True)

    def med(kind, key):
        return statistics.median(r[key] for r in times[kind])

    summary = {}
    for kind, runs in times.items():
        rows = sorted({m for r in runs for m in r["gemm"]}, key=int)
        summary[kind] = {
            **{k: med(kind, k) for k in ("total_ms", "gemm_ms", "head_ms", "attention_ms", "other_ms")},
            "gemm": {m: {"ms": statistics.median(r["gemm"][m]["ms"] for r in runs),
                         "gflop": runs[0]["gemm"][m]["gflop"], "calls": runs[0]["gemm"][m]["calls"],
                         "gflop_s": statistics.median(r["gemm"][m]["gflop_s"] for r in runs)} for m in rows},
            "total_ms_runs": [r["total_ms"] for r in runs],
        }  # fmt: skip
    full_rows = str(p + g)
    base_rate = summary["uncached"]["gemm"][full_rows]["gflop_s"]
    for kind in summary:
        for m, gm in summary[kind]["gemm"].items():
            gm["efficiency_vs_uncached"] = gm["gflop_s"] / base_rate
    v = summary["verify"]
    gemm_at_base = sum(gm["gflop"] for gm in v["gemm"].values()) / base_rate * 1e3
    derived = {
        "uncached_gemm_gflop_s": base_rate,
        "verify_speedup_measured": summary["uncached"]["total_ms"] / v["total_ms"],
        "verify_if_uncached_rate_ms": v["total_ms"] - v["gemm_ms"] + gemm_at_base,
        "verify_speedup_if_uncached_rate": summary["uncached"]["total_ms"] / (v["total_ms"] - v["gemm_ms"] + gemm_at_base),
        "verify_layer_flops_ratio": sum(gm["gflop"] for gm in summary["uncached"]["gemm"].values())
        / sum(gm["gflop"] for gm in v["gemm"].values()),
        "head_share": {k: s["head_ms"] / s["total_ms"] for k, s in summary.items()},
    }  # fmt: skip
    result = {
        "what": "torch-profiler breakdown of one dLLM-Cache forward per step kind (self CPU ms, medians)",
        "command": "PYTHONPATH=src python benchmarks/probes/diffusion_profile.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "setup": {"size": args.size, "prompt_length": p, "gen_length": g, "head_rows": args.head_rows,
                  "threads": args.threads, "repeats": args.repeats, "cache": [50, 7, 0.25],
                  "small_batch_linear": False, "torch": torch.__version__, "load_avg_at_end": os.getloadavg()},
        "steps": summary,
        "derived": derived,
    }  # fmt: skip
    write_json(out, result)
    for kind, s in summary.items():
        gm = ", ".join(f"{m} rows {x['ms']:.0f} ms @ {x['gflop_s']:.0f} GF/s" for m, x in s["gemm"].items())
        print(f"{kind}: {s['total_ms']:.0f} ms = head {s['head_ms']:.0f} + GEMM {s['gemm_ms']:.0f} ({gm}) + "
              f"attention {s['attention_ms']:.0f} + other {s['other_ms']:.0f}")
    print(json.dumps(derived, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
