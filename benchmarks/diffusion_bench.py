"""dLLM-Cache speed benchmark: uncached vs cached masked-diffusion generation, side by side.

A random-weight LLaDA-layout model of about 1.1e9 parameters (``build_test_model("llada", "1b")``)
generates ``--gen-length`` tokens after a random ``--prompt-length``-token prompt, uncached and then
with dLLM-Cache at each ``--settings`` entry (Kp,Kr,rho), on the same model and prompt, in one
process. Reported per run: wall seconds, speedup over uncached, generated tokens/s, weight bandwidth
(weight bytes read per forward x forwards / s), counted decoder-layer FLOPs and their ratio to
uncached, and token agreement with the uncached output.

Random weights measure speed only: agreement here says nothing about answer quality (needs real
LLaDA/Dream weights), and a random model's near-uniform predictions make agreement pessimistic.

Writes ``<out>.json``, ``<out>.png`` and ``<out>.md`` (with the exact command), each via a temp file
and ``os.replace``.

    PYTHONPATH=src python benchmarks/diffusion_bench.py --out docs/results/diffusion_llada1b_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

import torch


def parse_settings(text: str) -> list[tuple[int, int, float]]:
    out = []
    for part in text.split(";"):
        kp, kr, rho = part.split(",")
        out.append((int(kp), int(kr), float(rho)))
    return out


def _write(path: str, data: bytes | str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.replace(tmp, path)


def write_results(args, model, outs, stats, settings, n_params, weight_bytes) -> None:
    """Write <out>.json/.png/.md for the runs finished so far (each via a temp file + os.replace)."""
    ref = outs["uncached"]
    runs = []
    for s in [None, *settings]:
        if ("uncached" if s is None else f"Kp={s[0]},Kr={s[1]},rho={s[2]}") not in outs:
            continue
        name = "uncached" if s is None else f"Kp={s[0]},Kr={s[1]},rho={s[2]}"
        done = args.prompt_length + stats[name]["steps"] * args.block_length // (args.steps * args.block_length // args.gen_length)
        agree = (outs[name][:, args.prompt_length : done] == ref[:, args.prompt_length : done]).float().mean().item()
        runs.append({"name": name, "cache": None if s is None else dict(zip(("Kp", "Kr", "rho"), s)),
                     **stats[name], "agreement": agree})  # fmt: skip

    base = runs[0]["seconds"]
    for r in runs:
        r["speedup"] = base / r["seconds"]
        r["cpu_speedup"] = runs[0]["cpu_seconds"] / r["cpu_seconds"]
        r["weight_gb_s"] = weight_bytes * r["steps"] / r["seconds"] / 1e9
        print(f"{r['name']}: speedup {r['speedup']:.2f}x, agreement {r['agreement']:.3f}", flush=True)

    command = "PYTHONPATH=src python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *sys.argv[1:]])
    result = {
        "what": "dLLM-Cache speed, random-weight LLaDA-layout model on CPU (speed only; quality needs real weights)",
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": {"layout": args.layout, "size": args.size, "params": n_params, "weight_bytes": weight_bytes,
                  "dtype": args.dtype, "config": model.config.to_dict()},  # fmt: skip
        "setup": {"blocks_timed": args.blocks or args.gen_length // args.block_length, "prompt_length": args.prompt_length, "gen_length": args.gen_length, "steps": args.steps,
                  "block_length": args.block_length, "batch": 1, "temperature": 0.0, "remasking": "low_confidence",
                  "threads": args.threads, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                  "cpu_count": os.cpu_count(), "load_avg_at_end": os.getloadavg()},  # fmt: skip
        "complete": len(runs) == 1 + len(settings),
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    _write(args.out + ".json", json.dumps(result, indent=2, default=str))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"].replace(",", "\n") for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [r["seconds"] for r in runs], color="tab:blue")
    axes[0].set_ylabel("wall time (s)")
    axes[1].bar(names, [r["speedup"] for r in runs], color="tab:green", label="wall-time speedup")
    axes[1].plot(names, [r["flops_ratio"] for r in runs], "ko--", label="layer-FLOPs ratio")
    axes[1].axhline(3.0, color="red", lw=0.8, ls=":", label="3x target")
    axes[1].set_ylabel("x vs uncached")
    axes[1].legend(fontsize=8)
    axes[2].bar(names, [r["agreement"] for r in runs], color="tab:orange")
    axes[2].set_ylim(0, 1.05)
    axes[2].set_ylabel("token agreement with uncached")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"dLLM-Cache, random-weight {n_params / 1e9:.2f}B LLaDA-layout model, CPU ({args.threads} thread), "
                 f"P={args.prompt_length}, G={args.gen_length}, steps={args.steps}, block={args.block_length} "
                 "(speed only)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    tmp = args.out + ".png.tmp"
    fig.savefig(tmp, dpi=110, format="png")
    os.replace(tmp, args.out + ".png")

    lines = [
        f"# dLLM-Cache speed: random-weight {n_params / 1e9:.2f}B LLaDA-layout model on CPU",
        "",
        "" if result["complete"] else f"**Incomplete: {len(runs)} of {1 + len(settings)} runs finished.**\n",
        "Random-weight **speed** measurement: token agreement with a random model says nothing about",
        "answer quality (that needs real LLaDA/Dream weights, not available offline here).",
        "",
        f"Command ({result['date']}):",
        "",
        f"    {command}",
        "",
        f"Prompt {args.prompt_length} tokens, gen_length {args.gen_length}, steps {args.steps}, block {args.block_length},"
        f" batch 1, greedy, low-confidence remasking, {args.dtype}, torch threads {args.threads}.",
        f"Shared {os.cpu_count()}-core machine with other jobs running (load average at the end:"
        f" {', '.join(f'{x:.1f}' for x in os.getloadavg())}); runs are side by side in one process, so the"
        " ratios are meaningful, absolute seconds less so.",
        "",
        "| run | wall s | speedup (wall) | CPU s | speedup (CPU) | tokens/s | weight GB/s | layer-FLOPs ratio | agreement |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(f"| {r['name']} | {r['seconds']:.1f} | {r['speedup']:.2f}x | {r['cpu_seconds']:.1f} | "
                     f"{r['cpu_speedup']:.2f}x | {r['tokens_per_s']:.2f} | "
                     f"{r['weight_gb_s']:.1f} | {r['flops_ratio']:.2f}x | {r['agreement']:.3f} |")  # fmt: skip
    lines += ["", f"![plot]({os.path.basename(args.out)}.png)", ""]
    _write(args.out + ".md", "\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1b", help="test model size: tiny, small, 1b (default 1b)")
    ap.add_argument("--layout", default="llada", choices=["llada", "llama"])
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=None,
                    help="time only the first N blocks of the schedule (same schedule, fewer steps run)")
    ap.add_argument("--settings", default="50,7,0.25;100,8,0.1;10,3,0.5", help="'Kp,Kr,rho;...'")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (same for every run)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/diffusion_llada1b_cpu", help="output path without extension")
    args = ap.parse_args(argv)

    from river_hf.diffusion import DLLMCacheConfig, build_test_model, generate

    torch.set_num_threads(args.threads)
    settings = parse_settings(args.settings)
    t0 = time.perf_counter()
    model = build_test_model(args.layout, args.size, seed=args.seed, dtype=getattr(torch, args.dtype))
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mask_id = model.config.mask_token_id
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, min(mask_id, model.config.vocab_size) - 1, (1, args.prompt_length), generator=g)
    kw = dict(steps=args.steps, gen_length=args.gen_length, block_length=args.block_length, mask_id=mask_id,
              progress=True, return_stats=True, max_blocks=args.blocks)  # fmt: skip
    print(f"model: {args.layout} {args.size}, {n_params / 1e9:.3f}e9 params, built in {build_s:.0f} s", flush=True)

    # warm-up forward (allocations, thread pools), then the target setting first so a slow cached path
    # shows early in the log; the uncached reference follows, then the other settings.
    with torch.inference_mode():
        model(input_ids=torch.cat([prompt, torch.full((1, args.gen_length), mask_id)], 1))
    outs, stats = {}, {}
    order = [settings[0], None, *settings[1:]]
    for s in order:
        name = "uncached" if s is None else f"Kp={s[0]},Kr={s[1]},rho={s[2]}"
        cache = None if s is None else DLLMCacheConfig(*s)
        c0 = time.process_time()
        res = generate(model, prompt, cache=cache, **kw)
        outs[name], stats[name] = res.sequences, res.stats
        stats[name]["cpu_seconds"] = time.process_time() - c0  # less sensitive to other jobs than wall time
        print(f"{name}: {stats[name]['seconds']:.1f} s, FLOPs ratio {stats[name]['flops_ratio']:.2f}x", flush=True)
        if "uncached" in outs:  # write what is measured so far (a killed run still leaves results)
            write_results(args, model, outs, stats, settings, n_params, weight_bytes)
    print(f"wrote {args.out}.json/.png/.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
