"""Where one decode step goes, per mode, and what fusing the exit layers' projections changes.

One process, one model load (``RiverForCausalLM.from_pretrained(--model)``, the model's own River
settings). Two parts:

**Step profile.** Each mode decodes the same prompt greedily, exactly ``--new-tokens`` tokens:

- ``unmodified``: the plain transformers model over River's backbone tensors (``river_hf.plain_model``);
- ``river``: River with the model's settings (route mode: the exit rule decides per step);
- ``exit``: fully quantized (``river_mode("exit")``: every layer its exit copy, the exit head);
- ``lossless``: River lossless with exit-path drafts only (``prompt_lookup_tokens=0``) and a
  constant draft length ``--draft-tokens`` k, split into its ``lossless draft`` passes (one token
  through the exit path) and its ``lossless verify`` passes (k+1 rows on the backbone).

Attribution is ``river_hf.bench_harness.step_profile`` (its docstring says what each category holds):
module forward hooks, exclusive wall time, in the categories backbone products, exit products, head,
attention, norms/rotary/elementwise, routing, forward glue and generate loop.

The decode step of a mode is the mean over its decode passes (the prefill pass is left out).
Profiler overhead: each profiled run is paired with an unprofiled run of the same mode, and the
profiled decode time per token is compared with the unprofiled one (``overhead``). The hooks' own
cost lands in the non-product categories, so each mode also gets its non-product share both ways:
``non_product_share`` (1 - products and head / the profiled pass) and, for the one-token modes,
``non_product_share_unprofiled`` (1 - a round's products / the same round's unprofiled decode step:
the median over the rounds, and their range).

**Fusion** (``--fusion``): the exit layers are built twice, with ``fuse_projections`` on and off
(same backbone, same kernel choice per shape, swapped in place), and ``river_hf.timing.compare``
times ``exit`` and ``river`` with each against the unmodified model: one warm-up, ``--repeats``
alternating rounds, median and min-max.

**Exit pass** (``--exit-pass``): ``exit`` and ``lossless`` (the model's own settings) with River's
exit-mode pass of the decoder stack (``river_hf.river.exit_pass``), decoding loop
(``river_hf.river.decode_loop``, exit mode only) and exit-mode step (``river_hf.river.exit_step``: the
loop's steps and lossless mode's drafts) and with the architecture's forward and transformers'
loop in their place, timed by ``river_hf.timing.compare`` (one warm-up, ``--repeats`` rounds,
alternating order, against ``exit`` without them), and the step profile of ``exit`` with each.

The 1-minute load average is recorded before and after (``river_hf.quant.autotune.load_average``);
on a loaded machine the timings mean little.

Run: ``python benchmarks/step_profile.py --model qwen2.5-coder-0.5b --new-tokens 64 --repeats 3 --fusion``
(writes ``docs/results/step_profile_<model>.json`` and ``.png``).
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

from river_hf.bench_harness.step_profile import CATEGORIES, StepProfiler, step_rows

PROMPT = ('def separate_paren_groups(paren_string: str) -> list[str]:\n    """Input to this function is a string '
          'containing multiple groups of nested parentheses. Separate those groups into separate strings and '
          'return the list of those."""\n')
MODES = ("unmodified", "river", "exit", "lossless")


def run_mode(model, plain, mode: str, gen: dict):
    """What one greedy generate call of ``mode`` needs: (the model, the mode's context, ``gen``: the
    generate keyword arguments of exactly the new tokens asked, EOS suppressed by
    ``bench_harness.SuppressIds``, as the speed benchmarks do; ``min_new_tokens`` would add
    transformers' per-step vocabulary scan to every mode)."""
    if mode == "unmodified":
        return plain, contextlib.nullcontext(), gen
    if mode == "river":
        return model, model.river_mode("route"), gen
    if mode == "exit":
        return model, model.river_mode("exit"), gen
    return model, model.river_mode("lossless"), gen


def lossless_settings(model, draft_tokens: int):
    """The model's settings with exit-path drafts only, k = ``draft_tokens`` every round."""
    return dataclasses.replace(model.river_config, prompt_lookup_tokens=0, draft_schedule="constant",
                               draft_tokens=draft_tokens, max_draft_tokens=max(draft_tokens,
                                                                                model.river_config.max_draft_tokens))


