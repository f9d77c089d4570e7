"""Cross-check river-hf's early-exit baselines against an independent implementation: economize.

    pip install --no-deps --target /tmp/econ_pkg economize-0.3.2-py3-none-any.whl   # not a river-hf dependency
    PYTHONPATH=src python benchmarks/economize_crosscheck.py --model smollm2-135m --prompts 2 --new-tokens 16

economize (PyPI ``economize``, 0.3.2; ``economize/techniques/dynamic_depth/``) implements CALM
(``calm.py``: confidence ``softmax`` / ``state`` / ``classifier``, exit when the confidence is
strictly above the threshold after layer ``min_layer..L-1``, skipped layers get the K/V of the exit
state, the prompt runs every layer) and SkipDecode (``skipdecode.py``: a layer budget set ahead of
time by the generated position, ``max_layers`` until ``warmup``, then linear to ``min_layers`` over
``decay`` positions; ``skip="top"`` is an early exit; skipped layers write no K/V). Both read the
token out through the model's final norm and LM head. Its decoding loop, KV cache, masks and K/V
filling (``arch/base.py`` ``fill_kv``: the layer itself is called with a capturing cache) are its
own; only the HF decoder layers and head are shared with river-hf (two separate copies of the
weights are loaded, one per implementation).

Matched settings (batch 1, greedy, fp32, the prompt on every layer, read-out through the original
fp32 final norm + LM head; an *exit layer* is the number of decoder layers a decode pass ran, L = no
exit). In all but ``calm-state`` the exit layer of each decode pass is fixed ahead of time, so the
two implementations must take the same decisions and, up to fp32 rounding of two different
attention / cache code paths, give the same tokens:

``skipdecode-constant``
    economize ``SkipDecodeConfig(skip="top", max_layers=k, min_layers=k)`` against river-hf
    ``strategy="skipdecode"`` with rules ``[MinLayerRule(k), StateTransitionSimilarityRule(-2)]``
    (every decode pass leaves after exactly k layers).
``skipdecode-linear``
    economize's paper schedule ``SkipDecodeConfig(skip="top", max_layers=L, min_layers=k,
    warmup=w, decay=d)`` against river-hf ``skipdecode`` with a rule that exits each decode pass
    at the same schedule (computed here, checked against economize's ``active_layers``). The
    schedule never rises, so river-hf's monotone cap (read off the cache lengths) never binds.
``calm-schedule``
    CALM's state propagation with a fixed, *non-monotone* per-pass exit schedule: economize CALM
    with a confidence measure registered here (1 at the scheduled layer, else 0; threshold 0.5,
    ``min_layer=1``) against river-hf ``strategy="state-propagation"`` with a rule that exits at
    the same schedule. Later tokens run layers that earlier tokens skipped, so they read the
    propagated K/V: this isolates the K/V filling of the two implementations.
``calm-state``
    The adaptive CALM with the hidden-state saturation confidence: economize
    ``CalmConfig(confidence="state", threshold=tau, min_layer=m)`` (cosine of a layer's output and
    input, per token) against river-hf ``state-propagation`` with τ = tau and ``min_layer=m``
    (cosine of a layer's input and output, minimum over the tokens of the pass: the same number at
    batch 1). Same rule; decisions can differ only where a cosine is within fp32 noise of τ.

Per prompt and setting the report gives the tokens of both, where they first differ, the fraction
of positions equal before that divergence and overall, the exit layer of every decode pass of both
and how many of those agree before the first token divergence, and (with the full-model reference,
plain HF greedy) how far each is from the unmodified model. JSON (temp file + rename) and a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("skipdecode-constant", "skipdecode-linear", "calm-schedule", "calm-state")
SCHEDULE_MEASURE = "crosscheck_schedule"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="river-hf model key or folder")
    p.add_argument("--prompts", type=int, default=3, help="first N HumanEval problems (chat template)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated subset of {', '.join(SETTINGS)}")
    p.add_argument("--exit-layer", type=int, default=None,
                   help="k: the constant exit layer and the floor of the schedules (default round(0.75 L))")
    p.add_argument("--warmup", type=int, default=2, help="skipdecode-linear: passes at L layers")
    p.add_argument("--decay", type=int, default=None,
                   help="skipdecode-linear: passes from L down to k (default max(1, new_tokens // 2))")
    p.add_argument("--calm-schedule", default=None,
                   help="calm-schedule: comma-separated exit layers, cycled over the decode passes "
                        "(default k, L, (k+L)//2, L, k, L-1)")
    p.add_argument("--tau", type=float, default=None, help="calm-state threshold (default: the model's river config)")
    p.add_argument("--min-layer", type=int, default=None, help="calm-state min layer (default: the model's river config)")
    p.add_argument("--no-reference", action="store_true", help="skip the full-model (plain HF greedy) reference")
    p.add_argument("--economize-path", default="/tmp/econ_pkg",
                   help="folder holding the economize package (put first on sys.path; '' = installed one)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--out", default=None, help="JSON report (default docs/results/economize_crosscheck_<model>.json)")
    args = p.parse_args(argv)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    bad = [s for s in args.settings if s not in SETTINGS]
    if bad or not args.settings:
        p.error(f"unknown settings {bad}; choose from {', '.join(SETTINGS)}")
    if args.prompts < 1 or args.new_tokens < 2:
        p.error("--prompts must be >= 1 and --new-tokens >= 2")
    return args


def import_economize(path: str):
    """economize from ``path`` (first on sys.path), or a clear exit."""
    if path:
        if not os.path.isdir(path):
            sys.exit(f"economize_crosscheck: --economize-path {path!r} is not a folder; install economize there with "
                     f"`pip install --no-deps --target {path} economize-0.3.2-py3-none-any.whl`")
        sys.path.insert(0, os.path.abspath(path))
    try:
        import economize
        from economize.techniques.dynamic_depth import (CONFIDENCE_MEASURES, CalmConfig, ConfidenceMeasure,
                                                       SkipDecodeConfig)
    except Exception as e:  # ImportError, or a broken install
        where = f"from {path!r}" if path else "from the environment"
        sys.exit(f"economize_crosscheck: cannot import economize {where} ({type(e).__name__}: {e}); install it with "
                 f"`pip install --no-deps --target {path or '/tmp/econ_pkg'} economize-0.3.2-py3-none-any.whl` "
                 "and pass --economize-path")
    return economize, CONFIDENCE_MEASURES, CalmConfig, ConfidenceMeasure, SkipDecodeConfig


# ---------------------------------------------------------------------------------------------- comparison

def compare_tokens(a: list[int], b: list[int]) -> dict:
    """First divergence, and the fractions of positions (of the longer sequence) equal before it and overall
    (a missing token counts as different)."""
    n = max(len(a), len(b))
    shared = min(len(a), len(b))
    first = next((i for i in range(shared) if a[i] != b[i]), None)
    if first is None and len(a) != len(b):
        first = shared
    same = sum(a[i] == b[i] for i in range(shared))
    return {"first_divergence": first, "prefix_agreement": (n if first is None else first) / n if n else 1.0,
            "overall_agreement": same / n if n else 1.0, "lengths": [len(a), len(b)]}


def compare_exits(river: list[int], econ: list[int], first_divergence: int | None) -> dict:
    """Exit layers of the decode passes whose whole history (prompt + tokens so far) is the same in both: decode
    pass j feeds generated token j, so passes 0 .. first_divergence - 1."""
    n = min(len(river), len(econ))
    if first_divergence is not None:
        n = min(n, first_divergence)
    equal = sum(river[j] == econ[j] for j in range(n))
    first = next((j for j in range(n) if river[j] != econ[j]), None)
    return {"passes_compared": n, "passes_equal": equal, "exit_agreement": equal / n if n else None,
            "first_exit_difference": first}


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ---------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    economize, CONFIDENCE_MEASURES, CalmConfig, ConfidenceMeasure, SkipDecodeConfig = import_economize(
        args.economize_path)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from river_hf.eval.common import humaneval_problems, versions, write_json
    from river_hf.eval.tasks import humaneval_prompt
    from river_hf.models import encode_prompt, resolve
    from river_hf.river import ExitRule, ExitRuleList, MinLayerRule, RiverForCausalLM, StateTransitionSimilarityRule
    from river_hf.river import default_config

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")  # economize's layer call (HF 5.24)

    key = Path(args.model.rstrip("/")).name
    out_path = Path(args.out or ROOT / "docs" / "results" / f"economize_crosscheck_{key}.json")
    path = resolve(args.model, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)

    t0 = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # economize's copy (and the reference)
    cfg = base.config.get_text_config(decoder=True)
    L = cfg.num_hidden_layers
    river_defaults = default_config(args.model, cfg.model_type)
    tau = river_defaults.tau if args.tau is None else args.tau
    min_layer = river_defaults.min_layer if args.min_layer is None else args.min_layer
    k = args.exit_layer if args.exit_layer is not None else round(0.75 * L)
    if not 1 <= k < L:
        sys.exit(f"economize_crosscheck: --exit-layer must be in 1..{L - 1}, got {k}")
    if "calm-state" in args.settings and not 0.0 <= tau <= 1.0:
        sys.exit(f"economize_crosscheck: economize's CALM threshold must lie in [0, 1], got tau={tau}")
    decay = args.decay if args.decay is not None else max(1, args.new_tokens // 2)
    calm_schedule = ([int(x) for x in args.calm_schedule.split(",")] if args.calm_schedule
                     else [k, L, (k + L) // 2, L, k, L - 1])
    if any(not 1 <= e <= L for e in calm_schedule):
        sys.exit(f"economize_crosscheck: --calm-schedule entries must be in 1..{L}")

    # river-hf's copy: fp32, original head, prompt on the backbone; exit layers are plain copies (unused by the
    # baselines, "copy" is the cheapest to build).
    river = RiverForCausalLM.from_pretrained(args.model, tau=tau, min_layer=min_layer, strategy="state-propagation",
                                             prefill="backbone", exit_head=None, backend="copy", progress=False,
                                             dtype=torch.float32)
    load_seconds = time.perf_counter() - t0
    eos = base.generation_config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = base.generation_config.pad_token_id if base.generation_config.pad_token_id is not None else (eos_ids or [0])[0]

    # -- river-hf: per-pass exit layers (wrap the router's end-of-pass hook) --------------------------------
    router = river.river
    river_log: list[tuple[int, int]] = []  # (tokens, exit_layer) per forward pass of the current call
    _end = router.end

    def end(batch, tokens, cache=None):
        river_log.append((tokens, router._local.exit_layer))
        return _end(batch, tokens, cache)

    router.end = end

    class PassScheduleRule(ExitRule):
        """Exit decode pass j after ``schedule(j)`` backbone layers (j counted from the pass log: passes so far
        minus the prefill). Script-local, for the cross-check only."""

        def __init__(self, schedule):
            self.schedule = schedule

        def __call__(self, layer_idx, hidden_in, hidden_out, token_mask):
            j = len(river_log) - 1
            return layer_idx + 1 >= self.schedule(j)

        def to_dict(self):
            return {"type": "PassScheduleRule (benchmark-local)"}

    def river_generate(ids, strategy, rules):
        river_log.clear()
        with river.river_strategy(strategy), router.override(rules=rules):
            t = time.perf_counter()
            out = river.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 do_sample=False, pad_token_id=pad)
            seconds = time.perf_counter() - t
        stats = river.river_stats
        passes = list(river_log)
        return {"tokens": out[0, ids.shape[1]:].tolist(), "exit_layers": [e for _, e in passes[1:]],
                "prefill_exit_layer": passes[0][1] if passes else None, "pass_tokens": sorted({n for n, _ in passes[1:]}),
                "mean_exit_layer": stats.get("mean_exit_layer"), "exit_layer_counts": stats.get("exit_layer_counts"),
                "strategy": stats.get("strategy"), "seconds": seconds}

    # -- economize: per-pass exit layers (wrap each policy's meter) ------------------------------------------
    from economize.runtime import current_phase

    class ScheduleConfidence(ConfidenceMeasure):
        """Confidence 1 at the scheduled exit layer of the pass (counted from layer 1 of each pass), else 0."""

        schedule = staticmethod(lambda j: L)

        def __init__(self, technique):
            super().__init__(technique)
            self.passes = -1

        def __call__(self, index, x, out):
            if index == 1:
                self.passes += 1
            hit = index >= type(self).schedule(self.passes)
            return torch.full(out.shape[:2], 1.0 if hit else 0.0, dtype=torch.float32, device=out.device)

    if SCHEDULE_MEASURE not in CONFIDENCE_MEASURES:
        CONFIDENCE_MEASURES.register(SCHEDULE_MEASURE)(ScheduleConfidence)

    def econ_model(config):
        model = economize.apply(base, config)
        technique = next(iter(model.techniques.values()))
        make = technique.make_policy

        def make_policy():
            policy = make()
            record = policy.meter.record
            policy.crosscheck_log = log = []

            def logged(index, entered, ran, filled, phase=None):
                if str(phase if phase is not None else current_phase()) == "decode":
                    log.append((index, int(ran), int(filled)))
                return record(index, entered, ran, filled, phase)

            policy.meter.record = logged
            return policy

        technique.make_policy = make_policy
        return model, technique

    def econ_generate(model, technique, ids):
        if hasattr(technique, "measure") and hasattr(technique.measure, "passes"):
            technique.measure.passes = -1
        t = time.perf_counter()
        result = model.decode(ids[0], args.new_tokens, stop=eos_ids or None)
        seconds = time.perf_counter() - t
        log = technique.last_policy.crosscheck_log
        exits, contiguous, filled = [], True, []
        for index, ran, fill in log:  # one entry per layer per decode pass, layers 1..L in order
            if index == 1:
                exits.append(0)
                filled.append(0)
            if ran:
                contiguous &= exits[-1] == index - 1
                exits[-1] = index
            filled[-1] += fill
        tokens = result.tokens.tolist() if hasattr(result.tokens, "tolist") else list(result.tokens)
        stats = technique.depth_stats()
        return {"tokens": [int(x) for x in tokens], "exit_layers": exits, "mean_exit_layer": mean(exits),
                "kv_filled_layers_per_pass": filled, "ran_layers_contiguous": contiguous,
                "executed_fraction": stats.get("executed_fraction"), "seconds": seconds}

    # -- the settings ----------------------------------------------------------------------------------------
    def linear_budget(t):  # economize's documented SkipDecode schedule, computed here
        progress = min(max((t - args.warmup) / decay, 0.0), 1.0)
        return int(round(L - (L - k) * progress))

    def calm_at(j):
        return calm_schedule[j % len(calm_schedule)]

    horizon = args.new_tokens
    econ_linear = SkipDecodeConfig(max_layers=L, min_layers=k, warmup=args.warmup, decay=decay, skip="top")
    econ_budget = econ_linear.active_layers(torch.arange(horizon), L).tolist()
    ours_budget = [linear_budget(t) for t in range(horizon)]
    setups = {
        "skipdecode-constant": dict(
            econ=SkipDecodeConfig(max_layers=k, min_layers=k, skip="top"), strategy="skipdecode",
            rules=ExitRuleList([MinLayerRule(k), StateTransitionSimilarityRule(-2.0)]),
            describe=f"every decode pass exits after k={k} of {L} layers; skipped layers: no K/V"),
        "skipdecode-linear": dict(
            econ=econ_linear, strategy="skipdecode", rules=ExitRuleList([PassScheduleRule(linear_budget)]),
            describe=f"exit layer L={L} for {args.warmup} passes, then linear to k={k} over {decay} passes "
                     "(economize's SkipDecode schedule, skip='top'); skipped layers: no K/V",
            schedule=ours_budget, economize_schedule=econ_budget),
        "calm-schedule": dict(
            econ=CalmConfig(confidence=SCHEDULE_MEASURE, threshold=0.5, min_layer=1), strategy="state-propagation",
            rules=ExitRuleList([PassScheduleRule(calm_at)]), measure_schedule=calm_at,
            describe=f"exit layers cycle {calm_schedule} over the decode passes; skipped layers get the K/V of "
                     "the exit state (CALM state propagation)",
            schedule=[calm_at(j) for j in range(horizon)]),
        "calm-state": dict(
            econ=lambda: CalmConfig(confidence="state", threshold=tau, min_layer=min_layer),
            strategy="state-propagation",
            rules=ExitRuleList([MinLayerRule(min_layer), StateTransitionSimilarityRule(tau)]),
            describe=f"exit once cos(layer input, output) > tau={tau} after >= min_layer={min_layer} layers; "
                     "skipped layers get the K/V of the exit state"),
    }

    problems = humaneval_problems(args.prompts)
    prompts = [(p["task_id"], encode_prompt(tokenizer, humaneval_prompt(p)).input_ids) for p in problems]

    reference = {}
    if not args.no_reference:
        for task_id, ids in prompts:
            t = time.perf_counter()
            with torch.no_grad():
                out = base.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                    do_sample=False, pad_token_id=pad)
            reference[task_id] = {"tokens": out[0, ids.shape[1]:].tolist(), "seconds": time.perf_counter() - t}

    results = []
    for name in args.settings:
        setup = setups[name]
        if "measure_schedule" in setup:
            ScheduleConfidence.schedule = staticmethod(setup["measure_schedule"])
        if callable(setup["econ"]):
            setup["econ"] = setup["econ"]()
        model, technique = econ_model(setup["econ"])
        rows = []
        for task_id, ids in prompts:
            r = river_generate(ids, setup["strategy"], setup["rules"])
            e = econ_generate(model, technique, ids)
            agree = compare_tokens(r["tokens"], e["tokens"])
            row = {"task_id": task_id, "prompt_tokens": ids.shape[1], "river_hf": r, "economize": e,
                   "agreement": agree, "exits": compare_exits(r["exit_layers"], e["exit_layers"],
                                                             agree["first_divergence"])}
            if task_id in reference:
                ref = reference[task_id]["tokens"]
                row["vs_full_model"] = {"river_hf": compare_tokens(r["tokens"], ref)["overall_agreement"],
                                        "economize": compare_tokens(e["tokens"], ref)["overall_agreement"]}
            rows.append(row)
            print(f"[crosscheck] {name} {task_id}: agreement {agree['overall_agreement']:.3f} "
                  f"(first divergence {agree['first_divergence']})", file=sys.stderr, flush=True)
        econ_cfg = {f: getattr(setup["econ"], f) for f in setup["econ"].__dataclass_fields__}
        results.append({
            "setting": name, "description": setup["describe"],
            "river_hf": {"strategy": setup["strategy"], "rules": setup["rules"].to_list(), "prefill": "backbone",
                         "exit_head": None},
            "economize": {"technique": type(setup["econ"]).technique, "config": econ_cfg},
            **({"schedule": setup["schedule"]} if "schedule" in setup else {}),
            **({"economize_schedule": setup["economize_schedule"],
                "schedules_equal": setup["economize_schedule"] == setup["schedule"]}
               if "economize_schedule" in setup else {}),
            "summary": {
                "prompts": len(rows),
                "identical_prompts": sum(r["agreement"]["first_divergence"] is None for r in rows),
                "mean_prefix_agreement": mean(r["agreement"]["prefix_agreement"] for r in rows),
                "mean_overall_agreement": mean(r["agreement"]["overall_agreement"] for r in rows),
                "mean_exit_agreement": mean(r["exits"]["exit_agreement"] for r in rows),
                "river_mean_exit_layer": mean(r["river_hf"]["mean_exit_layer"] for r in rows),
                "economize_mean_exit_layer": mean(r["economize"]["mean_exit_layer"] for r in rows),
            },
            "prompts": rows,
        })

    import economize as _e
    versions_ = versions()
    versions_["economize"] = getattr(_e, "__version__", None)
    versions_["economize_path"] = os.path.dirname(os.path.dirname(os.path.abspath(_e.__file__)))
    report = {
        "command": [sys.executable, *sys.argv] if argv is None else ["economize_crosscheck.py", *argv],
        "versions": versions_,
        "model": {"key": args.model, "path": str(path), "model_type": cfg.model_type, "num_layers": L,
                  "dtype": "float32", "attn_implementation": base.config._attn_implementation},
        "generation": {"prompts": [t for t, _ in prompts], "prompt_format": "humaneval_prompt via chat template",
                       "new_tokens": args.new_tokens, "greedy": True, "stop": eos_ids},
        "parameters": {"k": k, "warmup": args.warmup, "decay": decay, "calm_schedule": calm_schedule, "tau": tau,
                       "min_layer": min_layer},
        "load_seconds": load_seconds,
        "reference": reference,
        "settings": results,
        "notes": [
            "exit layer = decoder layers a decode pass ran (L = no exit); decode pass j feeds generated token j, so "
            "exit layers are compared for passes before the first token divergence",
            "prefix_agreement = positions before the first divergence / length; overall_agreement = equal positions "
            "/ length (a missing token counts as different)",
            "vs_full_model = overall agreement with plain HF greedy decoding of the unmodified model",
        ],
    }
    write_json(out_path, report)

    print(f"\n{args.model}: L={L}, k={k}, tau={tau}, min_layer={min_layer}, {args.new_tokens} new tokens")
    head = f"{'setting':<20} {'prompt':<14} {'prefix':>6} {'overall':>7} {'1st div':>7} {'exit=':>9} " \
           f"{'river exit':>10} {'econ exit':>9} {'full(r/e)':>11}"
    print(head)
    print("-" * len(head))
    for res in results:
        for row in res["prompts"]:
            a, x = row["agreement"], row["exits"]
            full = row.get("vs_full_model")
            print(f"{res['setting']:<20} {row['task_id']:<14} {a['prefix_agreement']:>6.3f} {a['overall_agreement']:>7.3f} "
                  f"{str(a['first_divergence']):>7} {x['passes_equal']:>4}/{x['passes_compared']:<4} "
                  f"{row['river_hf']['mean_exit_layer'] or float('nan'):>10.2f} "
                  f"{row['economize']['mean_exit_layer'] or float('nan'):>9.2f} "
                  f"{('%.2f/%.2f' % (full['river_hf'], full['economize'])) if full else '-':>11}")
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
