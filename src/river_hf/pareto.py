"""``river-hf pareto``: River-LLM's central comparison, throughput against accuracy, per exit strategy.

In one process, on one model and the same problems, every point uses the same exit rule (state
transition similarity against τ, after ``min_layer`` backbone layers) and the same head; only
what the layers after the exit do differs (:mod:`river_hf.river.strategies`: River's exit layers,
batching recompute, SkipDecode, state propagation, KV mask). Points: the unmodified model, the
fully quantized model (every layer its exit copy), and each strategy at each τ.

Per point:

* free-running accuracy: HumanEval pass@1 and GSM8K exact match on the first N problems of each
  (greedy, chat template, :mod:`river_hf.eval.tasks`), with the mean exit layer of those runs;
* decode tokens/s from the shared timer (:func:`river_hf.bench.run_bench`: fixed token counts,
  warm-up, the reference run next to every point, repeats, median and min-max; weight bytes per
  step and their share of the machine's STREAM triad bandwidth); the speed reference is the plain
  transformers model (``--reference backbone``: the River model in backbone mode), named in every
  output (``reference_kind``);
* next-token match against the unmodified model (teacher-forced, River-LLM's own measure).

The report marks the points on the Pareto front (no other point is at least as fast and at
least as accurate, on the mean of the two task scores, and better in one), writes JSON, a PNG
(accuracy against decode tokens/s, one curve per strategy, the unmodified and fully quantized
models marked) and a Markdown table. ``--resume`` reuses the accuracy of points a previous
(interrupted) run already finished, which it keeps in ``<out>.partial.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .errors import RiverError
from .cli_args import add_river_arguments, existing_report, positive_int

__all__ = ["register", "handler", "pareto_front", "plot_pareto"]

UNMODIFIED, FULLY = "unmodified", "fully quantized"


def register(subparsers) -> None:
    from .river.strategies import STRATEGIES

    p = subparsers.add_parser(
        "pareto",
        help="accuracy against decode tokens/s for River and the KV-absence baselines (recompute, SkipDecode, "
             "state propagation, KV mask) at several τ",
        description=("Runs, in one process on the same problems: the unmodified model, the fully quantized model, and "
                     "each exit strategy at each τ. Reports free-running HumanEval pass@1 and GSM8K exact match, decode "
                     "tokens/s from the shared side-by-side timer, mean exit layer and next-token match; marks the "
                     "Pareto front; writes JSON, PNG and a Markdown table."),
    )
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="model key, Hub id or folder (default: %(default)s)")
    p.add_argument("--taus", action="append", metavar="TAUS", help="comma list of τ (repeatable); default 0.98,0.95,0.9")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma list of exit strategies (default: all: %(default)s)")
    p.add_argument("--humaneval", type=int, default=10, metavar="N", help="first N HumanEval problems (default: %(default)s; 0: skip)")
    p.add_argument("--gsm8k", type=int, default=10, metavar="N", help="first N GSM8K test questions (default: %(default)s; 0: skip)")
    p.add_argument("--data", default=None, help="GSM8K's test split as JSON lines, or a Hub id such as openai/gsm8k "
                   "(needs the Hub) (default: $RIVER_HF_CACHE/data/gsm8k/test.jsonl)")
    p.add_argument("--max-new-tokens", type=positive_int, default=192, help="task generation budget (default: %(default)s)")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="required for HumanEval: scoring runs model-written code")
    p.add_argument("--prompts", type=positive_int, default=2, help="timed prompts (first N HumanEval) (default: %(default)s)")
    p.add_argument("--new-tokens", type=positive_int, default=48, help="new tokens per timed prompt (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats, alternating order (default: %(default)s)")
    p.add_argument("--reference", default="plain", choices=("plain", "backbone"),
                   help="the unmodified model timed as the speed reference: plain = the architecture's own transformers "
                        "class on the same weight tensors (default); backbone = the River model in backbone mode")
    add_river_arguments(p)
    p.add_argument("--out", default=None, help="JSON report (default: pareto_<model>.json); PNG and .md go next to it")
    p.add_argument("--resume", action="store_true", help="reuse finished accuracy points from <out>.partial.json")
    p.add_argument("--plot-only", action="store_true", help="run nothing: redraw the PNG and table of --out")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=handler)


def _key(strategy: str | None, tau: float | None) -> str:
    return f"{strategy} τ={tau:g}" if tau is not None else str(strategy)


def pareto_front(points: list[dict], speed: str = "decode_tokens_per_s", quality: str = "accuracy") -> list[bool]:
    """Per point, whether it is on the Pareto front of (``speed`` median, ``quality``): no other
    point is at least as fast and at least as accurate, and strictly better in one. Points
    without both figures are never on the front."""
    def xy(p):
        s = p.get(speed)
        s = s["median"] if isinstance(s, dict) else s
        return s, p.get(quality)

    out = []
    for p in points:
        x, y = xy(p)
        if x is None or y is None:
            out.append(False)
            continue
        dominated = False
        for q in points:
            qx, qy = xy(q)
            if q is p or qx is None or qy is None:
                continue
            if qx >= x and qy >= y and (qx > x or qy > y):
                dominated = True
                break
        out.append(not dominated)
    return out


def _accuracy_points(model, tokenizer, strategies, taus, args, partial: dict, partial_path: Path, progress: bool) -> dict:
    """Free-running task scores per point, saved to ``partial_path`` after each strategy."""
    from .files import write_json
    from .eval.tasks import run_gsm8k, run_humaneval

    river = model.river_config.strategy
    plan = [(river, [2.0, None], {2.0: UNMODIFIED, None: FULLY})]  # τ = 2 never exits: the unmodified tokens
    plan += [(s, list(taus), {t: _key(s, t) for t in taus}) for s in strategies]
    for strategy, point_taus, names in plan:
        todo = [t for t in point_taus if names[t] not in partial]
        if not todo:
            continue
        rows = {names[t]: {"strategy": None if t is None or t > 1 else strategy, "tau": t if t is not None and t <= 1 else None}
                for t in todo}
        with model.river_strategy(strategy):
            if args.humaneval:
                he = run_humaneval(model, tokenizer, todo, limit=args.humaneval, max_new_tokens=args.max_new_tokens,
                                   allow_code_execution=True, progress=progress)
                for t, r in zip(todo, he["results"]):
                    rows[names[t]].update(humaneval=r["pass@1"], humaneval_exit_layer=r["mean_exit_layer"],
                                          humaneval_passed=[s["passed"] for s in r["samples"]],
                                          humaneval_tokens=r["new_tokens"])
            if args.gsm8k:
                gs = run_gsm8k(model, tokenizer, todo, limit=args.gsm8k, max_new_tokens=args.max_new_tokens,
                               data=args.data, progress=progress)
                for t, r in zip(todo, gs["results"]):
                    rows[names[t]].update(gsm8k=r["exact_match"], gsm8k_exit_layer=r["mean_exit_layer"],
                                          gsm8k_correct=[s["correct"] for s in r["samples"]],
                                          gsm8k_tokens=r["new_tokens"])
        partial.update(rows)
        write_json(partial_path, partial)
    return partial


def _merge(bench_rows: list[dict], accuracy: dict) -> list[dict]:
    points = []
    for r in bench_rows:
        if r["mode"] in ("plain", "backbone"):
            name = UNMODIFIED
        elif r["mode"] == "exit":
            name = FULLY
        else:
            name = _key(r["strategy"], r["tau"])
        a = accuracy.get(name, {})
        scores = [a[k] for k in ("humaneval", "gsm8k") if a.get(k) is not None]
        points.append({
            "name": name, "strategy": None if r["mode"] != "route" else r["strategy"], "tau": r["tau"],
            "decode_tokens_per_s": r["decode_tokens_per_s"], "speedup": r["speedup"], "verdict": r["verdict"],
            "weight_bytes_per_token": r["weight_bytes_per_token"], "stream_triad_share": r["stream_triad_share"],
            "mean_exit_layer": r["mean_exit_layer"],  # of the timed decode steps, as measured
            "agreement": r["agreement"], "next_token_match": r["next_token_match"],
            **{k: v for k, v in a.items() if k not in ("strategy", "tau")},
            "accuracy": sum(scores) / len(scores) if scores else None,
        })
    for p, on in zip(points, pareto_front(points)):
        p["pareto"] = on
    return points


COLORS = {"river": "tab:blue", "recompute": "tab:orange", "skipdecode": "tab:green", "state-propagation": "tab:purple",
          "kv-mask": "tab:brown"}


def plot_pareto(report: dict, png: str | Path) -> None:
    """Accuracy (each task, their mean, and next-token match) against decode tokens/s, one curve
    per strategy over τ, the unmodified (black star) and fully quantized (red square) models
    marked, min-max speed bars; the Pareto front (on the mean) dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .files import save_figure

    points = report["points"]
    panels = [(k, label) for k, label in (("humaneval", "HumanEval pass@1 (%)"), ("gsm8k", "GSM8K exact match (%)"),
                                          ("accuracy", "mean of the two (%)"),
                                          ("next_token_match", "next-token match, teacher-forced (%)"))
              if any(p.get(k) is not None for p in points)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for strategy in dict.fromkeys(p["strategy"] for p in points if p["strategy"]):
            pts = sorted((p for p in points if p["strategy"] == strategy and p.get(key) is not None),
                         key=lambda p: p["decode_tokens_per_s"]["median"])
            if not pts:
                continue
            xs = [p["decode_tokens_per_s"]["median"] for p in pts]
            ys = [100 * p[key] for p in pts]
            err = [[x - p["decode_tokens_per_s"]["min"] for x, p in zip(xs, pts)],
                   [p["decode_tokens_per_s"]["max"] - x for x, p in zip(xs, pts)]]
            ax.errorbar(xs, ys, xerr=err, fmt="-o", color=COLORS.get(strategy), label=strategy, capsize=2, alpha=0.85)
            for x, y, p in zip(xs, ys, pts):
                ax.annotate(f"{p['tau']:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7,
                            color=COLORS.get(strategy))
        for name, marker, color in ((UNMODIFIED, "*", "black"), (FULLY, "s", "tab:red")):
            p = next((p for p in points if p["name"] == name and p.get(key) is not None), None)
            if p is not None:
                ax.plot([p["decode_tokens_per_s"]["median"]], [100 * p[key]], marker, color=color, markersize=11,
                        label=name, zorder=4)
        front = sorted((p for p in points if p["pareto"] and p.get(key) is not None),
                       key=lambda p: p["decode_tokens_per_s"]["median"])
        if key == "accuracy" and len(front) > 1:
            ax.plot([p["decode_tokens_per_s"]["median"] for p in front], [100 * p[key] for p in front], ":",
                    color="gray", label="Pareto front", zorder=1)
        ax.set_xlabel("decode tokens/s (median, min-max)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"{report['model']}: {report['humaneval']} HumanEval + {report['gsm8k']} GSM8K problems, greedy "
                 f"≤ {report['max_new_tokens']} tokens; speed: {report['prompts']} prompts x {report['new_tokens']} tokens, "
                 f"{report['repeats']} rounds ({report['device']}); labels: τ"
                 + (f"\nspeed reference: {report['reference_kind']}" if report.get("reference_kind") else ""), fontsize=8)
    fig.tight_layout()
    save_figure(fig, png)


def format_table(report: dict) -> str:
    """The points as a Markdown table, then which reference the speedups are against and the STREAM
    triad figure the bandwidth shares are of."""
    lines = ["| point | decode tok/s (min-max) | × unmodified (min-max) | % of STREAM triad | mean exit layer | HumanEval | "
             "GSM8K | next-token match | Pareto |", "|---|---|---|---|---|---|---|---|---|"]
    for p in report["points"]:
        d, sp = p["decode_tokens_per_s"], p["speedup"]
        share = p.get("stream_triad_share", p.get("bandwidth_share"))
        share = f"{100 * share:.0f}%" if share else ""
        match = p.get("next_token_match")
        match = "reference" if p.get("agreement") == "reference" else "n/a" if match is None else f"{match:.3f}"
        pct = lambda v: "" if v is None else f"{100 * v:.0f}%"  # noqa: E731
        exit_ = "" if p["mean_exit_layer"] is None else f"{p['mean_exit_layer']:.1f}"
        lines.append(f"| {p['name']} | {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | {sp['median']:.2f} "
                     f"({sp['min']:.2f}-{sp['max']:.2f}){' not resolved' if p['verdict'] == 'not resolved' else ''} | {share} | "
                     f"{exit_} | {pct(p.get('humaneval'))} | {pct(p.get('gsm8k'))} | {match} | "
                     f"{'yes' if p['pareto'] else ''} |")
    lines.append("")
    lines.append(f"Speed reference 'unmodified': {report.get('reference_kind') or 'River model in backbone mode (reports before the field)'}.")
    triad = report.get("stream_triad_gb_s", report.get("bandwidth_limit_gb_s"))
    if triad:
        from .timing import stream_line

        lines.append(stream_line(triad, report.get("stream_copy_gb_s"), report.get("stream_threads")) + ".")
    return "\n".join(lines)


def handler(args) -> int:
    import torch

    from .bench import run_bench
    from .eval.common import (atomic_write, check_output_path, humaneval_problems, load_river_model, log, parse_taus,
                              river_overrides, versions, write_json)
    from .eval.data import gsm8k_source
    from .eval.tasks import humaneval_prompt
    from .models import encode_prompt
    from .quant import machine_id
    from .river.strategies import get_strategy

    out = check_output_path(args.out or f"pareto_{args.model.replace('/', '_')}.json")
    md, png = out.with_suffix(".md"), out.with_suffix(".png")
    if args.plot_only:
        report = existing_report(out, "points", "pareto")
        plot_pareto(report, png)
        atomic_write(md, format_table(report) + "\n")
        log(f"redrew {png} and {md}")
        return 0
    taus = parse_taus(args.taus or ["0.98,0.95,0.9"])
    if any(t > 1 for t in taus):
        raise RiverError("--taus: every τ must be at most 1 here (τ > 1 is the unmodified model, which is always a point)")
    strategies = [get_strategy(s.strip()).name for s in args.strategies.split(",") if s.strip()]
    if not strategies:
        raise RiverError("--strategies: give at least one strategy")
    if args.humaneval and not args.allow_code_execution:
        raise RiverError("HumanEval scoring executes model-written code; pass --allow-code-execution (or --humaneval 0)")
    if args.humaneval < 0 or args.gsm8k < 0 or not (args.humaneval or args.gsm8k):
        raise RiverError("--humaneval and --gsm8k take counts >= 0, and at least one must be positive")
    problems = humaneval_problems()
    if max(args.prompts, args.humaneval) > len(problems):
        raise RiverError(f"HumanEval has {len(problems)} problems; ask for at most that many")
    if args.gsm8k:
        args.data = gsm8k_source(args.data)  # checked before the model loads
    elif args.data is not None:
        raise RiverError("--data is GSM8K's test file; with --gsm8k 0 it is not read")
    progress = not args.no_progress
    partial_path = out.with_name(out.name + ".partial.json")
    partial = {}
    if args.resume and partial_path.is_file():
        try:
            partial = json.loads(partial_path.read_text())
        except (OSError, ValueError) as e:
            raise RiverError(f"--resume: cannot read {partial_path} ({type(e).__name__}); delete it to start "
                             "over") from None
        if not isinstance(partial, dict):
            raise RiverError(f"--resume: {partial_path} is not a pareto partial file; delete it to start over")
        log(f"resuming: {len(partial)} accuracy points from {partial_path}")

    start = time.perf_counter()
    model, tokenizer, _ = load_river_model(args.model, progress=progress, **river_overrides(args))
    river_config = model.river_config.to_dict()
    accuracy = _accuracy_points(model, tokenizer, strategies, taus, args, partial, partial_path, progress)
    prompt_ids = [encode_prompt(tokenizer, humaneval_prompt(p))["input_ids"].to(model.device)
                  for p in problems[: args.prompts]]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    river = model.river_config.strategy
    bench_taus = taus if river in strategies else []
    rows, info = run_bench(model, prompt_ids, bench_taus, new_tokens=args.new_tokens, repeats=args.repeats,
                           progress=progress, pad_token_id=pad, strategies=[s for s in strategies if s != river],
                           reference=args.reference)
    device = f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    report = {
        "model": args.model, "dtype": str(model.dtype).removeprefix("torch."),
        "checkpoint_note": ("offline registry checkpoints are GGUF files (Q4_K_M / Q4_1) dequantized to this dtype: the "
                            "unmodified model's weights already sit on a 4-bit grid"),
        "taus": taus, "strategies": strategies, "humaneval": args.humaneval, "gsm8k": args.gsm8k,
        "max_new_tokens": args.max_new_tokens, "prompts": len(prompt_ids), "new_tokens": args.new_tokens,
        "repeats": args.repeats, "device": device, "machine": machine_id(model.device),
        **info, "num_layers": model.river.num_layers, "river_config": river_config,
        "points": _merge(rows, accuracy),
        "versions": versions(), "wall_s": time.perf_counter() - start,
        "command": "river-hf " + " ".join(sys.argv[1:]) if sys.argv and "river" in sys.argv[0] else None,
    }
    plot_pareto(report, png)
    report["png"] = png.name
    write_json(out, report)
    atomic_write(md, format_table(report) + "\n")
    partial_path.unlink(missing_ok=True)
    print(format_table(report))
    log(f"wrote {out}, {png} and {md} ({report['wall_s']:.0f} s)")
    return 0
