"""Peak memory of River with and without backbone offloading (River-LLM's memory claim).

Four configurations, each in its own Python process (so one's memory never counts for another),
same prompt, same number of new tokens, greedy:

    unmodified     the plain transformers model (AutoModelForCausalLM), dense weights.
    fully_4bit     every decoder layer runs its 4-bit exit copy (``river_mode("exit")``); the
                   dense backbone is loaded offloaded (``offload_from=0``) and never read, so
                   what is resident is embeddings/head (dense) + 4-bit decoder layers.
    river          River at --tau, no offload: dense backbone + 4-bit exit layers resident.
    river_offload  River at --tau with ``offload_from=--offload-from``: backbone layers k.. stay
                   on disk (CPU) or in CPU memory (GPU) and are read in only by steps that run them.

Memory, per process (Linux):
    peak_rss_bytes          VmHWM over the whole process (load + exit-layer build + generate).
    peak_rss_generate_bytes VmHWM over ``generate`` only (VmHWM is reset through
                            /proc/self/clear_refs just before it; bytes).
    rss_after_load_bytes    VmRSS once the model is ready.
    peak_gpu_bytes          torch.cuda.max_memory_allocated over the process, on a GPU.
RSS includes touched pages of memory-mapped files (the safetensors checkpoint), so the offload
figures include every page the disk reads brought in while they were mapped.

Every worker runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (``--malloc-mmap-threshold``; 0 keeps
glibc's default): with glibc's default dynamic threshold, the per-layer buffers freed while exit
layers are built from offloaded backbones stay in a fragmented heap instead of going back to the
OS (measured on SmolLM2: about 20 MB kept per layer built, 2 MB with the threshold).

Writes JSON + a PNG bar chart; ratios are taken within one run.

Example (the run in docs/checkpoints.md):
    PYTHONPATH=src python benchmarks/memory_bench.py --model qwen2.5-coder-1.5b --tau 0.9 \
        --offload-from 6 --max-new-tokens 8 --configs river_offload,river,fully_4bit,unmodified \
        --out docs/results/memory_qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ("unmodified", "fully_4bit", "river", "river_offload")
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import river_hf
    from river_hf.models import resolve

    path = resolve(args.model, progress=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "user", "content": args.prompt}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) if tok.chat_template else args.prompt
    inputs = tok(text, return_tensors="pt").to(device)
    rss_start = _status_bytes("VmRSS")

    t0 = time.perf_counter()
    kw = {"dtype": dtype}
    if device != "cpu":
        kw["device_map"] = device
    if args.config == "unmodified":
        model = AutoModelForCausalLM.from_pretrained(path, **kw).eval()
    else:
        offload_from = {"fully_4bit": 0, "river": None, "river_offload": args.offload_from}[args.config]
        model = river_hf.RiverForCausalLM.from_pretrained(
            path, tau=args.tau, offload_from=offload_from, progress=False, **kw
        )
    load_seconds = time.perf_counter() - t0
    rss_after_load = _status_bytes("VmRSS")
    peak_load = _status_bytes("VmHWM")

    reset = _reset_peak_rss()
    gen = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False)
    t0 = time.perf_counter()
    if args.config == "fully_4bit":
        with model.river_mode("exit"):
            out = model.generate(**inputs, **gen)
    else:
        out = model.generate(**inputs, **gen)
    seconds = time.perf_counter() - t0
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    result = {
        "config": args.config,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "load_seconds": load_seconds,
        "generate_seconds": seconds,
        "new_tokens": len(new),
        "tokens_per_s": len(new) / seconds,
        "rss_start_bytes": rss_start,
        "rss_after_load_bytes": rss_after_load,
        "peak_rss_load_bytes": peak_load,
        "peak_rss_generate_bytes": _status_bytes("VmHWM") if reset else None,
        "peak_rss_bytes": max(peak_load, _status_bytes("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        "token_ids": new,
        "text": tok.decode(new, skip_special_tokens=True),
    }
    if device == "cuda":
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    if args.config != "unmodified":
        s = model.river_stats
        result.update(
            tau=model.river_config.tau,
            offload_from=model.river_config.offload_from,
            mean_exit_layer=s.get("mean_exit_layer"),
            exit_fraction=s.get("exit_fraction"),
            exit_layer_counts=s.get("exit_layer_counts"),
            num_layers=s.get("num_layers"),
            build_seconds=model.river_build_seconds,
        )
    return result


def plot(results: list[dict], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in results]
    gib = 1024**3
    whole = [r["peak_rss_bytes"] / gib for r in results]
    gen = [(r["peak_rss_generate_bytes"] or 0) / gib for r in results]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.2 for i in x], whole, 0.4, label="peak RSS, whole process")
    ax.bar([i + 0.2 for i in x], gen, 0.4, label="peak RSS, during generate")
    if any("peak_gpu_bytes" in r for r in results):
        ax.plot(list(x), [r.get("peak_gpu_bytes", 0) / gib for r in results], "ko", label="peak GPU memory")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def write_summary(args, argv, results: list[dict]) -> dict:
    """Ratios and token match over ``results``; writes STEM.json and STEM.png when --out is given."""
    by = {r["config"]: r for r in results}
    ratios = {}
    if "river" in by and "river_offload" in by:
        for key in ("peak_rss_bytes", "peak_rss_generate_bytes", "peak_gpu_bytes"):
            a, b = by["river_offload"].get(key), by["river"].get(key)
            if a and b:
                ratios[f"river_offload_over_river_{key}"] = a / b
    if "unmodified" in by:
        ref = by["unmodified"]["token_ids"]
        for r in results:
            n = min(len(ref), len(r["token_ids"]))
            r["token_match_vs_unmodified"] = sum(a == b for a, b in zip(ref[:n], r["token_ids"][:n])) / max(n, 1)
    summary = {
        "command": "PYTHONPATH=src python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model": args.model,
        "tau": args.tau,
        "offload_from": args.offload_from,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "prompt": args.prompt,
        "malloc_mmap_threshold": args.malloc_mmap_threshold or None,
        "ratios": ratios,
        "results": results,
    }
    if args.out:
        stem = Path(args.out)
        stem.parent.mkdir(parents=True, exist_ok=True)
        json_path, png_path = stem.parent / f"{stem.name}.json", stem.parent / f"{stem.name}.png"
        tmp = stem.parent / f".{stem.name}.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, json_path)
        plot(results, png_path,
             f"{args.model}, tau={args.tau}, offload_from={args.offload_from}, {args.max_new_tokens} new tokens")
    return ratios


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--tau", type=float, default=0.93)
    p.add_argument("--offload-from", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--dtype", default=None, help="weight dtype (default: float32 on CPU, bfloat16 on GPU); a dtype "
                   "other than the checkpoint's makes transformers copy the weights into anonymous memory "
                   "instead of mapping the file")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--malloc-mmap-threshold", type=int, default=65536,
                   help="MALLOC_MMAP_THRESHOLD_ (bytes) for every worker process; 0 keeps glibc's default")
    p.add_argument("--out", default=None, help="output stem (writes STEM.json and STEM.png)")
    p.add_argument("--worker", dest="config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.config:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0

    from tqdm.auto import tqdm

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown configuration(s) {bad}; choose from {', '.join(CONFIGS)}")
    results = []
    for config in tqdm(configs, desc="configurations", unit="process"):
        cmd = [sys.executable, __file__, "--worker", config, "--model", args.model, "--tau", str(args.tau),
               "--offload-from", str(args.offload_from), "--max-new-tokens", str(args.max_new_tokens),
               "--prompt", args.prompt] + (["--dtype", args.dtype] if args.dtype else [])
        env = dict(os.environ)
        if args.malloc_mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
        if res.returncode != 0 or not lines:
            print(res.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"configuration {config} failed (exit {res.returncode})")
        r = json.loads(lines[-1][len("RESULT "):])
        results.append(r)
        gib = 1024**3
        gen = r["peak_rss_generate_bytes"]
        write_summary(args, argv, results)  # partial results survive an interrupted run
        tqdm.write(f"{config:14s} peak RSS {r['peak_rss_bytes'] / gib:6.2f} GiB (generate {gen / gib if gen else float('nan'):6.2f} GiB)"
                   f"  {r['tokens_per_s']:6.2f} tokens/s  mean exit layer {r.get('mean_exit_layer')}")

    print(json.dumps(write_summary(args, argv, results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
