"""What ``benchmarks/stitch_bench.py`` reports: its HumanEval stop strings, timing protocol, the
per-method summary over problems (per-round speedups over LLM-only with their spread and verdict),
the latency estimator's ceiling, and the JSON + Markdown + PNG it writes."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from ..files import atomic_write
from ..timing import spread
from .rounds import verdict

__all__ = ["STOP_STRINGS", "TIMING_PROTOCOL", "truncate", "summarize", "stitch_ceiling", "write_outputs"]

STOP_STRINGS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```", "\nassert "]


TIMING_PROTOCOL = {
    "timer": "river_hf.bench_harness.time_rounds, following river_hf.timing's protocol (per-problem mode)",
    "why_not_river_hf.timing.compare": "it times equal new-token counts; methods here stop at the HumanEval stop "
                                       "strings, so latency to a finished answer is compared",
    "reference": "llm",
    "warmup": "one untimed run of every method on the first problem",
    "order": "per problem, rounds alternating forward / reversed order of the methods",
    "statistic": "per problem: median and min-max of a method's round latencies; speedup vs llm per round "
                 "(sum over problems of round r), median and min-max",
}


def truncate(text: str) -> str:
    """``text`` up to the first HumanEval stop string (all of it when none occurs)."""
    cut = min([i for i in (text.find(s) for s in STOP_STRINGS) if i >= 0], default=len(text))
    return text[:cut]


def summarize(records: list[dict], methods: list[str]) -> dict:
    """Per method over the problems that every method has finished (side-by-side ratios).

    ``seconds`` of a record is its per-problem median; ``seconds_runs`` its rounds (records written
    before the rounds existed have one run). The speedup over LLM-only is taken per round over the
    rounds every record has: sum of the LLM-only seconds of round r / sum of the method's."""
    done = [r for r in records if all(m in r["methods"] for m in methods)]
    out = {}
    if not done:
        return out
    llm_lat = sum(r["methods"]["llm"]["seconds"] for r in done) / len(done) if "llm" in methods else None

    def runs(x):
        return x.get("seconds_runs") or [x["seconds"]]

    rounds = min(len(runs(r["methods"][m])) for r in done for m in methods)
    for m in methods:
        rows = [r["methods"][m] for r in done]
        lat = sum(x["seconds"] for x in rows) / len(rows)
        toks = sum(x["new_tokens"] for x in rows)
        slm_toks = sum(x.get("slm_tokens", 0) for x in rows)
        passed = [x["passed"] for x in rows if x.get("passed") is not None]
        preds = [x["predicted_seconds"] for x in rows if x.get("predicted_seconds") is not None]
        per_round = None
        if "llm" in methods:
            per_round = [sum(runs(r["methods"]["llm"])[i] for r in done) / sum(runs(x)[i] for x in rows)
                         for i in range(rounds)]
        sp = spread(per_round, runs=False) if per_round else None
        out[m] = {
            "problems": len(rows),
            "rounds": rounds,
            "pass@1": (sum(passed) / len(passed)) if passed else None,
            "passed": sum(passed) if passed else None,
            "mean_latency_s": lat,
            "speedup_vs_llm": sp["median"] if sp else None,
            "speedup_vs_llm_range": [sp["min"], sp["max"]] if sp else None,
            "speedup_vs_llm_runs": per_round,
            "speedup_verdict": None if sp is None else "reference" if m == "llm" else verdict(sp),
            "mean_latency_ratio_vs_llm": (llm_lat / lat) if llm_lat else None,
            "slm_token_fraction": slm_toks / toks if toks else 0.0,
            "mean_new_tokens": toks / len(rows),
            "tokens_per_s": toks / sum(x["seconds"] for x in rows),
            "mean_predicted_latency_s": (sum(preds) / len(preds)) if len(preds) == len(rows) else None,
        }
    return out


