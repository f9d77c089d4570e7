"""What the exit layers' prompt kernels buy: a fully quantized prompt pass with and without them.

One process, one model (``RiverForCausalLM.from_pretrained(--model)``, fp32 backbone, the model's
River settings with ``RiverConfig.prompt_kernel`` turned on (it is off by default): the exit Linears whose prompt kernel measured
faster at 128 rows are ``PromptRowsLinear``). In ``river_mode("exit")`` (every layer its exit copy)
each held-out HumanEval prompt (``--problems``, chat template) is read by a one-token ``generate``
call: the prompt pass through every exit layer plus the exit head on the last row, i.e. the time
to the first token. Configurations, in one process on the same weights:

- ``prompt kernel``: as built (calls of 16 rows or more on the prompt kernel);
- ``one-row kernel``: every exit Linear on its one-row kernel (``river_hf.bench_harness.prompt_kernels_off``),
  what the prompt pass ran on before prompt kernels existed.

Timing: one untimed call of each per prompt, then ``--rounds`` rounds, the two configurations in
alternating order (ABBA...), each prompt once per configuration per round; per prompt and
configuration the median and min-max seconds, and the per-round ratio (one-row / prompt kernel)
median and min-max; the first ``--check-tokens`` new tokens of each configuration are compared too (greedy, exit mode: the prompt kernel changes the prompt's K/V by kernel rounding, so they may
differ). The weight bytes of the prompt kernels' copies (memory the feature costs) are reported.
JSON + PNG.

    python benchmarks/probes/prompt_kernel.py --model qwen2.5-coder-0.5b --problems 100-105 --rounds 5 \\
        --out docs/results/prompt_kernel_qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--problems", default="100-105", help="HumanEval problem range (held out: no default was tuned on 100+)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check-tokens", type=int, default=64)
    ap.add_argument("--backend", default="int4", help="exit-layer kernel choice, a measured one (int4 or int8): "
                                                      "prompt kernels are chosen by measurement")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    lo, _, hi = args.problems.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        ap.error(f"--problems {args.problems!r}: expected a HumanEval index or range, e.g. 100 or 100-105")
    if not 0 <= first <= last:
        ap.error(f"--problems {args.problems!r}: expected FIRST-LAST with 0 <= FIRST <= LAST")
    problems = list(range(first, last + 1))
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.check_tokens < 1:
        ap.error("--check-tokens must be >= 1")
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM
    from river_hf.bench_harness import all_modules, prompt_kernels_off
    from river_hf.eval.common import humaneval_problems, write_json
    from river_hf.eval.data import humaneval_prompt
    from river_hf.files import save_figure
    from river_hf.models import encode_prompt, resolve
    from river_hf.quant.autotune import load_average
    from river_hf.quant.modules import PromptRowsLinear, linear_weight_bytes
    from river_hf.cli_args import check_output_path
    from river_hf.errors import RiverError
    from river_hf.quant import get_backend
    from river_hf.river.config import default_config

    every = humaneval_problems()
    if last >= len(every):
        ap.error(f"--problems: HumanEval has problems 0..{len(every) - 1}")
    try:
        check_output_path(args.out)
        config = dataclasses.replace(default_config(args.model), prompt_kernel=True, backend=args.backend)
        if not get_backend(config.backend).measured:
            ap.error(f"the exit layers' kernel choice is {config.backend!r}; prompt kernels need a measured one: "
                     "--backend int4 or int8")
        load_before = load_average()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "prompt_kernel=True has no effect")  # said below, as the error
            model = RiverForCausalLM.from_pretrained(args.model, dtype=torch.float32, progress=False,
                                                     river_config=config)
    except RiverError as e:
        ap.error(str(e))
    wrapped = [m for m in all_modules(model) if isinstance(m, PromptRowsLinear)]
    if not wrapped:
        ap.error("no exit Linear got a prompt kernel here (onnxruntime missing, RIVER_HF_AUTOTUNE=0, or the "
                 "one-row kernels measured faster at 128 rows): nothing to compare")
    tok = AutoTokenizer.from_pretrained(resolve(args.model, progress=False))
    prompts = {every[i]["task_id"]: encode_prompt(tok, humaneval_prompt(every[i]))["input_ids"] for i in problems}
    configs = ("prompt kernel", "one-row kernel")

    def first_token(ids, config):
        with torch.no_grad(), model.river_mode("exit"), \
                (prompt_kernels_off(model) if config == "one-row kernel" else _Null()):
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
            return time.perf_counter() - start

    seconds = {name: {c: [] for c in configs} for name in prompts}
    for name, ids in prompts.items():  # warm-up
        for c in configs:
            first_token(ids, c)
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for name, ids in prompts.items():
            for c in order:
                seconds[name][c].append(first_token(ids, c))
    tokens = {}
    for c in configs:
        with torch.no_grad(), model.river_mode("exit"), (prompt_kernels_off(model) if c == "one-row kernel" else _Null()):
            tokens[c] = {name: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.check_tokens,
                                              do_sample=False, min_new_tokens=args.check_tokens)[0, ids.shape[1]:].tolist()
                         for name, ids in prompts.items()}

    from river_hf.timing import spread

    rows = []
    for name, ids in prompts.items():
        s = seconds[name]
        ratios = [a / b for a, b in zip(s["one-row kernel"], s["prompt kernel"])]
        rows.append({"prompt": name, "prompt_tokens": int(ids.shape[1]),
                     "seconds": {c: spread(s[c], runs=False) for c in configs}, "runs": s,
                     "one_row_over_prompt_kernel": spread(ratios, runs=False),
                     "same_tokens": tokens["prompt kernel"][name] == tokens["one-row kernel"][name]})
    all_ratios = [a / b for row in rows for a, b in zip(row["runs"]["one-row kernel"], row["runs"]["prompt kernel"])]
    report = {
        "command": "python benchmarks/probes/prompt_kernel.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "backend": config.backend, "check_tokens": args.check_tokens,
        "mode": "exit (fully quantized)", "rounds": args.rounds, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "load_avg_1m_before": load_before,
        "prompt_kernels": sorted({r["prompt_kernel"] for r in model.river_kernel_report if r.get("prompt_kernel")}),
        "linears_with_prompt_kernel": len(wrapped),
        "prompt_kernel_weight_bytes": sum(linear_weight_bytes(m.prompt) for m in wrapped),
        "decode_weight_bytes_of_those_linears": sum(linear_weight_bytes(m.decode) for m in wrapped),
        "rows": rows, "ratio_all_rounds": spread(all_ratios, runs=False),
        "load_avg_1m_after": load_average(),
    }
    write_json(args.out, report)
    save_figure(_figure(report), os.path.splitext(args.out)[0] + ".png")
    for row in rows:
        p, o = row["seconds"]["prompt kernel"], row["seconds"]["one-row kernel"]
        print(f"{row['prompt']:>14} {row['prompt_tokens']:4d} tokens: prompt kernel {p['median']:.3f} s "
              f"({p['min']:.3f}-{p['max']:.3f}), one-row kernel {o['median']:.3f} s ({o['min']:.3f}-{o['max']:.3f}), "
              f"ratio {row['one_row_over_prompt_kernel']['median']:.2f} "
              f"({row['one_row_over_prompt_kernel']['min']:.2f}-{row['one_row_over_prompt_kernel']['max']:.2f}), "
              f"same {args.check_tokens} tokens: {row['same_tokens']}")
    a = report["ratio_all_rounds"]
    print(f"all rounds: one-row / prompt kernel {a['median']:.2f} ({a['min']:.2f}-{a['max']:.2f}); prompt kernels' copies "
          f"{report['prompt_kernel_weight_bytes'] / 1e6:.0f} MB beside {report['decode_weight_bytes_of_those_linears'] / 1e6:.0f} MB")
    return 0


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _figure(report: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.38
    for j, (c, colour) in enumerate((("one-row kernel", "#888"), ("prompt kernel", "#1f77b4"))):
        med = [r["seconds"][c]["median"] for r in rows]
        err = [[m - r["seconds"][c]["min"] for m, r in zip(med, rows)], [r["seconds"][c]["max"] - m for m, r in zip(med, rows)]]
        ax.bar([i + (j - 0.5) * width for i in range(len(rows))], med, width, yerr=err, capsize=3, color=colour, label=c)
    ax.set_xticks(range(len(rows)), [f"{r['prompt']}\n{r['prompt_tokens']} tokens" for r in rows], fontsize=7)
    ax.set_ylabel("time to first token, s\n(median, min-max over rounds)")
    ax.set_title(f"{report['model']}, fully quantized prompt pass: exit Linears' prompt kernel "
                 f"({', '.join(report['prompt_kernels'])}) vs one-row kernel", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
