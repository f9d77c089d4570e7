"""Does growing the KV cache slots in place pay here, and from what length? River's ``RiverCache``
(full-attention slots are ``GrowingLayer``: the new positions copied into buffers with room) against
transformers' ``DynamicCache`` (each step concatenates, a copy of the whole slot per layer), on the
same River model.

One process, one model (``RiverForCausalLM.from_pretrained(--model)``, the model's River settings).
For each ``--modes`` mode (``exit``: fully quantized, ``river``: route mode, ``lossless``) and each
``--new-tokens`` length, one held-out HumanEval prompt (``--problem``, chat template) is decoded
greedily to exactly that many tokens (EOS suppressed by index) with each cache, timed by
``river_hf.timing.compare``: one untimed warm-up each, ``--repeats`` alternating rounds, decode tokens/s
median and min-max, the grow/concatenate ratio per round (``speedup``: "not resolved" when its
min-max holds 1.0). The two caches' tokens are compared (they must be equal: the same values).
JSON + PNG (decode speedup of the growing slots per mode and length; ``--plot-only`` redraws it).

    python benchmarks/probes/kv_growth.py --model qwen2.5-coder-0.5b --modes exit,river --new-tokens 96,1024 \\
        --out docs/results/kv_growth_qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

MODES = {"exit": "exit", "river": "route", "lossless": "lossless"}


def _lengths(text: str, ap) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 2:
        ap.error(f"--new-tokens {text!r}: expected comma-separated token counts >= 2, e.g. 96,1024")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--problem", type=int, default=100, help="HumanEval problem (held out: no default was tuned on 100+)")
    ap.add_argument("--modes", default="exit,river", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--new-tokens", default="96,1024", help="comma-separated decode lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON at --out (no run)")
    args = ap.parse_args(argv)
    if args.plot_only:
        import json

        from river_hf.files import save_figure

        try:
            report = json.loads(open(args.out).read())
            figure = _figure(report)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--plot-only needs a kv_growth report at --out: {e}")
        save_figure(figure, os.path.splitext(args.out)[0] + ".png")
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    lengths = _lengths(args.new_tokens, ap)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    from transformers import AutoTokenizer, DynamicCache

    from river_hf import RiverForCausalLM
    from river_hf.bench_harness import exact_generation
    from river_hf.cli_args import check_output_path
    from river_hf.errors import RiverError
    from river_hf.eval.common import humaneval_problems, write_json
    from river_hf.eval.data import humaneval_prompt
    from river_hf.files import save_figure
    from river_hf.models import encode_prompt, resolve
    from river_hf.quant.autotune import load_average
    from river_hf.timing import compare, measure_generate

    problems = humaneval_problems()
    if not 0 <= args.problem < len(problems):
        ap.error(f"--problem: HumanEval has problems 0..{len(problems) - 1}")
    try:
        check_output_path(args.out)
        load_before = load_average()
        model = RiverForCausalLM.from_pretrained(args.model, dtype=torch.float32, progress=False)
    except RiverError as e:
        ap.error(str(e))
    tok = AutoTokenizer.from_pretrained(resolve(args.model, progress=False))
    inputs = dict(encode_prompt(tok, humaneval_prompt(problems[args.problem])))
    results, tokens_equal = [], {}
    for mode in modes:
        for n in lengths:
            gen, _ = exact_generation(tok, model, n)

            def run(cache_class, mode=mode, gen=gen):
                kwargs = {} if cache_class is None else {"cache": cache_class(config=model.config)}
                with torch.no_grad(), model.river_mode(MODES[mode]):
                    return measure_generate(model, inputs, **gen, **kwargs)

            comparison = compare({"grow (RiverCache)": lambda: run(None),
                                  "concatenate (DynamicCache)": lambda: run(DynamicCache)},
                                 reference="concatenate (DynamicCache)", repeats=args.repeats, bandwidth=False)
            with torch.no_grad(), model.river_mode(MODES[mode]):
                a = model.generate(**inputs, **gen)
                b = model.generate(**inputs, **gen, cache=DynamicCache(config=model.config))
            tokens_equal[f"{mode} {n}"] = bool(torch.equal(a, b))
            for row in comparison.to_dict()["rows"]:
                results.append({"mode": mode, "new_tokens": n, **row})
            print(f"{mode:>8} {n:5d} tokens:\n{comparison.table()}", flush=True)
    report = {
        "command": "python benchmarks/probes/kv_growth.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "prompt": problems[args.problem]["task_id"],
        "prompt_tokens": int(inputs["input_ids"].shape[1]), "repeats": args.repeats,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "load_avg_1m_before": load_before,
        "rows": results, "same_tokens": tokens_equal, "load_avg_1m_after": load_average(),
    }
    write_json(args.out, report)
    save_figure(_figure(report), os.path.splitext(args.out)[0] + ".png")
    if not all(tokens_equal.values()):
        print(f"the two caches gave different tokens: {tokens_equal}", file=sys.stderr)
        return 1
    return 0


def _figure(report: dict):
    """The grown slots' decode speedup over the concatenated ones, per mode and length (median, min-max)."""
    from river_hf.timing_report import bar_figure

    grown = [dict(r, label=f"{r['mode']}, {r['new_tokens']} tokens") for r in report["rows"]
             if r["label"].startswith("grow")]
    return bar_figure(grown, f"{report['model']}: KV slots grown in place vs concatenated",
                      ylabel="decode tok/s, RiverCache / DynamicCache\n(median, min-max over rounds)")


if __name__ == "__main__":
    sys.exit(main())