def stitch_ceiling(records: list[dict], est) -> dict | None:
    """The latency estimator's bound on any R-Stitch speedup over LLM-only for these problems.

    R-Stitch prefills the prompt with the SLM and, as soon as the LLM writes one token, with the
    LLM too; its cheapest trajectory is the SLM writing every other token. Per problem, with n =
    the LLM-only run's new tokens and P = prompt tokens: ``bound = LLM(P prefill + n-1 decodes) /
    (LLM(P prefill) + SLM(P prefill + n-1 decodes))``, all from the estimator (free hand-overs, no
    discarded SLM steps). Returned as the ratio of the sums over problems.
    """
    rows = [r for r in records if "llm" in r["methods"]]
    if est is None or not rows:
        return None
    llm = slm_only = stitched = 0.0
    for r in rows:
        p, n = r["prompt_tokens"], r["methods"]["llm"]["new_tokens"]
        llm += est.predict_autoregressive("llm", p, n)
        slm_only += est.predict_autoregressive("slm", p, n)
        stitched += est.predict_forward("llm", p, 0) + est.predict_autoregressive("slm", p, n)
    return {"problems": len(rows), "llm_s": llm / len(rows), "slm_only_s": slm_only / len(rows),
            "stitch_with_one_llm_token_s": stitched / len(rows),
            "max_speedup_using_llm": llm / stitched if stitched else None,
            "max_speedup_slm_only": llm / slm_only if slm_only else None}


