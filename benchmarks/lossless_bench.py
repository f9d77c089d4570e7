"""River lossless against the other lossless decoders of transformers, through the shared timer.

One process, one model load. Every method decodes the same HumanEval prompts (``--problems``,
e.g. ``100-102``: HumanEval's own order), greedy, exactly ``--new-tokens`` new tokens each (EOS
suppressed by index, ``river_hf.bench_harness.SuppressIds``, as in heldout_speed.py), so every method generates the same number of tokens and, being
lossless, the same tokens as the reference. Timing is ``river_hf.timing.compare``: one untimed
warm-up of every method, then ``--repeats`` rounds in which the reference runs next to each method
(R A R B ..., order reversed every other round); each speedup is a method's decode tokens/s over
its neighbouring reference run, reported as median (min-max) with a verdict, end to end
(``tokens_per_s``: prompt included) and decode-only. Methods:

- ``unmodified`` (the reference): the plain transformers model (``river_hf.plain_model``: the
  architecture's own class over River's backbone tensors, no River wrapper or hook) with plain
  ``F.linear``, as a user has it;
- ``lossless``: River lossless with the model's own settings (``configs/<key>.json``: what a user
  gets);
- ``lossless-exit``: exit-path drafts only (``prompt_lookup_tokens=0``), the other settings the model's;
- ``lossless+lookup``: the model's settings with prompt-lookup rounds on every match
  (``prompt_lookup_tokens=10``, ``prompt_lookup_rule="always"``);
- ``lossless[KEY=VALUE;...]``: the model's settings with these ``RiverConfig`` fields replaced
  (e.g. ``lossless[draft_path=exit;draft_vocab=32768]``; values are JSON, or strings);
- ``prompt-lookup``: transformers' prompt lookup decoding on the plain model (``prompt_lookup_num_tokens=10``);
- ``early-exit``: transformers' ``assistant_early_exit`` on the plain model, at the layer River's
  exit path leaves the backbone most often (measured on the first prompt);
- ``assisted``: transformers' assisted generation on the plain model with ``--assistant`` drafting;
- ``unmodified-onednn``: the plain model with every Linear call, one row included, on prepacked
  oneDNN (``river_hf.bench_harness.plain_onednn_mode``: a view of lossless mode's own verify copy, no memory added):
  the faster fp32 reference where MKL's one-row product is slow (the 2-core AMD EPYC machine), so
  lossless mode's speedup can be read against both;
- ``llama.cpp``: llama-cpp-python on the very GGUF the fp32 checkpoint was dequantized from, the same
  prompt ids and token counts (``river_hf.bench_harness.LlamaCppRunner``; only when ``llama_cpp`` imports: it
  builds from its PyPI sdist and is not a river-hf dependency).

The same kernel treatment for every method: every multi-row forward of the main model's
backbone weights (prefill, verify, a draft model's multi-token catch-up) runs inside the one
verify-kernel mode River's lossless mode chose on this machine (``RiverConfig.verify_kernel``:
prepacked oneDNN where it measured faster and fits in memory), and no one-row forward does (River's
drafts, the early-exit drafts, a decode step). River gets this from its own hooks; the plain model
gets it from a forward hook that enters the mode only for inputs of more than one token.
``--baseline-verify-kernel torch`` gives the baselines plain ``F.linear`` instead. The ``assisted``
drafter (another model) never runs in it (its weights are not packed).

Per method, besides the timer's rows: whether each completion equals the reference's token for
token, acceptance rate, tokens per verify, and for River the time per draft and per verify in
reference decode steps. JSON + PNG + Markdown.

Prompts: ``--prompts humaneval:100-102,gsm8k:100-101`` (HumanEval's own order; GSM8K test-split
order, ``$RIVER_HF_CACHE/data/gsm8k/test.jsonl`` or ``--gsm8k-data``), ``--problems`` being the HumanEval
part alone; ``--set-name`` says which set it is (``tuning``: defaults may be chosen on it;
``held-out``: no default was).

    python benchmarks/lossless_bench.py --model qwen2.5-coder-0.5b --problems 100-102 --new-tokens 128 \\
        --out docs/results/lossless_heldout_qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import torch

from river_hf.bench_harness import (EOS_SUPPRESSED, LlamaCppRunner, available, exact_generation, lossless_settings,
                                    multi_row_kernel_hooks, parse_problems, parse_prompt_sets, plain_onednn_mode,
                                    prompt_texts, split_methods)
from river_hf.bench_harness.output import command_line, compare_protocol, write_report

METHODS = ("unmodified", "lossless", "lossless-exit", "lossless+lookup", "prompt-lookup", "early-exit", "assisted",
           "unmodified-onednn", "llama.cpp")


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
        self.record["verifies"] += 1
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
    ap.add_argument("--problems", default=None, help="HumanEval indices, e.g. 100-102 or 0-19 (default 100-102)")
    ap.add_argument("--prompts", default=None,
                    help="prompt set, e.g. humaneval:100-102,gsm8k:100-101 (replaces --problems)")
    ap.add_argument("--gsm8k-data", default=None, help="GSM8K test JSON-lines file (default: $RIVER_HF_CACHE/data/gsm8k/test.jsonl)")
    ap.add_argument("--set-name", default="held-out", choices=("tuning", "held-out"),
                    help="which set the prompts are: tuning (defaults may be chosen on it) or held-out")
    ap.add_argument("--new-tokens", type=int, default=128, help="exact new tokens per prompt (EOS suppressed)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tau", type=float, default=None, help="River's τ for the drafts (default: the model's config)")
    ap.add_argument("--baseline-verify-kernel", choices=("same", "torch"), default="same")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from river_hf import RiverForCausalLM, plain_model
    from river_hf.models import encode_prompt, gguf_file, is_key, resolve
    from river_hf.quant import linear_weight_bytes
    from river_hf.river.arch import decoder_stack
    from river_hf.river.lossless import verify_mode
    from river_hf.timing import TokenTimer, compare

    methods = split_methods(args.methods) if args.methods else [
        m for m in METHODS if (m != "assisted" or args.assistant) and (m != "llama.cpp" or available())]
    try:
        variants = {m: lossless_settings(m) for m in methods}
    except ValueError as e:
        ap.error(str(e))
    unknown = {m for m in methods if m not in METHODS and variants[m] is None}
    if unknown or "unmodified" not in methods:
        ap.error(f"--methods: unknown {sorted(unknown)}" if unknown else "--methods must include unmodified")
    if "assisted" in methods and not args.assistant:
        ap.error("the assisted method needs --assistant KEY")
    if "llama.cpp" in methods and not available():
        ap.error("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python builds it from source)")
    if "llama.cpp" in methods and not is_key(args.model):
        ap.error("llama.cpp needs a model key (its GGUF): " + args.model)
    if args.new_tokens < 2 or args.repeats < 1:
        ap.error("--new-tokens must be >= 2 and --repeats >= 1")

    t0 = time.time()
    torch.manual_seed(0)
    # the GGUF first: a key's conversion then reads this copy instead of downloading it again
    path = gguf_file(args.model, progress=True) if "llama.cpp" in methods else None
    river = RiverForCausalLM.from_pretrained(args.model, tau=args.tau, dtype=torch.float32, progress=False)
    plain = plain_model(river)
    tok = AutoTokenizer.from_pretrained(resolve(args.model, progress=False))
    assistant = None
    if "assisted" in methods:
        assistant = AutoModelForCausalLM.from_pretrained(resolve(args.assistant, progress=False),
                                                         dtype=torch.float32).eval()
    if args.prompts and args.problems:
        ap.error("give --prompts or --problems, not both")
    try:
        wanted = parse_prompt_sets(args.prompts) if args.prompts else [("humaneval", i) for i in parse_problems(args.problems or "100-102")]
        names, texts = prompt_texts(wanted, args.gsm8k_data)
    except ValueError as e:
        ap.error(str(e))
    prompts = [encode_prompt(tok, text)["input_ids"] for text in texts]
    gen, eos = exact_generation(tok, river, args.new_tokens)

    _, layers = decoder_stack(river)
    layer_bytes = [linear_weight_bytes(layer.backbone) for layer in layers]
    head_bytes = linear_weight_bytes(river.get_output_embeddings().backbone)
    full_bytes = sum(layer_bytes) + head_bytes

    # the layer River's exit path leaves the backbone at most often (route mode, first prompt)
    with torch.no_grad(), river.river_mode("route"):
        river.generate(prompts[0], **{**gen, "max_new_tokens": 64, "logits_processor": None})  # EOS allowed
    counts = river.river_stats["exit_layer_counts"]
    early_exit_layer = max(1, max(range(len(counts) - 1), key=lambda k: counts[k]) if sum(counts[:-1]) else len(counts) // 2)

    config = river.river_config
    kernel, kernel_info = verify_mode(river, config.verify_kernel, config.max_draft_tokens + 1)
    baseline_kernel = kernel if args.baseline_verify_kernel == "same" else None
    onednn = onednn_note = None
    if "unmodified-onednn" in methods:
        try:
            onednn, onednn_note = plain_onednn_mode(river, plain, max(p.shape[1] for p in prompts) + args.new_tokens)
        except ValueError as e:
            ap.error(f"unmodified-onednn: {e}; leave it out")
    llm = None
    if "llama.cpp" in methods:
        llm = LlamaCppRunner(path, n_ctx=max(p.shape[1] for p in prompts) + args.new_tokens + 8,
                             threads=torch.get_num_threads(), eos=eos, new_tokens=args.new_tokens)

    tokens: dict[str, list[list[int]]] = {}
    last: dict[str, list[dict]] = {}

    def run(method):
        """All prompts once with ``method``; a list of Measurements (one per prompt)."""
        measurements, stats_rows, outs = [], [], []
        for ids in prompts:
            record = {"verifies": 0, "rounds": 0, "drafted": 0, "accepted": 0}
            extra, handles, model, mode = {}, [], plain, contextlib.nullcontext()
            if method == "llama.cpp":
                m, new = llm.run(ids)
                measurements.append(m)
                stats_rows.append({"verifies": 0, "drafted": 0, "accepted": 0, "rounds": 0})
                outs.append(new)
                continue
            if variants[method] is not None:
                model, mode = river, river.river_mode("lossless")
                river.river_config = dataclasses.replace(config, **variants[method])
            elif method == "unmodified-onednn":
                mode = onednn
            elif method != "unmodified":
                extra = {"prompt-lookup": {"prompt_lookup_num_tokens": 10},
                         "early-exit": {"assistant_early_exit": early_exit_layer},
                         "assisted": {"assistant_model": assistant}}[method]
                original = type(plain)._get_candidate_generator
                plain._get_candidate_generator = lambda *a, **kw: _CountingDrafter(original(plain, *a, **kw), record)
                if baseline_kernel is not None:
                    handles = multi_row_kernel_hooks(plain, baseline_kernel)
            timer = TokenTimer()
            try:
                with torch.no_grad(), mode:
                    timer.reset()
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=timer, **gen, **extra)
            finally:
                plain.__dict__.pop("_get_candidate_generator", None)
                for h in handles:
                    h.remove()
                river.river_config = config
            new = out[0, ids.shape[1]:].tolist()
            m = timer.measurement(returned_tokens=len(new))
            row = {"verifies": record["verifies"], "drafted": record["drafted"], "accepted": record["accepted"],
                   "rounds": record["rounds"]}
            if model is river:
                ll = river.river_stats["lossless"]
                row = {k: ll[k] for k in ("rounds", "drafted", "accepted", "lookup_rounds", "lookup_drafted",
                                          "lookup_accepted", "lookup_declined", "draft_seconds", "verify_seconds",
                                          "mean_draft_exit_layer", "draft_cost_steps", "verify_cost_steps",
                                          "backbone_step_seconds", "draft_path", "draft_vocab")}
                row["verifies"] = ll["rounds"] + ll["lookup_rounds"]
                bytes_total = river.river_stats["weight_bytes_per_token"] * m.decode_tokens
            elif method in ("unmodified", "unmodified-onednn"):
                bytes_total = full_bytes * m.decode_steps
            else:
                draft_bytes = {"prompt-lookup": 0, "early-exit": sum(layer_bytes[:early_exit_layer]) + head_bytes,
                               "assisted": linear_weight_bytes(assistant) if assistant is not None else 0}[method]
                bytes_total = max(record["verifies"] - 1, 0) * full_bytes + record["drafted"] * draft_bytes
            m.weight_bytes_per_step = bytes_total / max(m.decode_steps, 1)
            measurements.append(m)
            stats_rows.append(row)
            outs.append(new)
        tokens[method], last[method] = outs, stats_rows
        return measurements

    comparison = compare({m: (lambda m=m: run(m)) for m in methods}, reference="unmodified", repeats=args.repeats,
                         progress=True, reference_kind="plain transformers model (river_hf.plain_model), F.linear")

    ref_tokens = tokens["unmodified"]
    step_s = 1.0 / comparison.row("unmodified")["decode_tokens_per_s"]["median"]
    summary = {}
    for m in methods:
        rs = last[m]
        drafted = sum(r["drafted"] + r.get("lookup_drafted", 0) for r in rs)
        accepted = sum(r["accepted"] + r.get("lookup_accepted", 0) for r in rs)
        verifies = sum(r["verifies"] for r in rs)
        s = {"identical_completions": sum(a == b for a, b in zip(tokens[m], ref_tokens)),
             "acceptance_rate": accepted / drafted if drafted else None,
             "tokens_per_verify": (len(prompts) * (args.new_tokens - 1)) / verifies if verifies and m != "unmodified" else None}
        if variants[m] is not None:
            xd, xa = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
            ld, la = sum(r["lookup_drafted"] for r in rs), sum(r["lookup_accepted"] for r in rs)
            ds, vs = sum(r["draft_seconds"] for r in rs), sum(r["verify_seconds"] for r in rs)
            s.update(exit_path_acceptance_rate=xa / xd if xd else None, lookup_acceptance_rate=la / ld if ld else None,
                     draft_seconds=ds, verify_seconds=vs,
                     draft_cost_in_backbone_steps=(ds / xd) / step_s if xd else None,
                     verify_cost_in_backbone_steps=(vs / verifies) / step_s if verifies else None)
        summary[m] = s
    report = {
        "command": command_line(argv),
        "model": args.model, "assistant": args.assistant, "problems": names,
        "set": args.set_name, "lossless_settings": {m: v for m, v in variants.items() if v is not None},
        "new_tokens": args.new_tokens, "greedy": True, "eos_suppressed": EOS_SUPPRESSED, "num_layers": len(layers),
        "river_config": config.to_dict(), "early_exit_layer": early_exit_layer,
        "verify_kernel": kernel_info, "baseline_verify_kernel": "same as River's" if baseline_kernel else "torch",
        "onednn_copy": onednn_note, "llama_cpp_version": llm.version if llm is not None else None,
        "gguf_weight_bytes": llm.weight_bytes if llm is not None else None,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "full_weight_bytes": full_bytes,
        "protocol": compare_protocol(args.repeats, args.new_tokens),
        "comparison": comparison.to_dict(), "summary": summary, "tokens": tokens, "per_prompt_stats": last,
        "wall_seconds": time.time() - t0,
    }
    write_report(args.out, report, markdown(report), _figure(report))
    print(comparison.table())
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    """The result as a Markdown table (what docs/lossless.md quotes), with the command and protocol."""
    from river_hf.timing import bandwidth_cell, markdown_rows

    comp = report["comparison"]
    n = len(report["problems"])
    kinfo = report["verify_kernel"]
    triad = comp["stream_triad_gb_s"]
    lines = [f"`{report['command']}`", "",
             f"{report['model']}, {report.get('set', 'held-out')} set: {', '.join(report['problems'])} ({n} prompts), greedy, "
             f"exactly {report['new_tokens']} new tokens each ({report['eos_suppressed']}); reference: {comp['reference_kind']}; "
             f"verify kernel {kinfo['kernel']} ({kinfo['why']}; baselines: {report['baseline_verify_kernel']}); "
             f"early exit at layer {report['early_exit_layer']} of {report['num_layers']}; {report['protocol']}; "
             f"{report['threads']} threads; STREAM triad {triad or float('nan'):.1f} GB/s."
             + (f" unmodified-onednn: every Linear call on prepacked oneDNN ({report['onednn_copy']})."
                if report.get("onednn_copy") else "")
             + (f" llama.cpp: llama-cpp-python {report['llama_cpp_version']} on the same GGUF."
                if report.get("llama_cpp_version") else ""), ""]

    def acceptance(r):
        s = report["summary"][r["label"]]
        acc = "" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"
        if s.get("lookup_acceptance_rate") is not None:
            acc += f" (exit path {s['exit_path_acceptance_rate'] or 0:.2f}, lookup {s['lookup_acceptance_rate']:.2f})"
        return acc

    def per_verify(r):
        tpv = report["summary"][r["label"]]["tokens_per_verify"]
        return "" if tpv is None else f"{tpv:.2f}"

    lines += markdown_rows(comp, {
        "identical": lambda r: f"{report['summary'][r['label']]['identical_completions']}/{n}",
        "acceptance": acceptance, "tokens/verify": per_verify, "GB/s (% triad)": lambda r: bandwidth_cell(r, triad)})
    for name, s in report["summary"].items():
        if s.get("draft_cost_in_backbone_steps") is not None:
            lines += ["", f"{name}: one exit-path draft costs {s['draft_cost_in_backbone_steps']:.2f} and one verify "
                          f"{s['verify_cost_in_backbone_steps']:.2f} plain decode steps (last round; drafting "
                          f"{s['draft_seconds']:.1f} s, verifying {s['verify_seconds']:.1f} s)."]
    return "\n".join(lines) + "\n"


def _figure(report: dict):
    from river_hf.timing import bar_figure

    return bar_figure(
        report["comparison"]["rows"],
        f"{report['model']}: lossless decoders, {report.get('set', 'held-out')} set of {len(report['problems'])} prompts, "
        f"{report['new_tokens']} tokens each",
        ylabel="decode speedup vs plain model\n(median, min-max over rounds)", figsize=(7, 3.6),
        color=lambda n: "#888" if n == "unmodified" else "#1f77b4" if n.startswith("lossless") else "#ff7f0e",
        tick=lambda n: n.replace("+", "+\n"))


if __name__ == "__main__":
    raise SystemExit(main())
