"""Does ``torch.inference_mode()`` make River's small per-op work cheaper than ``torch.no_grad()``?

transformers' ``generate`` runs under ``no_grad``; ``inference_mode`` also skips version counters and
view tracking, which is per-op dispatch work — most of a fully quantized step outside its products
(docs/profile.md). One process, one model, the same prompt and exactly ``--new-tokens`` tokens per
run; for each mode (``--modes``, River router modes), an untimed warm-up of both, then ``--repeats``
rounds of the two, order alternating; per mode the wall time of each run, and the per-round ratio
(no_grad / inference_mode) as median (min-max), and whether the tokens are identical. River's
``CastMemo`` keys on identity alone for inference tensors (they have no version counter); quanto's
int4 kernels fail inside inference mode (they set a version counter); a mode that raises is reported with its error.

    python benchmarks/inference_mode.py --model qwen2.5-coder-0.5b --modes exit,lossless \\
        --new-tokens 64 --repeats 5 --out docs/results/inference_mode_<model>.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--modes", default="exit,lossless")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default=None, help="exit layers' kernel (default: the model's own setting)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.new_tokens < 2 or args.repeats < 1:
        ap.error("--new-tokens must be >= 2 and --repeats >= 1")

    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM, resolve
    from river_hf.eval.common import write_json
    from river_hf.quant.autotune import load_average

    tok = AutoTokenizer.from_pretrained(resolve(args.model, progress=False))
    kwargs = {}
    if args.backend:
        import dataclasses

        from river_hf.river.config import default_config

        kwargs["river_config"] = dataclasses.replace(default_config(args.model), backend=args.backend)
    model = RiverForCausalLM.from_pretrained(args.model, progress=False, **kwargs)
    ids = tok('def fib(n):\n    """Return the n-th Fibonacci number."""\n', return_tensors="pt")
    n = args.new_tokens
    load_before = load_average()

    def run(mode, inference):
        with (torch.inference_mode() if inference else torch.no_grad()), model.river_mode(mode):
            start = time.perf_counter()
            out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return out, time.perf_counter() - start

    report = {"command": "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
              "model": args.model, "new_tokens": n, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "modes": {}}
    for mode in args.modes.split(","):
        a, _ = run(mode, False)
        try:
            b, _ = run(mode, True)
        except RuntimeError as e:  # e.g. quanto's int4 kernels set version counters, which inference tensors lack
            report["modes"][mode] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{mode}: fails inside inference_mode: {e}", flush=True)
            continue
        seconds = {"no_grad": [], "inference_mode": []}
        for r in range(args.repeats):
            for inference in ((False, True) if r % 2 == 0 else (True, False)):
                seconds["inference_mode" if inference else "no_grad"].append(run(mode, inference)[1])
        ratio = [x / y for x, y in zip(seconds["no_grad"], seconds["inference_mode"])]
        report["modes"][mode] = {"seconds": seconds, "identical_tokens": bool(torch.equal(a, b)),
                                 "speedup": {"median": statistics.median(ratio), "min": min(ratio), "max": max(ratio)}}
        s = report["modes"][mode]["speedup"]
        print(f"{mode}: inference_mode / no_grad speedup {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}), "
              f"identical tokens: {report['modes'][mode]['identical_tokens']}", flush=True)
    report["load_avg_1m_before"], report["load_avg_1m_after"] = load_before, load_average()
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
