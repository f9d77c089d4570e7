"""Weight-only kernels inside a whole decode step: the fully quantized model with each kernel forced.

One process, one load of the fp32 backbone, shared (the same tensors) by every configuration. Each
configuration is the fully quantized model (``river_mode("exit")``: every decoder layer on its exit
copy, the exit head for every step) with one kernel for every exit Linear and the exit head
(``RiverConfig.backend = exit_head = KERNEL``), or a measured choice (``int4`` / ``int8``: the
fastest kernel per shape as ``KernelTuner`` times it alone, with its weights streamed from memory).
``ort-int4+spin`` is ``ort-int4`` with onnxruntime's pool threads allowed to spin between calls
(``RIVER_HF_ORT_SPINNING=1`` while its sessions are created); every other ORT configuration has
spinning off (the default). It is not in the default list: once its 169 sessions have run, their
workers stay runnable (on the 2-core machine the 1-minute load went from about 10 to 36 in a run
with it), which slows every other configuration of the process and the machine's other work;
name it alone with its reference (``--configs torch-int4,ort-int4+spin``) to see that. A label
ending in ``+fused`` (``int4+fused``, ``torch-int4+fused``) builds that configuration with
``RiverConfig.fuse_projections`` on: q/k/v and gate/up as one product each, 4 kernel calls per
layer instead of 7. Kernels whose library is not installed are left out (listed in the JSON as
``skipped``).

Timing is ``river_hf.timing.compare``: one untimed warm-up of every configuration, then
``--repeats`` rounds in which the reference (``--reference``, default ``torch-int4``: the kernel
the ``int4`` choice took for every shape on this machine before the new kernels existed) runs
next to each configuration (R A R B ..., reversed every other round); the same prompt (HumanEval
``--problem``, chat template) and exactly ``--new-tokens`` new tokens (EOS suppressed) for all;
decode tokens/s median and min-max, speedups per neighbouring pair. Besides the timer's rows the
JSON has, per configuration: the kernel each shape got, the relative error of each kernel on the
real weights (``||copy(x) - W x|| / ||W x||``, x ~ N(0, 1), mean and max over the Linears of a
shape: ``quant.modules.relative_error``), the tuner's µs per call of every candidate per shape
(measured now, not read from kernels.json: ``--tuner-cache`` to reuse a file), the tokens, and the
1-minute load average before and after (``quant.autotune.load_average``: on a shared machine the
speeds are noisy; compare only side-by-side figures of one run).

    python benchmarks/kernel_step.py --model qwen2.5-coder-0.5b --new-tokens 64 --repeats 3 \\
        --out docs/results/kernel_step_qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import statistics
import sys
import time

import torch

#: label -> (backend, exit_head, ORT spinning); a label names a kernel or a measured choice
CONFIGS = {
    "torch-int4": ("torch-int4", "torch-int4", False),
    "int4": ("int4", "int4", False),
    "ort-int4": ("ort-int4", "ort-int4", False),
    "ort-int4+spin": ("ort-int4", "ort-int4", True),
    "ark-int4": ("ark-int4", "ark-int4", False),
    "torch-int8": ("torch-int8", "torch-int8", False),
    "torch-dyn-int8": ("torch-dyn-int8", "torch-dyn-int8", False),
    "ort-int8": ("ort-int8", "ort-int8", False),
    "ark-int8": ("ark-int8", "ark-int8", False),
    "int8": ("int8", "int8", False),
}


@contextlib.contextmanager
def _env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def shell_of(model):
    """A copy of ``model``'s module structure that shares every parameter and buffer tensor (so
    each configuration's River wrapper sits on the very same backbone weights)."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def kernel_rows(report: list[dict]) -> list[dict]:
    """Per shape and kernel: Linears, mean and max relative error on the real weights, tuner µs."""
    groups: dict[tuple, dict] = {}
    for row in report:
        key = (f"{row['in_features']}x{row['out_features']}", row["kernel"], row["name"].startswith("lm_head"))
        g = groups.setdefault(key, {"shape": key[0], "kernel": key[1], "head": key[2], "count": 0, "errors": [],
                                    "us_per_call": row.get("us_per_call")})
        g["count"] += 1
        g["errors"].append(row["relative_error"])
    out = []
    for g in groups.values():
        errors = g.pop("errors")
        out.append({**g, "relative_error_mean": statistics.fmean(errors), "relative_error_max": max(errors)})
    return sorted(out, key=lambda r: (r["head"], r["shape"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--configs", default=",".join(c for c in CONFIGS if c != "ort-int4+spin"),
                    help=f"comma list from {', '.join(CONFIGS)} (default: all but ort-int4+spin); a label "
                         "ending in +fused builds that configuration with fused q/k/v and gate/up products "
                         "(RiverConfig.fuse_projections), e.g. int4+fused")
    ap.add_argument("--reference", default="torch-int4")
    ap.add_argument("--problem", type=int, default=100, help="HumanEval index of the prompt (default 100)")
    ap.add_argument("--new-tokens", type=int, default=64, help="exact new tokens (EOS suppressed)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-interleave", action="store_true",
                    help="each configuration once per round (order alternating) instead of next to the reference")
    ap.add_argument("--tuner-cache", default=None, help="kernels.json to read and write (default: measure now, keep nothing)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    labels = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in labels if c.removesuffix("+fused") not in CONFIGS]
    if unknown or args.reference not in labels:
        ap.error(f"--configs: unknown {unknown}" if unknown else f"--configs must include the reference {args.reference}")
    if args.new_tokens < 2 or args.repeats < 1:
        ap.error("--new-tokens must be >= 2 and --repeats >= 1")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from river_hf import RiverConfig, enable_river
    from river_hf.eval.common import humaneval_problems, save_figure, write_json
    from river_hf.eval.data import humaneval_prompt
    from river_hf.models import encode_prompt, resolve
    from river_hf.quant import KERNELS, KernelTuner, get_backend
    from river_hf.quant.autotune import load_average, machine_id
    from river_hf.quant.external import ORT_SPINNING_ENV
    from river_hf.timing import TokenTimer, compare

    t0 = time.time()
    load_before = _rounded(load_average())
    folder = resolve(args.model, progress=False)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = encode_prompt(tok, humaneval_prompt(humaneval_problems()[args.problem]))["input_ids"]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)
    tuner = KernelTuner(args.tuner_cache or False)

    models, skipped, build_s = {}, {}, {}
    for label in labels:
        fused = label.endswith("+fused")
        backend, head, spin = CONFIGS[label.removesuffix("+fused")]
        kernels = get_backend(backend).candidates
        if len(kernels) == 1 and not kernels[0].available("cpu"):
            skipped[label] = f"{kernels[0].name} is not available here (its library is not installed or fails here)"
            continue
        start = time.perf_counter()
        with _env(ORT_SPINNING_ENV, "1" if spin else None):
            cfg = dataclasses.replace(RiverConfig(), backend=backend, exit_head=head, fuse_projections=fused)
            models[label] = enable_river(shell_of(base), config=cfg, progress=False, tuner=tuner)
        build_s[label] = time.perf_counter() - start
        print(f"built {label} in {build_s[label]:.1f} s", flush=True)
    if args.reference not in models:
        ap.error(f"the reference {args.reference} is not available here: {skipped[args.reference]}")

    tokens: dict[str, list[int]] = {}

    def run(label):
        model = models[label]
        timer = TokenTimer()
        with torch.no_grad(), model.river_mode("exit"):
            timer.reset()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=timer, **gen)
        new = out[0, ids.shape[1]:].tolist()
        tokens[label] = new
        m = timer.measurement(returned_tokens=len(new))
        m.weight_bytes_per_step = model.river_stats["weight_bytes_per_token"]
        return m

    comparison = compare({label: (lambda label=label: run(label)) for label in models}, reference=args.reference,
                         repeats=args.repeats, progress=True, interleave=not args.no_interleave,
                         reference_kind=f"fully quantized model on {args.reference} (today's int4 kernel here)")
    load_after = _rounded(load_average())
    report = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "model": args.model, "problem": f"HumanEval/{args.problem}", "new_tokens": args.new_tokens,
        "mode": "fully quantized (river_mode('exit')), fp32 backbone", "greedy": True, "eos_suppressed": True,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": machine_id("cpu"),
        "load_avg_1m_before": load_before, "load_avg_1m_after": load_after, "cpus": os.cpu_count(),
        "versions": _versions(), "configs": {label: dict(zip(("backend", "exit_head", "ort_spinning"), CONFIGS[label.removesuffix("+fused")]),
                                                    fuse_projections=label.endswith("+fused")) for label in models},
        "skipped": skipped, "build_seconds": build_s,
        "kernels": {label: kernel_rows(m.river_kernel_report) for label, m in models.items()},
        "kernel_names": sorted(KERNELS),
        "protocol": ("river_hf.timing.compare: one untimed warm-up of every configuration, then "
                     f"{args.repeats} rounds " + ("with each configuration once (order reversed every other round)"
                                                  if args.no_interleave else "with the reference next to each "
                                                  "configuration (R A R B ..., reversed every other round)")
                     + f"; one prompt, exactly {args.new_tokens} new tokens"),
        "comparison": comparison.to_dict(),
        "identical_to_reference": {label: tokens[label] == tokens[args.reference] for label in models},
        "tokens": tokens, "wall_seconds": time.time() - t0,
    }
    write_json(args.out, report)
    save_figure(_figure(report), os.path.splitext(args.out)[0] + ".png")
    print(comparison.table())
    print(f"1-minute load average: {load_before} before, {load_after} after ({os.cpu_count()} cores)")
    return 0


def _rounded(load: float | None) -> float | None:
    return None if load is None else round(load, 2)


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "onnxruntime", "auto-round-lib", "optimum-quanto"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _figure(report: dict):
    from river_hf.timing import bar_figure

    return bar_figure(
        report["comparison"]["rows"],
        f"{report['model']} fully quantized, one kernel per run, {report['new_tokens']} tokens; "
        f"1-min load {report['load_avg_1m_before']} / {report['load_avg_1m_after']} on {report['cpus']} cores",
        metric="decode_tokens_per_s", ylabel="decode tokens/s\n(median, min-max over rounds)", figsize=(8, 3.6),
        color=lambda n: "#888" if "torch" in n else "#1f77b4" if n.startswith("ort") else "#2ca02c" if n.startswith("ark")
        else "#ff7f0e")


if __name__ == "__main__":
    raise SystemExit(main())