def profile(model, plain, inputs: dict, gen: dict, repeats: int, draft_tokens: int) -> dict:
    from river_hf.timing import measure_generate

    saved = model.river_config
    results: dict[str, list] = {}
    overhead: dict[str, list] = {m: [] for m in MODES}
    step_ms: dict[str, list] = {m: [] for m in MODES}
    try:
        model.river_config = lossless_settings(model, draft_tokens)
        for r in range(repeats + 1):  # round 0: warm-up, not kept
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                m, ctx, gen = run_mode(model, plain, mode, gen)
                with ctx:
                    bare = measure_generate(m, inputs, **gen)
                    with StepProfiler(m) as prof:
                        profiled = measure_generate(m, inputs, **gen)
                print(f"profile round {r}/{repeats} {mode}: {bare.decode_tokens_per_s:.2f} tokens/s unprofiled, "
                      f"{profiled.decode_tokens_per_s:.2f} profiled", flush=True)
                if r == 0:
                    continue
                per_token = lambda x: x.decode_s / max(x.decode_tokens, 1)  # noqa: E731
                overhead[mode].append(per_token(profiled) / per_token(bare) - 1.0)
                step_ms[mode].append(1e3 * per_token(bare))
                for label, row in step_rows(prof.passes, mode).items():
                    results.setdefault(label, []).append(row)
    finally:
        model.river_config = saved
    out = {}
    for label, rows in results.items():
        ms = {c: statistics.median(row["ms"][c] for row in rows) for c in CATEGORIES}
        totals = [sum(row["ms"].values()) for row in rows]
        total = statistics.median(totals)
        mode = "lossless" if label.startswith("lossless") else label
        products = sum(ms[c] for c in ("backbone products", "exit products", "head"))
        unprofiled = statistics.median(step_ms[mode])
        one_token = rows[0]["tokens_per_pass"] == 1 and mode != "lossless"
        # per round: that round's profiled products against the same round's unprofiled step (a run's memory
        # speed moves the products by up to ~25 % from round to round; the rest of the step stays)
        bare_shares = sorted(1.0 - sum(row["ms"][c] for c in ("backbone products", "exit products", "head")) / step
                             for row, step in zip(rows, step_ms[mode])) if one_token else None
        out[label] = {"ms": ms, "share": {c: v / total for c, v in ms.items()},
                      # everything but the products (and the head), of the profiled pass; and of the same
                      # mode's unprofiled decode step (one-token modes: a pass is a token), which leaves out
                      # what the hooks themselves cost: the median of the rounds' (each round's products
                      # against its own unprofiled step), and the rounds' range
                      "non_product_share": 1.0 - products / total,
                      "non_product_share_unprofiled": statistics.median(bare_shares) if one_token else None,
                      "non_product_share_unprofiled_range": [bare_shares[0], bare_shares[-1]] if one_token else None,
                      "total_ms": {"median": total, "min": min(totals), "max": max(totals)},
                      "passes_per_run": rows[0]["passes"], "tokens_per_pass": rows[0]["tokens_per_pass"],
                      "unprofiled_ms_per_token": unprofiled,
                      "profiler_overhead": {"median": statistics.median(overhead[mode]),
                                            "min": min(overhead[mode]), "max": max(overhead[mode])}}
    return out


def fusion(model, plain, inputs: dict, gen: dict, repeats: int) -> dict:
    """Decode tokens/s of ``exit`` and ``river`` with fused and unfused exit layers (see the module
    docstring)."""
    from river_hf.quant import KernelPlan, default_tuner
    from river_hf.river.build import build_exit_copy
    from river_hf.river.layer import RiverLayer
    from river_hf.timing import compare, measure_generate

    layers = [m for m in model.modules() if isinstance(m, RiverLayer)]
    config = model.river_config
    plan = KernelPlan(default_tuner(), config.kernel_choice)
    sets = {config.fuse_projections: [layer.exit_layer for layer in layers]}
    other = not config.fuse_projections
    with torch.no_grad():
        sets[other] = [build_exit_copy(layer.backbone, dataclasses.replace(config, fuse_projections=other), plan)
                       .eval() for layer in layers]

    def use(fuse: bool):
        for layer, exit_layer in zip(layers, sets[fuse]):
            layer.exit_layer = exit_layer

    def run(mode: str, fuse: bool):
        use(fuse)
        with model.river_mode(mode):
            return measure_generate(model, inputs, **gen)

    configs = {"unmodified": lambda: measure_generate(plain, inputs, **gen)}
    for mode in ("exit", "route"):
        for fuse in (True, False):
            label = f"{'fully quantized' if mode == 'exit' else 'river'} {'fused' if fuse else 'unfused'}"
            configs[label] = lambda mode=mode, fuse=fuse: run(mode, fuse)
    try:
        comparison = compare(configs, reference="unmodified", repeats=repeats, interleave=False, progress=True,
                             reference_kind="plain transformers model (river_hf.plain_model)")
    finally:
        use(config.fuse_projections)
    print(comparison.table())
    return comparison.to_dict()