def write_outputs(args, records, methods, estimator_path, started, finished: bool, est=None, updated=None,
                  command: str | None = None) -> dict:
    """Write ``<args.out_dir>/<args.name>.{json,md,png}`` (each atomically): the run's settings from
    ``args`` (an ``argparse.Namespace`` of stitch_bench's flags; ``args.argv`` the command line), the
    per-method :func:`summarize` of ``records``, the estimator's :func:`stitch_ceiling` (``est``: a
    ``river_hf.stitch.LatencyEstimator`` or None) and the records; ``command`` replaces the command
    line recorded (a rescore's). Returns the summary."""
    summary = summarize(records, methods)
    ceiling = stitch_ceiling(records, est)
    command = command or "PYTHONPATH=src python " + " ".join(
        shlex.quote(a) for a in ["benchmarks/stitch_bench.py", *getattr(args, "argv", sys.argv[1:])])
    doc = {
        "command": command,
        "started": started,
        "updated": updated or time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "finished": finished,
        "slm": args.slm,
        "llm": args.llm,
        "taus": args.taus,
        "max_new_tokens": args.max_new_tokens,
        "problems_requested": args.n_problems,
        "problems_done": len(records),
        "prompt_style": "HumanEval code completion, no chat template, greedy",
        "stop_strings": STOP_STRINGS,
        "estimator": estimator_path,
        "torch_threads": args.threads,
        "repeats": getattr(args, "repeats", None),
        "timing_protocol": TIMING_PROTOCOL,
        "small_batch_linear": not args.stock_linear,
        "summary": summary,
        "ceiling": ceiling,
        "records": records,
    }
    base = os.path.join(args.out_dir, args.name)
    atomic_write(base + ".json", json.dumps(doc, indent=1))
    # markdown
    lines = [
        f"# R-Stitch on HumanEval ({len(records)} of {args.n_problems} problems{'' if finished else ', partial'})",
        "",
        f"SLM `{args.slm}`, LLM `{args.llm}`, fp32, CPU, greedy, max {args.max_new_tokens} new tokens, "
        "HumanEval completion prompts with the usual stop strings; "
        + ("torch's stock Linear kernels" if args.stock_linear else
           "R-Stitch catch-ups and assisted generation inside `river_hf.quant.dense.SmallBatchLinear` "
           "(2-64-row fp32 products rerouted)")
        + ". Updated " + doc["updated"] + ".",
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
        (f"Timing: {TIMING_PROTOCOL['warmup']}; {TIMING_PROTOCOL['order']}, {doc['repeats']} rounds; latency = median"
         " of a problem's rounds (mean over problems); speedup vs LLM per round (summed over problems), median"
         " (min-max) and verdict (\"not resolved\" when the range contains 1.0)." if doc["repeats"] else
         "Timing: one run of every method per problem, back to back (a run from before the repeated rounds; its"
         " speedups have no spread)."),
        "",
        "| method | problems | pass@1 | mean latency (s) | speedup vs LLM, median (min-max) | SLM tokens | mean new tokens | tokens/s | predicted latency (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, s in summary.items():
        p = "n/a" if s["pass@1"] is None else f"{s['pass@1']:.2f} ({s['passed']}/{s['problems']})"
        pred = "n/a" if s["mean_predicted_latency_s"] is None else f"{s['mean_predicted_latency_s']:.1f}"
        sp = "n/a" if s["speedup_vs_llm"] is None else f"{s['speedup_vs_llm']:.2f}x"
        if s.get("speedup_vs_llm_range") and m != "llm":
            lo, hi = s["speedup_vs_llm_range"]
            sp += f" ({lo:.2f}-{hi:.2f}) {s['speedup_verdict']}"
        lines.append(
            f"| {m} | {s['problems']} | {p} | {s['mean_latency_s']:.1f} | {sp} | {s['slm_token_fraction']:.0%} | "
            f"{s['mean_new_tokens']:.0f} | {s['tokens_per_s']:.2f} | {pred} |"
        )
    loads = [r["loadavg_1min"] for r in records if "loadavg_1min" in r]
    machine = (f"Machine: {os.cpu_count()} CPU cores; 1-minute load average after each problem "
               f"{min(loads):.1f}-{max(loads):.1f} (this run alone keeps it near its torch thread count, {args.threads})"
               if loads else "Machine: load average not recorded")
    if ceiling:
        lines += [
            "",
            f"Ceiling (latency estimator, same problems, LLM-only token counts): an R-Stitch run in which the LLM "
            f"writes a single token still prefills the prompt with both models, so no τ can beat "
            f"**{ceiling['max_speedup_using_llm']:.2f}x** over LLM-only here (SLM alone, never calling the LLM: "
            f"{ceiling['max_speedup_slm_only']:.2f}x). Hand-overs cost more on top (discarded SLM steps, catch-ups).",
        ]
    lines += [
        "",
        machine + ".",
        "Ratios come from running every method on the same problem back to back, in alternating order.",
    ]
    atomic_write(base + ".md", "\n".join(lines) + "\n")
    if summary:
        _plot(summary, base + ".png", len(records))
    return summary


def _plot(summary: dict, path: str, n: int) -> None:
    """The summary as four panels (speedup, pass@1, latency measured and predicted, pass@1 against speedup), PNG at ``path``."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    axes[0].bar(names, [summary[m]["speedup_vs_llm"] or 0 for m in names], color="tab:blue")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_title("speedup vs LLM-only (mean latency)")
    axes[1].bar(names, [summary[m]["pass@1"] or 0 for m in names], color="tab:green")
    axes[1].set_title("pass@1")
    axes[1].set_ylim(0, 1)
    x = range(len(names))
    axes[2].bar([i - 0.2 for i in x], [summary[m]["mean_latency_s"] for m in names], 0.4, label="measured")
    axes[2].bar(
        [i + 0.2 for i in x], [summary[m]["mean_predicted_latency_s"] or 0 for m in names], 0.4, label="predicted"
    )
    axes[2].set_xticks(list(x), names)
    axes[2].set_title("latency per problem (s)")
    axes[2].legend()
    for ax in axes[:3]:
        ax.tick_params(axis="x", rotation=45)
    # quality vs speed: the target region is >= 1.5x at no more than one problem below LLM-only
    ax = axes[3]
    llm = summary.get("llm")
    if llm and llm["pass@1"] is not None:
        floor = llm["pass@1"] - 1 / llm["problems"]
        right = max(2.2, max(summary[m]["speedup_vs_llm"] or 0 for m in names) + 0.1)
        ax.fill_between([1.5, right], floor, 1.0, color="tab:green", alpha=0.12,
                        label="target: >= 1.5x, <= 1 problem lost")
    for i, m in enumerate(names):
        s_, p_ = summary[m]["speedup_vs_llm"], summary[m]["pass@1"]
        if s_ is None or p_ is None:
            continue
        colour = "tab:blue" if m.startswith("rstitch") else "tab:gray"
        ax.plot(s_, p_, "o", color=colour)
        ax.annotate(m.replace("rstitch_tau", "τ="), (s_, p_), textcoords="offset points",
                    xytext=(2, 4 if i % 2 else -6), fontsize=7, rotation=50 if i % 2 else -50,
                    va="bottom" if i % 2 else "top")  # alternate above/below: equal pass@1 is common
    ax.set_ylim(max(0.0, min((summary[m]["pass@1"] or 0) for m in names) - 0.05), 1.0)
    ax.set_xlabel("speedup vs LLM-only")
    ax.set_ylabel("pass@1")
    ax.set_title("pass@1 vs speedup")
    ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"R-Stitch, HumanEval first {n} problems, 2-core CPU")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
