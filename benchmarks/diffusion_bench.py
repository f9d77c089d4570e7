"""dLLM-Cache speed benchmark: uncached vs cached masked-diffusion generation, repeated in alternating order.

A random-weight LLaDA-layout model (``--size 1b``: about 1.1e9 parameters; ``--size 300m``: about
0.3e9; see ``river_hf.diffusion.modeling.SIZES``) generates ``--gen-length`` tokens after a random
``--prompt-length``-token prompt, uncached and with dLLM-Cache at each ``--settings`` entry
(Kp,Kr,rho), on the same model and prompt, in one process.

Timing goes through the project's side-by-side timer, ``river_hf.timing.compare`` (reference:
uncached): its untimed warm-up call of every setting (here the short warm-up: two forwards over the
full sequence length, one block), then ``--repeats`` rounds; in each, uncached runs next to every
cached setting (U A U B ..., reversed on odd rounds; ``--no-interleave``: every setting once per
round, alternating forward / reversed order), so a slow drift of the shared machine's load hits all
settings alike; each speedup is taken against the neighbouring uncached run and reported as median
and min-max, as everywhere in river-hf. One
timed unit is one whole ``generate`` call; the timer gets its denoising-loop seconds, all generated
tokens counted as decode tokens (no TTFT: the answer is final only at the end).

Reported per setting: every run's wall seconds (``seconds_runs``; uncached has one per neighbour) and CPU seconds, their median and
min-max spread, the speedup over uncached (median and min-max of the per-pair ratios), two counted
FLOPs ratios (uncached / cached): ``flops_ratio`` over the decoder layers (projections + attention's
QK^T and AV) and ``model_flops_ratio`` over the whole model (layers + the LM head at the positions it
actually runs on), the *overhead share* ``1 - wall_speedup / ratio`` against each (the part of the
FLOPs saving that wall time does not see), and token agreement with uncached. The whole-model
ratio is the one wall time should be held to (the head runs every step, cached or not). A
comparison is "not resolved" when the speedup range straddles the threshold (1x for "faster",
``--target`` for the target, ``--flops-share`` x a FLOPs ratio), i.e. when the spreads overlap.

Random weights measure speed only: agreement here says nothing about answer quality (needs real
LLaDA/Dream weights), and a random model's near-uniform predictions make agreement pessimistic.

Writes ``<out>.json``, ``<out>.png`` and ``<out>.md`` (with the exact command and the timing protocol)
after every round, each atomically, so a stopped run leaves the rounds it finished.

    PYTHONPATH=src python benchmarks/diffusion_bench.py                       # 1b, prompt 128
    PYTHONPATH=src python benchmarks/diffusion_bench.py --size 300m
    PYTHONPATH=src python benchmarks/diffusion_bench.py --prompt-length 1024  # long prompt
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch

from river_hf.bench_harness.diffusion_settings import parse_settings, report_line, setting_name
from river_hf.bench_harness.rounds import range_verdict as verdict
from river_hf.diffusion.cli import SMALL_BATCH_LINEAR
from river_hf.eval.common import atomic_write
from river_hf.timing import Measurement, compare, memory_bandwidth_gb_s, spread

DEFAULT_SETTINGS = "50,7,0.25;100,8,0.1;25,5,0.25"


TIMING_PROTOCOL = {
    "timer": "river_hf.timing.compare",
    "reference": "uncached",
    "warmup": "one untimed short run of every setting first (two forwards over the full length, one block)",
    "unit": "one generate call; wall seconds of the denoising loop",
    "statistic": "median and min-max over rounds; speedup = uncached seconds of the neighbouring uncached run / "
                 "setting seconds, per pair (partial results before the timer returns: median uncached / median "
                 "setting, range min uncached / max setting .. max uncached / min setting)",
}


def timing_order(interleave: bool) -> str:
    return ("uncached next to every setting (U A U B ..., reversed on odd rounds)" if interleave
            else "every setting once per round, alternating forward / reversed order")


def generated_tokens(args, steps: int) -> int:
    """Answer tokens of the blocks a run of ``steps`` denoising steps covered (batch 1)."""
    return steps * args.block_length // (args.steps * args.block_length // args.gen_length)


def summarize(runs: dict[str, list[dict]], outs: dict[str, torch.Tensor], args, comparison=None) -> list[dict]:
    """Per-setting summary of the runs so far (``runs[name]`` = one stats dict per timed run; uncached
    runs next to every setting when the timer interleaves).

    ``comparison``: the finished :class:`river_hf.timing.Comparison`, whose per-pair speedups (each
    setting against its neighbouring uncached run) are then the ones reported; before it exists
    (partial results) the speedup is median uncached / median setting with the extreme-pairs range,
    which contains the per-pair one."""
    p = args.prompt_length
    ref = outs["uncached"]
    cached = [r for name, r in runs.items() if name != "uncached"]
    rounds_done = min(len(r) for r in cached) if cached else len(runs["uncached"])
    base = spread([r["seconds"] for r in runs["uncached"]], runs=False)
    rows = []
    for name, rounds in runs.items():
        if name != "uncached":
            rounds = rounds[:rounds_done]
        wall = [r["seconds"] for r in rounds]
        cpu = [r["cpu_seconds"] for r in rounds]
        w = spread(wall, runs=False)
        done = p + generated_tokens(args, rounds[0]["steps"])
        agreement = (outs[name][:, p:done] == ref[:, p:done]).float().mean().item()
        if comparison is not None:
            ratios = list(comparison.row(name)["speedup"]["runs"])
            sp = spread(ratios, runs=False)
            speedup, lo, hi = sp["median"], sp["min"], sp["max"]
        else:
            ratios = None
            speedup, lo, hi = base["median"] / w["median"], base["min"] / w["max"], base["max"] / w["min"]
        speedup_range = None if name == "uncached" else [lo, hi]
        flops_ratio = rounds[0]["flops_ratio"]
        model_ratio = rounds[0]["model_flops_ratio"]
        row = {
            "name": name,
            "cache": None if name == "uncached" else rounds[0]["cache"],
            "repeats": rounds_done,
            "runs": len(rounds),
            "seconds_runs": wall,
            "seconds": w,
            "cpu_seconds_runs": cpu,
            "cpu_seconds": spread(cpu, runs=False),
            "steps": rounds[0]["steps"],
            "tokens_per_s": (done - p) / w["median"],
            "steps_per_s": rounds[0]["steps"] / w["median"],
            "speedup": speedup,
            "speedup_range": speedup_range,
            "speedup_runs": ratios,
            "speedup_rule": "timer: per neighbouring pair" if comparison is not None else "partial: medians",
            "cpu_speedup": statistics.median(r["cpu_seconds"] for r in runs["uncached"]) / statistics.median(cpu),
            "flops_ratio": flops_ratio,
            "overhead_share": 1 - speedup / flops_ratio if flops_ratio else None,
            "model_flops_ratio": model_ratio,
            "model_overhead_share": 1 - speedup / model_ratio if model_ratio else None,
            "layer_flops": rounds[0]["layer_flops"],
            "head_flops": rounds[0]["head_flops"],
            "model_flops": rounds[0]["model_flops"],
            "agreement": agreement,
            "same_tokens_every_round": all(torch.equal(r["tokens"], rounds[0]["tokens"]) for r in rounds),
        }
        kinds = rounds[0]["step_seconds"]
        row["step_seconds_median"] = {k: statistics.median(r["step_seconds"][k] for r in rounds) for k in kinds}
        if name != "uncached":
            row["refresh_counts"] = rounds[0]["refresh_counts"]
            row["small_batch_linear_used"] = rounds[0]["small_batch_linear_used"]
            if "small_batch_linear_timing" in rounds[0]:
                row["small_batch_linear_timing"] = rounds[0]["small_batch_linear_timing"]
            row["faster_than_uncached"] = verdict(*speedup_range, 1.0)
            row["meets_target"] = verdict(*speedup_range, args.target)
            row["meets_flops_share"] = verdict(*speedup_range, args.flops_share * flops_ratio)
            row["meets_model_flops_share"] = verdict(*speedup_range, args.flops_share * model_ratio)
        rows.append(row)
    return rows


def size_text(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"


def write_results(args, model, rows, info, timer: dict | None = None) -> None:
    """Write <out>.json/.png/.md for the rounds finished so far (``timer``: the finished
    comparison's ``to_dict()``, stored as it came)."""
    command = "PYTHONPATH=src python " + " ".join(shlex.quote(a) for a in ["benchmarks/diffusion_bench.py", *args.argv])
    layout = "LLaDA-layout" if args.layout == "llada" else "Llama-layout (Dream-like)"
    rounds = min(r["repeats"] for r in rows)
    result = {
        "what": f"dLLM-Cache speed, random-weight {layout} model on CPU (speed only; quality needs real weights)",
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": {"layout": args.layout, "size": args.size, **info, "dtype": args.dtype,
                  "config": model.config.to_dict()},  # fmt: skip
        "setup": {"prompt_length": args.prompt_length, "gen_length": args.gen_length, "steps": args.steps,
                  "block_length": args.block_length, "blocks_timed": args.blocks or args.gen_length // args.block_length,
                  "batch": 1, "temperature": 0.0, "remasking": "low_confidence", "threads": args.threads,
                  "small_batch_linear": args.small_batch_linear, "target": args.target, "flops_share": args.flops_share,
                  "order": "warm-up of every setting, then rounds: " + timing_order(args.interleave),
                  "timing_protocol": {**TIMING_PROTOCOL, "order": timing_order(args.interleave)},
                  "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                  "cpu_count": os.cpu_count(), "load_avg_at_end": os.getloadavg()},  # fmt: skip
        "rounds_done": rounds,
        "complete": rounds == args.repeats,
        "runs": rows,
    }
    if timer is not None:
        result["timer"] = timer
    atomic_write(args.out + ".json", json.dumps(result, indent=2, default=str) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"].replace(",", "\n") for r in rows]
    xs = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    med = [r["seconds"]["median"] for r in rows]
    axes[0].bar(xs, med, color="tab:blue", alpha=0.6, label="median")
    for i, r in enumerate(rows):
        axes[0].plot([i] * len(r["seconds_runs"]), r["seconds_runs"], "k.", ms=5)
    axes[0].set_ylabel("wall time (s); dots = rounds")
    lo = [r["speedup"] - r["speedup_range"][0] if r["speedup_range"] else 0 for r in rows]
    hi = [r["speedup_range"][1] - r["speedup"] if r["speedup_range"] else 0 for r in rows]
    axes[1].bar(xs, [r["speedup"] for r in rows], yerr=[lo, hi], capsize=3, color="tab:green", alpha=0.7,
                label="wall speedup (median, range)")  # fmt: skip
    axes[1].plot(xs, [r["flops_ratio"] for r in rows], "ko--", label="layer-FLOPs ratio")
    axes[1].plot(xs, [r["model_flops_ratio"] for r in rows], "ms-", label="whole-model FLOPs ratio")
    axes[1].axhline(args.target, color="red", lw=0.8, ls=":", label=f"{args.target:g}x target")
    axes[1].set_ylabel("x vs uncached")
    axes[1].legend(fontsize=7)
    axes[2].bar(xs, [r["agreement"] for r in rows], color="tab:orange")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_ylabel("token agreement with uncached")
    for ax in axes:
        ax.set_xticks(list(xs), names, fontsize=7)
    fig.suptitle(f"dLLM-Cache, random-weight {size_text(info['params'])} {layout} model, CPU ({args.threads} thread{'s' if args.threads != 1 else ''}), "
                 f"P={args.prompt_length}, G={args.gen_length}, steps={args.steps}, block={args.block_length}, "
                 f"{rounds} rounds (speed only)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    atomic_write(args.out + ".png", buf.getvalue())

    lines = [
        f"# dLLM-Cache speed: random-weight {size_text(info['params'])} {layout} model on CPU",
        "",
        "" if result["complete"] else f"**Incomplete: {rounds} of {args.repeats} rounds finished.**\n",
        "Random-weight **speed** measurement: token agreement with a random model says nothing about",
        "answer quality (that needs real LLaDA/Dream weights, not available offline here).",
        "",
        f"Command ({result['date']}):",
        "",
        f"    {command}",
        "",
        f"Prompt {args.prompt_length} tokens, gen_length {args.gen_length}, steps {args.steps}, block {args.block_length}"
        + (f" (timed: the first {args.blocks} blocks, {rows[0]['steps']} steps)," if args.blocks else ",") +
        f" batch 1, greedy, low-confidence remasking, {args.dtype}, torch threads {args.threads}"
        f", SmallBatchLinear {args.small_batch_linear}. Warm-up of every setting, then {rounds}"
        f" rounds ({timing_order(args.interleave)}), timed by `{TIMING_PROTOCOL['timer']}`.",
        f"Shared {os.cpu_count()}-core machine (load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}).",
        ("Speedup: median [min-max] of the per-pair ratios neighbouring uncached seconds / setting seconds;"
         if result["complete"] else "Speedup (partial run): median uncached / median setting seconds [extreme pairs];") +
        " \"not resolved\" ="
        " the range straddles the threshold. FLOPs ratios (uncached / cached, counted): whole model = decoder layers"
        " (projections + attention QK^T and AV) + the LM head at the positions it runs on, the bound wall time should"
        " be held to; layer = decoder layers only. Overhead share = 1 - wall speedup / FLOPs ratio.",
        "",
        f"Steps/s next to the weight bytes they read (every step reads all weights but the embedding table:"
        f" {info['step_weight_bytes'] / 1e9:.2f} GB) as a share of this machine's STREAM triad GB/s"
        f" ({info['bandwidth_gb_s']:.1f} GB/s, `river_hf.timing.stream_bandwidth`: a sustained-bandwidth benchmark, not a limit).",
        "",
        "| run | wall s median [min-max] | speedup [range] | steps/s (weight GB/s, share) | CPU s median |"
        " whole-model FLOPs ratio (overhead share) | layer-FLOPs ratio (overhead share) |"
        f" agreement | faster than uncached | >= {args.target:g}x | >= {args.flops_share:g} x whole-model ratio |"
        f" >= {args.flops_share:g} x layer ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["seconds"]
        cached = r["name"] != "uncached"
        overhead = f" ({r['overhead_share']:.2f})" if cached else ""
        model_overhead = f" ({r['model_overhead_share']:.2f})" if cached else ""
        speedup = f"{r['speedup']:.2f}x" + (f" [{r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f}]" if cached else "")
        lines.append(
            f"| {r['name']} | {s['median']:.4g} [{s['min']:.4g}-{s['max']:.4g}] | {speedup} | "
            f"{r['steps_per_s']:.3g} ({r['steps_per_s'] * info['step_weight_bytes'] / 1e9:.1f} GB/s, "
            f"{r['steps_per_s'] * info['step_weight_bytes'] / 1e9 / info['bandwidth_gb_s']:.0%}) | "
            f"{r['cpu_seconds']['median']:.4g} | {r['model_flops_ratio']:.2f}x{model_overhead} | "
            f"{r['flops_ratio']:.2f}x{overhead} | {r['agreement']:.3f} | {r.get('faster_than_uncached', '-')} | "
            f"{r.get('meets_target', '-')} | {r.get('meets_model_flops_share', '-')} | {r.get('meets_flops_share', '-')} |"
        )
    kinds = ["full", "prompt", "response", "verify"]
    lines += [
        "",
        "Where the time goes: median wall seconds per step kind (forward + commit; count in parentheses;"
        " full = uncached forward or full refresh, prompt = prompt refresh + V-verify, response = response"
        " refresh, verify = V-verify only), and the SmallBatchLinear decision for the partial steps.",
        "",
        "| run | " + " | ".join(kinds) + " | SmallBatchLinear |",
        "|---|" + "---|" * (len(kinds) + 1),
    ]
    for r in rows:
        counts = r.get("refresh_counts") or {"full": r["steps"]}
        cells = []
        for k in kinds:
            sec = r["step_seconds_median"].get(k)
            cells.append("-" if sec is None else f"{sec:.3g} s ({counts.get(k, 0)} steps, {sec / counts[k]:.3g} s each)")
        t = r.get("small_batch_linear_timing")
        kernel = "-" if r["name"] == "uncached" else ("used" if r.get("small_batch_linear_used") else "not used") + (
            f" (measured {t['rows']} rows of {t['shape'][0]}->{t['shape'][1]}: torch {t['us_per_call']['torch']:.0f} µs,"
            f" (W @ x.T).T {t['us_per_call']['small-batch']:.0f} µs)" if t else "")
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {kernel} |")
    lines += ["", f"![plot]({os.path.basename(args.out)}.png)", ""]
    atomic_write(args.out + ".md", "\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1b", help="test model size: 1b (~1.1e9), 300m (~0.3e9), small, tiny (default 1b)")
    ap.add_argument("--layout", default="llada", choices=["llada", "llama"])
    ap.add_argument("--prompt-length", type=int, default=128, help="prompt tokens (default 128; >= 1024 for long prompts)")
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=None,
                    help="time only the first N blocks of the schedule (same schedule, fewer steps run)")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS,
                    help=f"'Kp,Kr,rho[,auto|on|off];...' (default {DEFAULT_SETTINGS}); the 4th field overrides --small-batch-linear")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds, alternating order (>= 3, default 3)")
    ap.add_argument("--target", type=float, default=4.0, help="wall speedup to check against (default 4)")
    ap.add_argument("--flops-share", type=float, default=0.85,
                    help="also check wall speedup >= this share of the layer-FLOPs ratio (default 0.85)")
    ap.add_argument("--small-batch-linear", default="auto", choices=list(SMALL_BATCH_LINEAR),
                    help="cached settings' partial steps under SmallBatchLinear: auto (default, measured), on, off")
    ap.add_argument("--no-interleave", dest="interleave", action="store_false",
                    help="run uncached once per round instead of next to every setting (fewer runs; the "
                         "speedups then compare runs further apart in time)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (same for every run)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bandwidth-gb-s", type=float, default=None,
                    help="this machine's STREAM triad GB/s (default: measured, river_hf.timing.stream_bandwidth)")
    ap.add_argument("--out", default=None,
                    help="output path without extension (default docs/results/diffusion_<layout><size>[_p<P>]_cpu)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the arguments this run was made with
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (a median and a spread need them)")
    if args.out is None:
        suffix = "" if args.prompt_length == 128 else f"_p{args.prompt_length}"
        args.out = f"docs/results/diffusion_{args.layout}{args.size}{suffix}_cpu"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    from river_hf.diffusion import DLLMCacheConfig, build_test_model, generate

    torch.set_num_threads(args.threads)
    settings = parse_settings(args.settings, args.small_batch_linear)
    t0 = time.perf_counter()
    model = build_test_model(args.layout, args.size, seed=args.seed, dtype=getattr(torch, args.dtype))
    embedding = model.get_input_embeddings().weight
    if embedding is model.get_output_embeddings().weight:  # tied: the LM head reads it every step
        embedding = None
    info = {"params": sum(p.numel() for p in model.parameters()),
            # every step (cached ones too: V-verify touches every Linear) reads all weights but the
            # embedding table, of which it gathers only P + G rows
            "step_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding),
            "bandwidth_gb_s": args.bandwidth_gb_s or memory_bandwidth_gb_s(),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "build_seconds": time.perf_counter() - t0}  # fmt: skip
    mask_id = model.config.mask_token_id
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, min(mask_id, model.config.vocab_size) - 1, (1, args.prompt_length), generator=g)
    kw = dict(steps=args.steps, gen_length=args.gen_length, block_length=args.block_length, return_stats=True,
              progress=True)  # fmt: skip
    caches = {setting_name(s, args.small_batch_linear): None if s is None else DLLMCacheConfig(*s[:3], small_batch_linear=SMALL_BATCH_LINEAR[s[3]])
              for s in [None, *settings]}  # fmt: skip
    print(f"model: {args.layout} {args.size}, {info['params'] / 1e9:.3f}e9 params, built in {info['build_seconds']:.0f} s",
          flush=True)  # fmt: skip

    blocks = args.gen_length // args.block_length
    runs: dict[str, list[dict]] = {name: [] for name in caches}
    outs: dict[str, torch.Tensor] = {}
    timed = {"round": None, "written": 0}  # round: set by the timer's on_round right before each timed call

    def runner(name):
        def run():
            rnd, timed["round"] = timed["round"], None
            if rnd is None:
                # the timer's untimed warm-up call: two forwards over the full length (a full
                # refresh, then a partial step), not a whole generation
                generate(model, prompt, cache=caches[name], steps=2 * blocks, gen_length=args.gen_length,
                         block_length=args.block_length, max_blocks=1)  # fmt: skip
                return None
            c0 = time.process_time()
            res = generate(model, prompt, cache=caches[name], max_blocks=args.blocks, **kw)
            stats = {**res.stats, "cpu_seconds": time.process_time() - c0, "tokens": res.sequences}
            runs[name].append(stats)
            outs.setdefault(name, res.sequences)
            print(f"round {rnd + 1}/{args.repeats} {name}: {stats['seconds']:.2f} s", flush=True)
            tokens = generated_tokens(args, stats["steps"])
            return Measurement(new_tokens=tokens, seconds=stats["seconds"], ttft_s=0.0, decode_tokens=tokens,
                               decode_s=stats["seconds"], decode_steps=stats["steps"],
                               weight_bytes_per_step=info["step_weight_bytes"])  # fmt: skip
        return run

    def on_round(rnd, name):
        timed["round"] = rnd
        if rnd > timed["written"]:  # the first run of a round: the rounds before it are done
            timed["written"] = rnd
            write_results(args, model, summarize(runs, outs, args), info)

    comparison = compare({name: runner(name) for name in caches}, reference="uncached", repeats=args.repeats,
                         bandwidth=False, on_round=on_round, interleave=args.interleave,
                         reference_kind="uncached generation, same model and prompt")  # fmt: skip
    rows = summarize(runs, outs, args, comparison)
    write_results(args, model, rows, info, timer=comparison.to_dict())
    print("\n".join(report_line(r, args.target) for r in rows))
    print(f"wrote {args.out}.json/.png/.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