def exit_pass(model, plain, inputs: dict, gen: dict, repeats: int) -> dict:
    """Decode tokens/s of ``exit`` and ``lossless`` with River's exit-mode pass and decoding loop
    (``river_hf.river.exit_pass.ExitPass``, ``river_hf.river.decode_loop``) and with the architecture's
    forward and transformers' loop in their place, and the step profile of ``exit`` with each:
    ``river_hf.timing.compare``, one warm-up, ``repeats`` rounds, each configuration once per round in
    alternating order, against ``exit`` on the architecture's forward and transformers' loop."""
    from river_hf.river import modeling
    from river_hf.river.exit_pass import ExitPass
    from river_hf.timing import compare, measure_generate

    stack = model.model
    installed = stack.__dict__["forward"]
    assert isinstance(installed, ExitPass)
    serves = modeling.serves_call
    profiles: dict[str, list] = {}

    def run(mode: str, ours: bool):
        if not ours:
            del stack.__dict__["forward"]
            modeling.serves_call = lambda *a, **k: False
        try:
            with model.river_mode(mode):
                measured = measure_generate(model, inputs, **gen)
                if mode == "exit":
                    with StepProfiler(model) as prof:
                        measure_generate(model, inputs, **gen)
                    label = "River's pass and loop" if ours else "transformers' forward and loop"
                    profiles.setdefault(label, []).append(step_rows(prof.passes, "exit")["exit"]["ms"])
                return measured
        finally:
            stack.__dict__["forward"] = installed
            modeling.serves_call = serves

    configs = {"fully quantized, transformers' forward and loop": lambda: run("exit", False),
               "fully quantized, River's pass and loop": lambda: run("exit", True),
               "lossless, transformers' forward": lambda: run("lossless", False),
               "lossless, River's pass": lambda: run("lossless", True)}
    comparison = compare(configs, reference="fully quantized, transformers' forward and loop", repeats=repeats,
                         interleave=False, progress=True,
                         reference_kind="the fully quantized model on the architecture's forward and transformers' loop")
    print(comparison.table())
    report = comparison.to_dict()
    # the warm-up's profile is the first of each list; the medians are over the timed rounds
    report["exit_profile_ms"] = {label: {c: statistics.median(run[c] for run in runs[1:]) for c in CATEGORIES}
                                 for label, runs in profiles.items()}
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from river_hf.files import save_figure

    labels = list(report["profile"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    left = [0.0] * len(labels)
    for c in CATEGORIES:
        vals = [report["profile"][lb]["ms"][c] for lb in labels]
        ax.barh(labels, vals, left=left, label=c)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode pass (exclusive wall time, module hooks)")
    ax.set_title(f"{report['model']}: one decode step, {report['threads']} threads, load {report['load_before']}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def table(report: dict) -> str:
    head = ("| mode | " + " | ".join(CATEGORIES) + " | total ms | profiler overhead | non-product share "
            "(profiled / unprofiled step) |")
    lines = [head, "|" + "---|" * (len(CATEGORIES) + 4)]
    for label, row in report["profile"].items():
        cells = [f"{row['ms'][c]:.2f} ({100 * row['share'][c]:.0f}%)" for c in CATEGORIES]
        o = row["profiler_overhead"]
        bare = row.get("non_product_share_unprofiled")
        share = f"{100 * row['non_product_share']:.0f}% / " + ("--" if bare is None else f"{100 * bare:.0f}%")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {row['total_ms']['median']:.1f} | "
                     f"{100 * o['median']:+.0f}% | {share} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft-tokens", type=int, default=4, help="lossless: constant draft length k")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--fusion", action="store_true", help="also time fused against unfused exit layers")
    p.add_argument("--exit-pass", action="store_true",
                   help="also time exit and lossless with River's exit pass and decoding loop and without them")
    p.add_argument("--no-profile", action="store_true", help="skip the step profile (only --fusion / --exit-pass)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a RiverConfig field for the build (JSON value), e.g. fuse_projections=false")
    p.add_argument("--out", default=None, help="JSON path (default docs/results/step_profile_<model>.json)")
    args = p.parse_args(argv)

    from river_hf import RiverForCausalLM, plain_model
    from river_hf.models import resolve
    from river_hf.quant.autotune import load_average
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        try:
            overrides[k] = json.loads(v)
        except ValueError:
            overrides[k] = v
    load_before = load_average()
    folder = resolve(args.model, progress=False)
    kwargs = {}
    if overrides:
        from river_hf.river.config import default_config

        kwargs["river_config"] = dataclasses.replace(default_config(args.model), **overrides)
    model = RiverForCausalLM.from_pretrained(args.model, progress=False, dtype=torch.float32, **kwargs)
    plain = plain_model(model)
    tok = AutoTokenizer.from_pretrained(folder)
    inputs = dict(tok(PROMPT, return_tensors="pt"))
    from river_hf.bench_harness.generation import exact_generation

    gen, _ = exact_generation(tok, model, args.new_tokens)
    report = {"model": args.model, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "draft_tokens": args.draft_tokens, "threads": torch.get_num_threads(),
              "river_config": {k: v for k, v in model.river_config.to_dict().items() if k != "kernel_choice"},
              "load_before": load_before, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "torch": torch.__version__}
    with torch.no_grad():
        if not args.no_profile:
            report["profile"] = profile(model, plain, inputs, gen, args.repeats, args.draft_tokens)
        if args.fusion:
            report["fusion"] = fusion(model, plain, inputs, gen, args.repeats)
        if args.exit_pass:
            report["exit_pass"] = exit_pass(model, plain, inputs, gen, args.repeats)
    report["load_after"] = load_average()
    out = Path(args.out or Path(__file__).resolve().parent.parent / "docs" / "results" / f"step_profile_{args.model}.json")
    from river_hf.files import write_json

    write_json(out, report)
    if "profile" in report:
        print(table(report))
        plot(report, out.with_suffix(".png"))
    print(f"load average {load_before} -> {report['load_after']}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
