"""``river-hf bench``: River's speed and quality against the unmodified and the fully 4-bit model.

In one process, on the same prompts (the first N HumanEval prompts, chat template) and the same
number of new tokens (``min_new_tokens = max_new_tokens``, greedy, batch 1), it times:

* ``unmodified``: the original model (``river_mode("backbone")``);
* ``4-bit``: every decoder layer replaced by its exit copy (``river_mode("exit")``);
* River at each requested τ (``river_mode("route")``).

Each repeat runs the configurations in alternating order (forward, then reversed, ...) so slow
drifts of a shared machine fall evenly on all of them; the report takes the median over repeats.
Figures per configuration:

* tokens/s: new tokens / wall seconds of ``generate`` summed over the prompts (includes prefill);
* ratio: tokens/s over the unmodified model's, same repeat set;
* TTFT (seconds): median over repeats of the mean time of a ``max_new_tokens=1`` generate (prefill
  plus one token);
* weight bytes/token and achieved bandwidth (GB/s) = weight bytes read per decode step x tokens/s;
* next-token match, KL (nats) and mean exit layer from
  :func:`river_hf.eval.agreement.next_token_agreement` (River-LLM's quality measure: follow the
  unmodified model's greedy continuation and count the steps where the argmax agrees).

Writes a JSON report and a PNG: tokens/s against next-token match, against weight bytes per step
(and against task accuracy when ``--eval-json`` reports from ``river-hf eval`` are given), each
point labelled with its τ.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from .errors import RiverError
from .eval.common import positive_int

__all__ = ["register", "handler", "run_bench", "plot_bench"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="tokens/s, TTFT, bandwidth and next-token match: unmodified vs 4-bit vs River at each τ",
        description=("In one process, on the same prompts (first N HumanEval prompts, chat template) and the same "
                     "number of new tokens (greedy, batch 1), times the unmodified model, the fully 4-bit model and "
                     "River at each τ, in alternating order over the repeats. Reports median tokens/s, ratio to the "
                     "unmodified model, time to first token, weight bytes read per step and achieved GB/s, next-token "
                     "match, KL and mean exit layer; writes JSON and a PNG."),
    )
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="model key, Hub id or folder (default: %(default)s)")
    p.add_argument("--taus", action="append", metavar="TAUS",
                   help="comma list of τ (repeatable), e.g. 2,0.93,0.9,0.85; default: 2 and the model's τ")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="new tokens per prompt (default: %(default)s)")
    p.add_argument("--prompts", type=positive_int, default=3, help="first N HumanEval prompts (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats, alternating order (default: %(default)s)")
    p.add_argument("--eval-json", action="append", default=[], metavar="FILE",
                   help="river-hf eval report(s) (gsm8k/humaneval) to plot tokens/s against accuracy")
    p.add_argument("--out", default=None, help="JSON report (default: bench_<model>.json); the PNG goes next to it")
    p.add_argument("--plot-only", action="store_true",
                   help="run nothing: redraw the PNG of the existing --out report (e.g. with new --eval-json files)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=handler)


def _configs(taus):
    return [("unmodified", "backbone", None), ("4-bit", "exit", None)] + [(f"τ={t:g}", "route", t) for t in taus]


def run_bench(model, prompt_ids, taus, *, new_tokens=64, repeats=3, progress=True, pad_token_id=None) -> list[dict]:
    """Time and compare the configurations; see the module docstring for each figure.

    Args:
        model: a River model. prompt_ids: list of ``[1, tokens]`` long tensors. taus: River τ values.

    Returns:
        One dict per configuration (``label``, ``mode``, ``tau``, ``tokens_per_s`` median and
        ``tokens_per_s_runs``, ``ratio_to_unmodified``, ``ttft_s`` and runs, ``mean_exit_layer``,
        ``exit_fraction``, ``weight_bytes_per_token`` (bytes), ``bandwidth_gb_s``,
        ``next_token_match``, ``mean_kl``).
    """
    import torch
    from tqdm.auto import tqdm

    from .eval.tasks import agreement_over_prompts

    configs = _configs(taus)
    gen = dict(do_sample=False, pad_token_id=pad_token_id)
    runs = {label: {"tps": [], "ttft": [], "exit": [], "exitfrac": [], "bytes": []} for label, _, _ in configs}

    def one(mode, tau, ids, n):
        if tau is not None:
            model.set_river_tau(tau)
        with model.river_mode(mode):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, **gen)
        return model.river_stats

    # Warm-up (first-call allocations, kernel selection), untimed.
    for _, mode, tau in configs:
        one(mode, tau, prompt_ids[0], 2)

    total = repeats * len(configs)
    bar = tqdm(total=total, desc="bench", disable=not progress, unit="run")
    for r in range(repeats):
        order = configs if r % 2 == 0 else configs[::-1]
        for label, mode, tau in order:
            bar.set_postfix_str(f"repeat {r + 1} {label}")
            ttft = [one(mode, tau, ids, 1)["seconds"] for ids in prompt_ids]
            stats = [one(mode, tau, ids, new_tokens) for ids in prompt_ids]
            seconds = sum(s["seconds"] for s in stats)
            tokens = sum(s["new_tokens"] for s in stats)
            steps = sum(s["decode_steps"] for s in stats)
            run = runs[label]
            run["tps"].append(tokens / seconds)
            run["ttft"].append(sum(ttft) / len(ttft))
            run["exit"].append(sum(s["mean_exit_layer"] * s["decode_steps"] for s in stats) / steps)
            run["exitfrac"].append(sum(s["exit_fraction"] * s["decode_steps"] for s in stats) / steps)
            run["bytes"].append(sum(s["weight_bytes_per_token"] * s["decode_steps"] for s in stats) / steps)
            bar.update()
    bar.close()

    route_taus = [t for _, m, t in configs if m == "route"]
    agree, _ = agreement_over_prompts(model, prompt_ids, route_taus, max_new_tokens=new_tokens, progress=progress,
                                      exit_only=True)
    agree_by = {(a["mode"], a["tau"]): a for a in agree}

    base_tps = statistics.median(runs["unmodified"]["tps"])
    rows = []
    for label, mode, tau in configs:
        run = runs[label]
        tps = statistics.median(run["tps"])
        bytes_per_token = statistics.median(run["bytes"])
        a = agree_by.get((mode, tau))
        rows.append({
            "label": label, "mode": mode, "tau": tau,
            "tokens_per_s": tps, "tokens_per_s_runs": run["tps"],
            "ratio_to_unmodified": tps / base_tps,
            "ttft_s": statistics.median(run["ttft"]), "ttft_s_runs": run["ttft"],
            "mean_exit_layer": statistics.median(run["exit"]),
            "exit_fraction": statistics.median(run["exitfrac"]),
            "weight_bytes_per_token": bytes_per_token,
            "bandwidth_gb_s": bytes_per_token * tps / 1e9,
            # The unmodified model is the reference of next-token match: 1 and 0 by definition.
            "next_token_match": a["match_rate"] if a else 1.0,
            "mean_kl": a["mean_kl"] if a else 0.0,
            "agreement_mean_exit_layer": a["mean_exit_layer"] if a else float(model.river.num_layers),
            "agreement_positions": a["positions"] if a else None,
        })
    return rows


def _merge_evals(pairs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """One panel per task and metric: scores of several reports of the same task are merged by τ."""
    merged: dict[str, dict] = {}
    for name, scores in pairs:
        merged.setdefault(name, {}).update(scores)
    return list(merged.items())


def _eval_scores(path: str) -> tuple[str, dict]:
    import json

    try:
        report = json.loads(Path(path).read_text())
        metric = report["metric"]
        return f"{report['task']} {metric}", {float(r["tau"]): r[metric] for r in report["results"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RiverError(f"--eval-json {path}: not a river-hf eval report ({type(e).__name__}: {e})") from None


def plot_bench(report: dict, png: str | Path, evals: list[tuple[str, dict]] = ()) -> None:
    """PNG of tokens/s against next-token match, against weight bytes read per decode step, and
    against each eval's score (one panel each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    panels = 2 + len(evals)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    colors = {"backbone": "tab:gray", "exit": "tab:red", "route": "tab:blue"}

    def draw(ax, points, xlabel):
        labels: dict[tuple, list[str]] = {}  # points that coincide on the plot share one label
        for x, y, label, mode in points:
            ax.scatter([x], [y], color=colors[mode], zorder=3)
            labels.setdefault((round(x, 6), round(y, 2)), []).append(label)
        xs, ys = [k[0] for k in labels], [k[1] for k in labels]
        dx, dy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
        placed: list[tuple[float, float]] = []
        for (x, y), names in sorted(labels.items()):
            crowded = any(abs(x - px) < 0.12 * dx and abs(y - py) < 0.06 * dy for px, py in placed)
            ax.annotate(", ".join(names), (x, y), textcoords="offset points", xytext=(5, -12 if crowded else 4),
                        fontsize=8)
            placed.append((x, y))
        route = sorted((x, y) for x, y, _, m in points if m == "route")
        if len(route) > 1:
            ax.plot(*zip(*route), color=colors["route"], alpha=0.4, zorder=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens/s (median)")
        ax.grid(alpha=0.3)

    draw(axes[0][0], [(100 * r["next_token_match"], r["tokens_per_s"], r["label"], r["mode"]) for r in rows],
         "next-token match vs unmodified (%)")
    draw(axes[0][1], [(r["weight_bytes_per_token"] / 1e6, r["tokens_per_s"], r["label"], r["mode"]) for r in rows],
         "weight MB read per decode step")
    for ax, (name, scores) in zip(axes[0][2:], evals):
        pts = [(100 * scores[r["tau"]], r["tokens_per_s"], r["label"], r["mode"])
               for r in rows if r["tau"] is not None and r["tau"] in scores]
        draw(ax, pts, f"{name} (%)")
    fig.suptitle(f"{report['model']}: {report['new_tokens']} new tokens, {report['prompts']} prompts, "
                 f"{report['repeats']} repeats ({report['device']})", fontsize=9)
    fig.tight_layout()
    png = Path(png)
    tmp = png.with_name(f".{png.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    import os

    os.replace(tmp, png)


def handler(args) -> int:
    import torch

    from .eval.common import check_output_path, humaneval_problems, load_river_model, log, parse_taus, versions, write_json
    from .models import encode_prompt
    from .eval.tasks import humaneval_prompt

    taus = parse_taus(args.taus)
    if args.new_tokens < 2:
        raise RiverError("--new-tokens must be at least 2 (one prefill token plus decode steps to time)")
    evals = _merge_evals([_eval_scores(p) for p in args.eval_json])
    out = check_output_path(args.out or f"bench_{args.model.replace('/', '_')}.json")
    if args.plot_only:
        import json

        try:
            report = json.loads(out.read_text())
            report["rows"]
        except (OSError, ValueError, KeyError) as e:
            raise RiverError(f"--plot-only needs an existing bench report at --out {out} ({type(e).__name__})") from None
        plot_bench(report, out.with_suffix(".png"), evals)
        report["eval_json"] = list(args.eval_json)
        write_json(out, report)
        log(f"redrew {out.with_suffix('.png')}")
        return 0
    progress = not args.no_progress
    problems = humaneval_problems()
    if args.prompts > len(problems):
        raise RiverError(f"--prompts {args.prompts}: HumanEval has {len(problems)} prompts; pass at most {len(problems)}")

    start = time.perf_counter()
    model, tokenizer, default_tau = load_river_model(args.model, progress=progress)
    if not taus:
        taus = [2.0, default_tau]
    prompt_ids = [encode_prompt(tokenizer, humaneval_prompt(p))["input_ids"].to(model.device)
                  for p in problems[: args.prompts]]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = run_bench(model, prompt_ids, taus, new_tokens=args.new_tokens, repeats=args.repeats, progress=progress,
                     pad_token_id=pad)
    device = f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    report = {
        "model": args.model,
        "default_tau": default_tau,
        "taus": taus,
        "new_tokens": args.new_tokens,
        "prompts": len(prompt_ids),
        "prompt_tokens": [int(p.shape[1]) for p in prompt_ids],
        "repeats": args.repeats,
        "device": device,
        "num_layers": model.river.num_layers,
        "river_build_seconds": model.river_build_seconds,
        "quantization": model.river_config.to_dict()["quantization"],
        "rows": rows,
        "eval_json": list(args.eval_json),
        "versions": versions(),
        "wall_s": time.perf_counter() - start,
        "command": "river-hf " + " ".join(sys.argv[1:]) if sys.argv and "river" in sys.argv[0] else None,
    }
    png = out.with_suffix(".png")
    plot_bench(report, png, evals)
    report["png"] = png.name
    write_json(out, report)
    print(f"{'config':>12} {'tokens/s':>9} {'ratio':>6} {'TTFT s':>7} {'GB/s':>6} {'exit layer':>10} {'match':>6} {'KL':>7}")
    for r in rows:
        print(f"{r['label']:>12} {r['tokens_per_s']:9.2f} {r['ratio_to_unmodified']:6.2f} {r['ttft_s']:7.3f} "
              f"{r['bandwidth_gb_s']:6.2f} {r['mean_exit_layer']:10.2f} {r['next_token_match']:6.3f} {r['mean_kl']:7.4f}")
    log(f"wrote {out} and {png} ({report['wall_s']:.0f} s)")
    return 0
