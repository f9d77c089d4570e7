"""``river-hf bench``: River's speed and quality against the unmodified and the fully quantized model.

In one process, on the same prompts (the first N HumanEval prompts, chat template) and the same
number of new tokens (``min_new_tokens = max_new_tokens``, greedy, batch 1), it times with the
shared timer (:func:`river_hf.timing.compare`: warm-up, alternating order, >= 3 repeats, median and
min-max spread, per-round speedups, "not resolved" when a speedup's spread contains 1.0):

* ``unmodified``: the reference. By default the plain transformers model
  (:func:`plain_reference`: the architecture's own class holding the very same backbone weight
  tensors, no River wrapper, router or hook on its path); ``--reference backbone`` times the River
  model in ``river_mode("backbone")`` instead (every JSON and table says which it was:
  ``reference_kind``);
* ``fully <kernel>``: every decoder layer replaced by its exit copy and the exit head serving
  every step (``river_mode("exit")``), for the model's own exit kernels and, with
  ``--fully-quantized int4`` (the default when the exit layers are not 4-bit), for a second copy
  of the model built with 4-bit exit layers and head;
* River at each requested τ (``river_mode("route")``).

Figures per configuration: decode tokens/s (tokens after the first / time from the first to the
last token), end-to-end tokens/s, TTFT (s), speedup over the unmodified model (decode, per
round, against the reference run next to it), weight bytes read per decode step, achieved
bandwidth (GB/s) and its share of this machine's STREAM triad bandwidth (measured once per run at
the run's thread count; a sustained-bandwidth benchmark, not a limit), mean exit layer, and
next-token match and KL
(nats) from :func:`river_hf.eval.agreement.next_token_agreement` (River-LLM's quality measure:
follow the unmodified model's greedy continuation and count the steps where the argmax agrees;
the reference's own row has none, and a row whose agreement is missing says so: None, "n/a").
Free-running quality (HumanEval pass@1) comes from ``river-hf eval`` reports (``--eval-json``).

Writes a JSON report and a PNG: decode tokens/s (with its min-max spread) against next-token
match, against weight bytes per step, and against task accuracy when ``--eval-json`` reports
are given, each point labelled.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from .errors import RiverError
from .cli_args import add_river_arguments, existing_report, positive_int

__all__ = ["register", "handler", "run_bench", "plot_bench", "plain_reference", "REFERENCE_KINDS"]

#: What ``--reference`` may name as the unmodified model, and how tables describe it.
REFERENCE_KINDS = {
    "plain": "plain transformers model ({cls}: the architecture's own class on the same weight tensors, no River wrapper or hook)",
    "backbone": "River model in backbone mode (river_mode('backbone'): the same weights through River's wrappers and router)",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="decode tokens/s, TTFT, bandwidth and next-token match: unmodified vs fully quantized vs River at each τ",
        description=("In one process, on the same prompts (first N HumanEval prompts, chat template) and the same "
                     "number of new tokens (greedy, batch 1), times the unmodified model, the fully quantized model(s) "
                     "and River at each τ: warm-up, then alternating order over the repeats. Reports median decode "
                     "tokens/s with its min-max spread, the per-round speedup over the unmodified model (\"not "
                     "resolved\" when its spread contains 1.0), time to first token, weight bytes read per step, "
                     "achieved GB/s and its share of this machine's STREAM triad bandwidth, next-token match, KL and "
                     "mean exit layer; writes JSON and a PNG."),
    )
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="model key, Hub id or folder (default: %(default)s)")
    p.add_argument("--taus", action="append", metavar="TAUS",
                   help="comma list of τ (repeatable), e.g. 2,0.93,0.9; default: the model's τ")
    p.add_argument("--strategies", default="", metavar="NAMES",
                   help="comma list of exit-strategy baselines to time at each τ as well (recompute, skipdecode, "
                        "state-propagation, kv-mask; see river-hf pareto for their accuracy)")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="new tokens per prompt (default: %(default)s)")
    p.add_argument("--prompts", type=positive_int, default=3, help="first N HumanEval prompts (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats, alternating order (default: %(default)s)")
    p.add_argument("--fully-quantized", default="auto", choices=("auto", "int4", "none"),
                   help="also time a second copy of the model with every layer and the head 4-bit (auto: when the "
                        "exit layers are not already 4-bit)")
    p.add_argument("--reference", default="plain", choices=tuple(REFERENCE_KINDS),
                   help="the unmodified model timed as the reference: plain = the architecture's own transformers "
                        "class on the same weight tensors (default); backbone = the River model in backbone mode")
    add_river_arguments(p)
    p.add_argument("--eval-json", action="append", default=[], metavar="FILE",
                   help="river-hf eval report(s) (gsm8k/humaneval) to plot tokens/s against accuracy")
    p.add_argument("--out", default=None, help="JSON report (default: bench_<model>.json); the PNG goes next to it")
    p.add_argument("--plot-only", action="store_true",
                   help="run nothing: redraw the PNG of the existing --out report (e.g. with new --eval-json files)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=handler)


def _exit_label(model) -> str:
    """The row label of ``model``'s fully quantized configuration: its exit-layer kernels and which
    head serves the steps (the exit head's kernels, or the original head when there is none), so
    two different configurations never share a label."""
    choice = model.river_config.backend
    head = model.river_config.exit_head
    if head is None:
        return f"fully {choice} + original head"
    return f"fully {choice}" + (f" + {head} head" if head != choice else "")


def _tau_label(tau: float, taus) -> str:
    """``τ=<tau>``, with ``:g`` unless another τ of ``taus`` prints the same (then every digit)."""
    short = f"{tau:g}"
    return f"τ={short}" if sum(f"{t:g}" == short for t in taus) <= 1 else f"τ={tau!r}"


def _unique(labels: list[str]) -> list[str]:
    """``labels`` with a repeated one numbered (``"x"``, ``"x #2"``): every configuration keeps its own row."""
    out: list[str] = []
    for label in labels:
        name, n = label, 1
        while name in out:
            n += 1
            name = f"{label} #{n}"
        out.append(name)
    return out


def plain_reference(model):
    """The plain transformers model behind a River model, without a copy of its weights: the
    architecture's own class whose parameters and buffers are the River model's backbone tensors
    (:func:`river_hf.plain_model`), so no River wrapper, router or hook is on its path and its
    ``generate`` is transformers' own. The "unmodified" reference of a timing.

    Raises:
        RiverError: ``model`` is not a River model, or its backbone weights are offloaded (then
            time ``river_mode("backbone")`` instead: ``--reference backbone``).
    """
    from .river.plain import plain_model

    try:
        plain = plain_model(model)
    except RiverError as e:
        raise RiverError(f"{e}; or time the River model in backbone mode as the reference (--reference backbone)") \
            from None
    plain.generation_config.__dict__.pop("river_tau", None)
    return plain


def run_bench(model, prompt_ids, taus, *, new_tokens=64, repeats=3, progress=True, pad_token_id=None,
              extra_models: dict | None = None, strategies=(), reference="plain", bandwidth=True,
              interleave=True) -> tuple[list[dict], dict]:
    """Time and compare the configurations; see the module docstring for each figure.

    Args:
        model: a River model. prompt_ids: list of ``[1, tokens]`` long tensors. taus: River τ values
            (each applied per call: the model's own τ is unchanged afterwards).
        extra_models: label -> another River model of the same weights, timed in ``"exit"`` mode
            (e.g. the fully 4-bit model).
        strategies: baselines of :mod:`river_hf.river.strategies` (``"recompute"``, ...) timed at
            each τ as well, labelled ``"<strategy> τ=<t>"`` (River's own rows stay ``"τ=<t>"``).
        reference: the ``"unmodified"`` reference: ``"plain"`` (:func:`plain_reference`, the
            default), ``"backbone"`` (``model`` in ``river_mode("backbone")``), or a plain
            transformers model of the same weights.
        bandwidth: measure the STREAM bandwidth (:func:`river_hf.timing.stream_bandwidth`).
        interleave: run the reference next to every configuration (see :func:`river_hf.timing.compare`).

    Returns:
        ``(rows, info)``: one dict per configuration, every label distinct (``label``, ``mode``
        (``"plain"`` / ``"backbone"`` for the reference, ``"exit"``, ``"route"``), ``tau``,
        ``decode_tokens_per_s`` / ``tokens_per_s`` / ``ttft_s`` / ``speedup`` as
        ``{"median", "min", "max", "runs"}``, ``reference_runs``, ``verdict``, ``strategy``,
        ``ratio_to_unmodified`` (median decode speedup), ``weight_bytes_per_token`` (bytes per
        decode step), ``bandwidth_gb_s``, ``stream_triad_share`` (of the STREAM triad figure),
        ``mean_exit_layer``, ``exit_fraction``, ``next_token_match``, ``mean_kl`` (None for the
        reference itself and where no agreement row exists), ``agreement`` (``"reference"``,
        ``"measured"`` or ``"missing"``)); and ``info``: ``reference``, ``reference_kind``,
        ``stream_triad_gb_s``, ``stream_copy_gb_s``, ``stream_threads``, ``interleaved``.
    """
    import torch

    from .eval.tasks import agreement_over_prompts
    from .eval.agreement import reference_continuation
    from .timing import compare, measure_generate

    extra_models = extra_models or {}
    river = model.river_config.strategy
    L = model.river.num_layers
    if reference == "plain":
        ref_model = plain_reference(model)
    elif reference == "backbone":
        ref_model = model
    elif isinstance(reference, str):
        raise RiverError(f"reference must be one of {', '.join(REFERENCE_KINDS)} or a plain transformers model, "
                         f"got {reference!r}")
    else:
        ref_model = reference
    ref_mode = "backbone" if ref_model is model else "plain"
    reference_kind = REFERENCE_KINDS[ref_mode].format(cls=type(ref_model).__name__)
    configs = [("unmodified", ref_model, ref_mode, None, river), (_exit_label(model), model, "exit", None, river)]
    configs += [(label, m, "exit", None, m.river_config.strategy) for label, m in extra_models.items()]
    configs += [(_tau_label(t, taus), model, "route", t, river) for t in taus]
    configs += [(f"{s} {_tau_label(t, taus)}", model, "route", t, s) for s in strategies if s != river for t in taus]
    configs = [(label, *rest) for label, (_, *rest) in zip(_unique([c[0] for c in configs]), configs)]
    exits: dict[str, list[tuple[int, float, float]]] = {label: [] for label, *_ in configs}
    full_bytes = model.river_step_bytes(L, "river")  # every backbone layer and the original head

    def runner(label, m, mode, tau, strategy):
        def run():
            out = []
            with contextlib.ExitStack() as stack:
                if mode != "plain":
                    stack.enter_context(m.river_mode(mode))
                    stack.enter_context(m.river_strategy(strategy))
                    stack.enter_context(m.river_tau_override(tau))
                for ids in prompt_ids:
                    kw = {"weight_bytes_per_step": full_bytes} if mode == "plain" else {}
                    measured = measure_generate(m, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                                pad_token_id=pad_token_id, **kw)
                    out.append(measured)
                    if mode == "plain":  # transformers' own decoding: every step runs every layer
                        exits[label].append((measured.decode_steps, float(L), 0.0))
                    else:
                        s = m.river_stats
                        exits[label].append((s["decode_steps"], s["mean_exit_layer"], s["exit_fraction"]))
            return out
        return run

    comparison = compare({label: runner(label, m, mode, tau, s) for label, m, mode, tau, s in configs},
                         reference="unmodified", repeats=repeats, progress=progress, bandwidth=bandwidth,
                         reference_kind=reference_kind, interleave=interleave)

    # next-token agreement follows the timed reference's own greedy continuation
    refs = [reference_continuation(ref_model, ids, new_tokens) for ids in prompt_ids]
    agree, _ = agreement_over_prompts(model, prompt_ids, taus, max_new_tokens=new_tokens, progress=progress,
                                      exit_only=True, references=refs)
    agree_by = {(id(model), a["mode"], a["tau"], river): a for a in agree}
    for s in strategies:
        if s != river:
            with model.river_strategy(s):
                for a in agreement_over_prompts(model, prompt_ids, taus, max_new_tokens=new_tokens, progress=progress,
                                                references=refs)[0]:
                    agree_by[(id(model), a["mode"], a["tau"], s)] = a
    for m in extra_models.values():
        for a in agreement_over_prompts(m, prompt_ids, [], max_new_tokens=new_tokens, progress=progress,
                                        exit_only=True, references=refs)[0]:
            agree_by[(id(m), a["mode"], a["tau"], m.river_config.strategy)] = a

    triad = comparison.stream_triad_gb_s
    rows = []
    for label, m, mode, tau, strategy in configs:
        r = comparison.row(label)
        steps = sum(n for n, _, _ in exits[label])
        is_ref = label == "unmodified"
        a = None if is_ref else agree_by.get((id(m), mode, tau, strategy))
        config = model.river_config if mode == "plain" else m.river_config
        rows.append({
            **{k: r[k] for k in ("label", "decode_tokens_per_s", "tokens_per_s", "ttft_s", "speedup", "reference_runs",
                                 "verdict", "new_tokens", "bandwidth_gb_s")},
            "mode": mode, "tau": tau, "strategy": strategy,
            "exit_layers": None if is_ref else config.backend, "exit_head": None if is_ref else config.exit_head,
            "ratio_to_unmodified": r["speedup"]["median"],
            "weight_bytes_per_token": r["weight_bytes_per_step"],
            "stream_triad_share": (r["bandwidth_gb_s"] / triad) if triad and r["bandwidth_gb_s"] else None,
            "mean_exit_layer": sum(n * e for n, e, _ in exits[label]) / steps if steps else None,
            "exit_fraction": sum(n * f for n, _, f in exits[label]) / steps if steps else None,
            # the reference is what the others are compared with: it has no agreement figure of its own,
            # and a configuration without an agreement row is reported as missing (never as a match)
            "agreement": "reference" if is_ref else "measured" if a else "missing",
            "next_token_match": a["match_rate"] if a else None,
            "mean_kl": a["mean_kl"] if a else None,
            "agreement_positions": a["positions"] if a else None,
        })
    info = {"reference": "unmodified", "reference_kind": reference_kind, "interleaved": comparison.interleaved,
            "stream_triad_gb_s": triad, "stream_copy_gb_s": comparison.stream_copy_gb_s,
            "stream_threads": comparison.stream_threads}
    return rows, info


def _triad(report: dict) -> float | None:
    """The STREAM triad figure of a report (reports written before it existed kept their
    read-reduce figure as ``bandwidth_limit_gb_s``; that one is read, it is what they measured)."""
    return report.get("stream_triad_gb_s", report.get("bandwidth_limit_gb_s"))


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
        return f"{report['task']} {metric}", {float(r["tau"]): r[metric] for r in report["results"]
                                                 if r["tau"] is not None}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RiverError(f"--eval-json {path}: not a river-hf eval report ({type(e).__name__}: {e})") from None


def plot_bench(report: dict, png: str | Path, evals: list[tuple[str, dict]] = ()) -> None:
    """PNG of tokens/s against next-token match, against weight bytes read per decode step, and
    against each eval's score (one panel each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .files import save_figure

    rows = report["rows"]
    panels = 2 + len(evals)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    colors = {"plain": "tab:gray", "backbone": "tab:gray", "exit": "tab:red", "route": "tab:blue"}
    triad = _triad(report)

    def draw(ax, points, xlabel):
        labels: dict[tuple, list[str]] = {}  # points that coincide on the plot share one label
        for x, (y, lo, hi), label, mode in points:
            ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", color=colors[mode], capsize=3, zorder=3)
            labels.setdefault((round(x, 6), round(y, 2)), []).append(label)
        points = [(x, y[0], label, mode) for x, y, label, mode in points]
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
        ax.set_ylabel("decode tokens/s (median, min-max)")
        ax.grid(alpha=0.3)

    def speed(r):
        d = r["decode_tokens_per_s"]
        return d["median"], d["min"], d["max"]

    def match(r):  # the reference sits at 100 % by construction (the others follow its continuation)
        return 100.0 if r.get("agreement") == "reference" or r["mode"] in ("plain", "backbone") else \
            None if r["next_token_match"] is None else 100 * r["next_token_match"]

    draw(axes[0][0], [(match(r), speed(r), r["label"], r["mode"]) for r in rows if match(r) is not None],
         "next-token match vs unmodified (%)")
    draw(axes[0][1], [(r["weight_bytes_per_token"] / 1e6, speed(r), r["label"], r["mode"]) for r in rows],
         "weight MB read per decode step")
    for ax, (name, scores) in zip(axes[0][2:], evals):
        pts = [(100 * scores[r["tau"]], speed(r), r["label"], r["mode"])
               for r in rows if r["tau"] is not None and r["tau"] in scores]
        draw(ax, pts, f"{name} (%)")
    fig.suptitle(f"{report['model']}: {report['new_tokens']} new tokens x {report['prompts']} prompts, "
                 f"{report['repeats']} alternating repeats ({report['device']}"
                 + (f", STREAM triad {triad:.1f} GB/s" if triad else "") + ")"
                 + (f"; reference: {report['reference_kind']}" if report.get("reference_kind") else ""), fontsize=8)
    fig.tight_layout()
    save_figure(fig, png)


def handler(args) -> int:
    import torch

    from .eval.common import (check_output_path, humaneval_problems, load_river_model, log, parse_taus, river_overrides,
                              versions, write_json)
    from .eval.tasks import humaneval_prompt
    from .models import encode_prompt
    from .quant import get_backend, machine_id

    from .river.strategies import get_strategy

    taus = parse_taus(args.taus)
    strategies = [get_strategy(s.strip()).name for s in args.strategies.split(",") if s.strip()]
    if args.new_tokens < 2:
        raise RiverError("--new-tokens must be at least 2 (one prefill token plus decode steps to time)")
    evals = _merge_evals([_eval_scores(p) for p in args.eval_json])
    out = check_output_path(args.out or f"bench_{args.model.replace('/', '_')}.json")
    if args.plot_only:
        report = existing_report(out, "rows", "bench")
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
    settings = river_overrides(args)
    model, tokenizer, default_tau = load_river_model(args.model, progress=progress, **settings)
    if not taus:
        taus = [default_tau]
    extra = {}
    want_int4 = args.fully_quantized == "int4" or (
        args.fully_quantized == "auto" and not (get_backend(model.river_config.backend).bits == 4
                                                and model.river_config.exit_head is not None
                                                and get_backend(model.river_config.exit_head).bits == 4))
    if want_int4 and (model.river_config.backend, model.river_config.exit_head) != ("int4", "int4"):
        # (a model already on int4 exit layers and head would be the same configuration twice)
        four, _, _ = load_river_model(args.model, progress=progress, **{**settings, "backend": "int4", "exit_head": "int4"})
        extra[_exit_label(four)] = four
    prompt_ids = [encode_prompt(tokenizer, humaneval_prompt(p))["input_ids"].to(model.device)
                  for p in problems[: args.prompts]]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    river_config = model.river_config.to_dict()
    rows, info = run_bench(model, prompt_ids, taus, new_tokens=args.new_tokens, repeats=args.repeats,
                           progress=progress, pad_token_id=pad, extra_models=extra, strategies=strategies,
                           reference=args.reference)
    device = f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    report = {
        "model": args.model,
        "dtype": str(model.dtype).removeprefix("torch."),
        "checkpoint_note": ("offline registry checkpoints are GGUF files (Q4_K_M / Q4_1) dequantized to this dtype: the "
                            "unmodified model's weights already sit on a 4-bit grid"),
        "default_tau": default_tau,
        "taus": taus,
        "new_tokens": args.new_tokens,
        "prompts": len(prompt_ids),
        "prompt_tokens": [int(p.shape[1]) for p in prompt_ids],
        "repeats": args.repeats,
        "device": device,
        "machine": machine_id(model.device),
        **info,
        "num_layers": model.river.num_layers,
        "river_config": river_config,
        "river_build_seconds": model.river_build_seconds,
        "kernels": model.river_kernels(),
        "fully_quantized_kernels": {label: m.river_kernels() for label, m in extra.items()},
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
    print(format_rows(rows, info, args.repeats))
    log(f"wrote {out} and {png} ({report['wall_s']:.0f} s)")
    return 0


def format_rows(rows: list[dict], info: dict | float | None, repeats: int) -> str:
    """The bench table as text: decode tokens/s (min-max), speedup (min-max) and verdict, TTFT,
    GB/s and its % of the STREAM triad figure, mean exit layer, next-token match, KL; then which
    reference the speedups are against and the STREAM figures. ``info``: run_bench's second
    value (a bare number is taken as the STREAM triad GB/s)."""
    info = info if isinstance(info, dict) else {"stream_triad_gb_s": info}
    triad = _triad(info)
    lines = [f"{'configuration':<30} {'decode tok/s (min-max)':>23} {'× unmodified (min-max)':>34} {'TTFT s':>7} "
             f"{'GB/s':>5} {'% triad':>7} {'exit':>5} {'match':>6} {'KL':>7}"]
    for r in rows:
        d, sp = r["decode_tokens_per_s"], r["speedup"]
        ratio = "reference" if r["verdict"] == "reference" else \
            f"{sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f}) {r['verdict']}"
        bw = r["bandwidth_gb_s"]
        share = r.get("stream_triad_share", r.get("bandwidth_share"))
        share = f"{100 * share:6.0f}%" if share else ""
        exit_ = "" if r["mean_exit_layer"] is None else f"{r['mean_exit_layer']:5.1f}"
        ref = r.get("agreement") == "reference"
        match = "ref" if ref else "n/a" if r["next_token_match"] is None else f"{r['next_token_match']:6.3f}"
        kl = "ref" if ref else "n/a" if r["mean_kl"] is None else f"{r['mean_kl']:7.4f}"
        lines.append(f"{r['label']:<30} {d['median']:8.2f} ({d['min']:.2f}-{d['max']:.2f})     {ratio:>34} "
                     f"{r['ttft_s']['median']:7.2f} {'' if bw is None else f'{bw:5.1f}':>5} {share:>7} {exit_:>5} "
                     f"{match:>6} {kl:>7}")
    if info.get("reference_kind"):
        lines.append(f"reference 'unmodified': {info['reference_kind']}")
    order = ("the reference run next to each configuration (R A R B ...), reversed every other round"
             if info.get("interleaved", True) else "alternating order")
    lines.append(f"{repeats} rounds after a warm-up, {order}; speedups per pair of neighbouring runs, decode only "
                 "(TTFT apart)")
    if triad:
        from .timing import stream_line

        lines.append(stream_line(triad, info.get("stream_copy_gb_s"), info.get("stream_threads")))
    return "\n".join(lines)
