"""Held-out decode speed of every River mode against the plain model, a bf16 backbone and llama.cpp.

One process. Every method decodes the same prompts (``--prompts``, e.g. ``humaneval:100-102``:
problems no default was chosen on), greedy, exactly ``--new-tokens`` new tokens each (EOS
suppressed); ``--batch N`` decodes the prompts N at a time, left-padded, as one ``generate`` call
each (every row exactly ``--new-tokens``; tokens/s count every row's tokens). Methods (``--methods``, default all that can run here):

- ``unmodified`` (the reference): the plain transformers model in fp32 (``river_hf.plain_model``:
  the architecture's own class over River's backbone tensors, no River code on its path);
- ``river``: River with the model's own settings (``configs/<key>.json``: τ, min layer, int4 exit
  layers and head, the prompt on the backbone);
- ``exit``: fully quantized (``river_mode("exit")``: every layer its exit copy, the exit head);
- ``lossless``: River lossless with the model's own settings (the plain model's tokens); with
  ``--batch N`` River's batched lossless loop, whose streamer puts (rectangles of final columns,
  the first right after the prefill) the ``TokenTimer`` counts like any batch: every row's tokens
  once, ``returned_tokens`` = rows x new columns;
- ``unmodified-bf16``, ``river-bf16``, ``exit-bf16``: the same with the backbone loaded in bf16
  (a second load; the exit layers' kernels are chosen for bf16 inputs);
- ``unmodified-onednn``: the plain fp32 model with every Linear call (one row included) on oneDNN
  over weights packed once (``river_hf.bench_harness.plain_onednn_mode``: a view of the copy River's lossless
  mode packs for its verifies, where it packs one, else a second copy of the weights in memory): the plain model on torch's other fp32 kernel, where MKL's one-row product is
  slow (the 2-core AMD EPYC machine), so the speedups can be read against the faster fp32 baseline;
- ``unmodified-river-fp32``: the plain fp32 model with every Linear call of 1-8 rows on river-hf's own
  fp32 product (``river_hf.quant.dense_river.RiverFp32Linear``, on the weights as they are, no copy) and
  longer calls (the prompt pass) on the ``unmodified-onednn`` copy where that method runs too, else on
  ``F.linear``: the plain model on the fastest fp32 kernels River itself uses. Both plain-model
  methods enter their mode around each Linear only (``linears_in_mode``), the scope River gives its
  backbone kernel, so neither side pays the mode's dispatch on its other ops;
- ``unmodified-river-grid``: the plain fp32 model with its Linear calls of up to the rows River's
  grid measured faster at read from the GGUF's own grid (``river_hf.quant.grid.GridLinear`` over the
  grids River read, ``RiverConfig.backbone_grid``: the same weights bit for bit, about 1.25 bytes a
  weight), other calls as ``unmodified-river-fp32``: the plain model on the kernel River's backbone
  layers use, so River's gain over it is read in the same run;
- ``river-onednn``: River (route mode) with its backbone Linears' calls on that same packed copy (the
  plain model shares River's backbone tensors; the exit layers keep their quantized kernels): what
  routing River's one-row backbone products through oneDNN would give, measured before building it;
- ``river-mkl``: River with ``backbone_kernel="torch"`` for the run: its backbone layers on
  ``F.linear`` (MKL's one-row product), as before route mode read the packed oneDNN copy, so the
  pair ``river`` / ``river-mkl`` shows what that kernel buys in one run;
- ``exit-noprompt``: ``exit`` with every exit Linear's prompt kernel (``RiverConfig.prompt_kernel``,
  off by default: ``--set prompt_kernel=true``) bypassed for the run (``prompt_kernels_off``): its
  prompt pass on the one-row kernels; the same model and decode kernels, so the pair shows what
  they buy (without prompt kernels the two are the same model);
- ``river-fused``, ``exit-fused``, ``lossless-fused``: the same modes on a second River model whose
  exit layers are River's own fused layers over stacked q/k/v and gate/up products (``FUSED``:
  ``exit_layer_impl="auto"``, ``fuse_projections=True``; the backbone is the same architecture code), so
  fused against architecture exit layers is read from one run;
- ``lossless[KEY=VALUE;...]``: ``lossless`` with these ``RiverConfig`` fields replaced for its
  calls (values JSON or strings, e.g. ``lossless[draft_schedule=cost-flat]``), so settings are
  compared in one run, at any ``--batch``;
- ``llama.cpp``: llama-cpp-python on the very GGUF the fp32 checkpoint was dequantized from
  (``river_hf.models.gguf_file``), ``--threads`` threads, fed the same prompt token ids; only
  when ``llama_cpp`` imports (it builds from its PyPI sdist; not a dependency of river-hf).

EOS suppression: every transformers method gets one ``LogitsProcessor`` that sets the EOS logits
to -inf by index (``river_hf.bench_harness.SuppressIds``, which says why not ``min_new_tokens``),
llama.cpp the same through its ``logits_processor``.

Timing is ``river_hf.timing.compare``: one untimed warm-up of every method, then ``--repeats``
rounds in which the reference runs next to each method (R A R B ..., reversed every other round);
end-to-end tokens/s (prompt included) and decode-only tokens/s, median (min-max), speedups per
neighbouring pair. Weight bytes per decode step: the Linear weights a step reads (River: its
``river_stats``; llama.cpp: the GGUF's tensor data less the token-embedding table's rows a step does
not read, ``river_hf.bench_harness.gguf_tensor_bytes``), and
the achieved GB/s as a share of this machine's STREAM triad. Per method the JSON also has its
tokens and whether each completion equals the fp32 reference's. JSON + Markdown + PNG.

    python benchmarks/heldout_speed.py --model qwen2.5-coder-0.5b --prompts humaneval:100-102 \\
        --new-tokens 128 --repeats 3 --out docs/results/heldout_speed_qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import torch

from river_hf.bench_harness import (EOS_SUPPRESSED, LlamaCppRunner, available, config_overrides, exact_generation,
                                    left_padded, linears_in_mode, lossless_settings, parse_prompt_sets,
                                    plain_onednn_mode, prompt_kernels_off, prompt_texts, split_methods)
from river_hf.bench_harness.output import command_line, compare_protocol, write_report
from river_hf.quant.dense_river import RiverFp32Linear

METHODS = ("unmodified", "river", "exit", "exit-noprompt", "lossless", "unmodified-bf16", "river-bf16", "exit-bf16",
           "unmodified-onednn", "river-onednn", "unmodified-river-fp32", "unmodified-river-grid", "llama.cpp", "river-fused", "exit-fused",
           "lossless-fused", "river-mkl")
#: what the ``-fused`` methods change: River's own fused exit layers over stacked q/k/v and gate/up products
#: (a second River model, same kernels chosen by the same rules)
FUSED = {"exit_layer_impl": "auto", "fuse_projections": True}


@contextlib.contextmanager
def settings(model, fields: dict):
    """Within the block ``model.river_config`` has ``fields`` replaced (read at each call)."""
    old = model.river_config
    model.river_config = dataclasses.replace(old, **fields)
    try:
        yield
    finally:
        model.river_config = old


@contextlib.contextmanager
def backbone_kernel(model, kernel: str):
    """Within the block ``model``'s route-mode calls give their backbone layers ``kernel``
    (``RiverConfig.backbone_kernel``, read at each call)."""
    old = model.river_config.backbone_kernel
    model.river_config.backbone_kernel = kernel
    try:
        yield
    finally:
        model.river_config.backbone_kernel = old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--methods", default=None, help=f"comma list from {', '.join(METHODS)} (default: all that run "
                                                    "here but exit-noprompt)")
    ap.add_argument("--prompts", default="humaneval:100-102", help="e.g. humaneval:100-102,gsm8k:100-101")
    ap.add_argument("--gsm8k-data", default=None)
    ap.add_argument("--set-name", default="held-out", choices=("tuning", "held-out"))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-interleave", action="store_true",
                    help="one reference run per round, every method once in an order reversed each round, instead "
                         "of the reference next to each method (R A R B ...): the slow plain model runs once a round, "
                         "not once per method (for long runs on a quiet machine)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences per generate call, left-padded (default: 1; llama.cpp runs batch 1 only)")
    ap.add_argument("--threads", type=int, default=None, help="torch (and llama.cpp) threads (default: torch's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a RiverConfig field for every River model (JSON value), e.g. fuse_projections=true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    has_llama = available()
    methods = split_methods(args.methods) if args.methods else [  # exit-noprompt only when named
        m for m in METHODS if (m != "llama.cpp" or has_llama) and m != "exit-noprompt"]
    try:
        variants = {m: lossless_settings(m) for m in methods if m.startswith("lossless[")}
    except ValueError as e:
        ap.error(str(e))
    unknown = [m for m in methods if m not in METHODS and m not in variants]
    if unknown or "unmodified" not in methods:
        ap.error(f"--methods: unknown {unknown}" if unknown else "--methods must include unmodified")
    if "llama.cpp" in methods and not has_llama:
        ap.error("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python builds it from source)")
    if args.new_tokens < 2 or args.repeats < 1 or args.batch < 1:
        ap.error("--new-tokens must be >= 2, --repeats >= 1 and --batch >= 1")
    if args.batch > 1 and "llama.cpp" in methods:
        if args.methods:
            ap.error("llama.cpp runs batch 1 only: leave it out of --methods with --batch > 1")
        methods.remove("llama.cpp")
    try:
        overrides = config_overrides(args.set)
    except ValueError as e:
        ap.error(str(e))

    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM, plain_model
    from river_hf.models import encode_prompt, gguf_file, is_key, resolve
    from river_hf.quant import linear_weight_bytes
    from river_hf.quant.autotune import load_average
    from river_hf.river.config import default_config
    from river_hf.timing import TokenTimer, compare

    if "llama.cpp" in methods and not is_key(args.model):
        ap.error("llama.cpp needs a model key (its GGUF): " + args.model)
    t0 = time.time()
    load_before = load_average()
    if load_before > 1.25 * (os.cpu_count() or 1):
        print(f"heldout_speed: warning: the 1-minute load average is {load_before:.1f} on {os.cpu_count()} cores; "
              "other work is running and the timings will mean little", file=sys.stderr)
    try:
        names, texts = prompt_texts(parse_prompt_sets(args.prompts), args.gsm8k_data)
    except ValueError as e:
        ap.error(str(e))

    def load(dtype, extra=None):
        fields = {**overrides, **(extra or {})}
        kwargs = {"river_config": dataclasses.replace(default_config(args.model), **fields)} if fields else {}
        model = RiverForCausalLM.from_pretrained(args.model, dtype=dtype, progress=False, **kwargs)
        return model, plain_model(model)

    # the GGUF first: a key's conversion then reads this copy instead of downloading it again
    path = gguf_file(args.model, progress=True) if "llama.cpp" in methods else None
    river, plain = load(torch.float32)
    river16 = plain16 = None
    if any(m.endswith("-bf16") for m in methods):
        river16, plain16 = load(torch.bfloat16)
    river_fused = load(torch.float32, FUSED)[0] if any(m.endswith("-fused") for m in methods) else None
    tok = AutoTokenizer.from_pretrained(resolve(args.model, progress=False))
    prompts = [encode_prompt(tok, text)["input_ids"] for text in texts]
    if len(prompts) % args.batch:
        ap.error(f"--prompts: {len(prompts)} prompts do not split into batches of {args.batch}")
    batches = [left_padded(prompts[i:i + args.batch], tok.pad_token_id if tok.pad_token_id is not None else 0)
               for i in range(0, len(prompts), args.batch)]
    gen, eos = exact_generation(tok, river, args.new_tokens)
    full_bytes = {torch.float32: linear_weight_bytes(plain)}
    if plain16 is not None:
        full_bytes[torch.bfloat16] = linear_weight_bytes(plain16)

    llm = None
    if "llama.cpp" in methods:
        llm = LlamaCppRunner(path, n_ctx=max(p.shape[1] for p in prompts) + args.new_tokens + 8,
                             threads=torch.get_num_threads(), eos=eos, new_tokens=args.new_tokens)

    packed = packed_note = None
    if "unmodified-onednn" in methods or "river-onednn" in methods:
        try:  # lossless mode's verify copy where it packed one (no second copy), else a new one
            packed, packed_note = plain_onednn_mode(river, plain, max(p.shape[1] for p in prompts) + args.new_tokens)
        except ValueError as e:
            ap.error(f"*-onednn: {e}; leave those methods out")

    plain_fp32 = None
    if "unmodified-river-fp32" in methods:
        try:
            plain_fp32 = RiverFp32Linear([m for m in plain.modules() if isinstance(m, torch.nn.Linear)], fallback=packed)
        except RuntimeError as e:
            ap.error(f"unmodified-river-fp32: {e}; leave it out")

    plain_grid = None
    if "unmodified-river-grid" in methods:
        from river_hf.quant.grid import GridLinear
        from river_hf.river.verify_kernel import verify_mode

        mode, _ = verify_mode(river, river.river_config.verify_kernel, river.river_config.max_draft_tokens + 1)
        if not isinstance(mode, GridLinear):
            ap.error("unmodified-river-grid: River read no grid for this model (RiverConfig.backbone_grid); leave it out")
        plain_grid = GridLinear(mode.grids, max_rows=mode.max_rows, fallback=plain_fp32 or packed)
        on_grid = {id(m.weight) for m in plain_grid.grids}  # a decode step reads these Linears' grids
        full_bytes["grid"] = (sum(g.nbytes for g in plain_grid.grids.values())
                              + sum(linear_weight_bytes(m) for m in plain.modules()
                                    if isinstance(m, torch.nn.Linear) and id(m.weight) not in on_grid))

    # where the *-onednn / *-river-fp32 methods enter their mode: around each Linear that it may reroute
    # (River's own scope for its backbone kernel), the plain model's every Linear, River's backbone ones
    model_linears = {id(m): [x for x in (m.river_backbone_modules() if m is river else m.modules())
                             if isinstance(x, torch.nn.Linear)] for m in (plain, river)}
    tokens: dict[str, list[list[int]]] = {}
    stats: dict[str, list[dict]] = {}

    def run(method):
        measurements, outs, rows = [], [], []
        for ids, mask in batches:
            if method == "llama.cpp":
                m, new = llm.run(ids)
                new = [new]
            else:
                bf16 = method.endswith("-bf16")
                onednn = method.endswith("-onednn")
                noprompt = method.endswith("-noprompt")
                river_fp32 = method.endswith("-river-fp32")
                river_grid = method.endswith("-river-grid")
                base = (method.removesuffix("-bf16").removesuffix("-onednn").removesuffix("-noprompt").removesuffix("-fused")
                        .removesuffix("-river-fp32").removesuffix("-river-grid"))
                base = "lossless" if method in variants else base.removesuffix("-mkl")
                model = (plain16 if bf16 else plain) if base == "unmodified" else (river16 if bf16 else river)
                if method.endswith("-fused"):
                    model = river_fused
                timer = TokenTimer()
                mode = {"river": "route", "exit": "exit", "lossless": "lossless"}.get(base)
                with torch.no_grad(), (settings(model, variants[method]) if method in variants
                                       else contextlib.nullcontext()), (model.river_mode(mode) if mode else contextlib.nullcontext()), \
                        (linears_in_mode(model_linears[id(model)], packed if onednn else plain_grid if river_grid else plain_fp32)
                         if onednn or river_fp32 or river_grid else contextlib.nullcontext()), \
                        (prompt_kernels_off(model) if noprompt else contextlib.nullcontext()), \
                        (backbone_kernel(model, "torch") if method.endswith("-mkl") else contextlib.nullcontext()):
                    timer.reset()
                    out = model.generate(ids, attention_mask=mask, streamer=timer, **gen)
                new = out[:, ids.shape[1]:].tolist()
                m = timer.measurement(returned_tokens=sum(len(row) for row in new))
                if mode is None:
                    m.weight_bytes_per_step = full_bytes["grid" if river_grid else torch.bfloat16 if bf16 else torch.float32]
                else:
                    s = model.river_stats
                    m.weight_bytes_per_step = s["weight_bytes_per_token"] * m.decode_tokens / max(m.decode_steps, 1)
                    rows.append({k: s.get(k) for k in ("mode", "mean_exit_layer", "exit_fraction")}
                                | {"backbone_kernel": (s.get("backbone_kernel") or {}).get("kernel")}
                                | ({"acceptance_rate": s["lossless"].get("acceptance_rate"),
                                    "draft_cost_steps": s["lossless"].get("draft_cost_steps"),
                                    "verify_cost_steps": s["lossless"].get("verify_cost_steps")}
                                   if mode == "lossless" and s.get("lossless") else {}))
            measurements.append(m)
            outs.extend(new)
        tokens[method], stats[method] = outs, rows
        return measurements

    comparison = compare({m: (lambda m=m: run(m)) for m in methods}, reference="unmodified", repeats=args.repeats,
                         progress=True, reference_kind="plain transformers model in fp32 (river_hf.plain_model)",
                         interleave=not args.no_interleave)
    ref = tokens["unmodified"]
    report = {
        "command": command_line(argv),
        "model": args.model, "set": args.set_name, "prompts": names, "new_tokens": args.new_tokens, "batch": args.batch,
        "greedy": True,
        "eos_suppressed": EOS_SUPPRESSED,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cpus": os.cpu_count(),
        "river_config": river.river_config.to_dict(), "overrides": overrides,
        "kernel_choice": river.river_config.kernel_choice,
        # per exit shape: the kernel, every candidate's cold one-token time (µs), the error on the real weights
        "river_kernels": river.river_kernels(),
        "kernel_choice_bf16": river16.river_config.kernel_choice if river16 is not None else None,
        "weight_bytes": {"fp32": full_bytes[torch.float32], "bf16": full_bytes.get(torch.bfloat16), "grid": full_bytes.get("grid"),
                         "gguf": llm.weight_bytes if llm else None},
        "onednn_packed_bytes": packed.packed_bytes if packed is not None else None, "onednn_copy": packed_note,
        "llama_cpp_version": llm.version if llm is not None else None,
        "protocol": compare_protocol(args.repeats, args.new_tokens, interleaved=not args.no_interleave),
        "load_avg_1m_before": load_before, "load_avg_1m_after": load_average(),
        "comparison": comparison.to_dict(),
        "identical_to_fp32_reference": {m: sum(a == b for a, b in zip(tokens[m], ref)) for m in methods},
        "per_prompt_stats": stats, "tokens": tokens, "wall_seconds": time.time() - t0,
    }
    write_report(args.out, report, markdown(report), _figure(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    """The result as a Markdown table, with the command and protocol."""
    from river_hf.timing import bandwidth_cell, markdown_rows

    comp = report["comparison"]
    n = len(report["prompts"])
    triad = comp["stream_triad_gb_s"]
    lines = [f"`{report['command']}`", "",
             f"{report['model']}, {report['set']} set: {', '.join(report['prompts'])}, greedy, exactly "
             f"{report['new_tokens']} new tokens each ({report['eos_suppressed']}), batch {report.get('batch', 1)}"
             f"{' (left-padded; tokens/s count every row)' if report.get('batch', 1) > 1 else ''}; reference: {comp['reference_kind']}; "
             f"{report['protocol']}; {report['threads']} threads; STREAM triad {triad or float('nan'):.1f} GB/s; "
             f"1-minute load {report['load_avg_1m_before']:.2f} before, {report['load_avg_1m_after']:.2f} after.", ""]
    lines += markdown_rows(comp, {
        "identical to fp32": lambda r: f"{report['identical_to_fp32_reference'][r['label']]}/{n}",
        "weight MB/step": lambda r: "" if r["weight_bytes_per_step"] is None else f"{r['weight_bytes_per_step'] / 1e6:.0f}",
        "GB/s (% triad)": lambda r: bandwidth_cell(r, triad)})
    return "\n".join(lines) + "\n"


def _figure(report: dict):
    from river_hf.timing import bar_figure

    return bar_figure(
        report["comparison"]["rows"],
        f"{report['model']}: {report['set']} set of {len(report['prompts'])} prompts, {report['new_tokens']} tokens each, "
        f"batch {report.get('batch', 1)}",
        color=lambda n: "#888" if n.startswith("unmodified") else "#2ca02c" if n == "llama.cpp" else "#1f77b4")


if __name__ == "__main__":
    raise SystemExit(main())
