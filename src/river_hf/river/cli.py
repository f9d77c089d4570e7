"""``river-hf generate``: answer a prompt with River, optionally side by side with the unmodified model."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import RiverError
from ..cli_args import (add_river_arguments, check_lossless_flags, negative_tau_noted, positive_int, river_overrides,
                        with_draft_flags)
from ..models import encode_prompt
from .draft_schedule import SCHEDULES
from .cli_common import BACKBONE_REFERENCE, TOKENIZER_FILES, check_model, unmodified  # noqa: F401  (old home)

DEFAULT_MODEL = "qwen2.5-coder-0.5b"

#: Prompts longer than this many tokens get a one-line stderr note before their prefill (a
#: 5000-token prompt takes about a minute on a 2-core CPU).
LONG_PREFILL_TOKENS = 1000


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="answer a prompt with River early exit (default model: %s)" % DEFAULT_MODEL,
        description="Generate an answer with River-LLM early exit and print one line of statistics.",
    )
    p.add_argument("prompt", help="the user message (the chat template is applied when the model has one)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model key, Hub id or local folder (default: %(default)s)")
    p.add_argument("--tau", default=None, help="state transition similarity threshold τ; > 1 never exits (default: per-model config)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
    p.add_argument("--sample", action="store_true", help="sample (temperature 0.7) instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0, help="random seed for --sample")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    add_river_arguments(p)
    p.add_argument("--lossless", action="store_true",
                   help="lossless mode: the exit path drafts, the backbone verifies (the unmodified model's tokens, "
                        "faster); τ then shapes the drafts only")
    p.add_argument("--draft-tokens", type=positive_int, default=None,
                   help="lossless mode: drafts of the first round, adapted after each round (default: per-model config)")
    p.add_argument("--draft-schedule", choices=tuple(SCHEDULES), default=None,
                   help="lossless mode: how the draft length adapts from round to round (default: per-model config)")
    p.add_argument("--compare", action="store_true",
                   help="also time the unmodified model: after the answer, both are timed side by side on the same "
                        "number of new tokens (warm-up, --repeats alternating rounds); prints decode tokens/s, the "
                        "median speedup and its min-max spread, and the token match rate")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed rounds for --compare (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text (on stdout; progress "
                                                       "stays on stderr unless --no-progress)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (exit-layer build, long-prefill note, --compare rounds)")
    p.set_defaults(func=run_generate)
    try:
        from .cli_convert import register as register_convert
    except ImportError:
        return
    register_convert(sub)


def _check_args(args) -> float | None:
    if not args.prompt.strip():
        raise RiverError("the prompt is empty: pass the text to answer, e.g. river-hf generate \"What is 2+2?\"")
    if args.max_new_tokens < 1:
        raise RiverError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.device is not None:
        import torch

        if args.device != "cpu" and not args.device.startswith("cuda"):
            raise RiverError(f"--device must be cpu or cuda (cuda:N), got {args.device!r}")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise RiverError("--device cuda was asked for, but this torch build sees no CUDA GPU; use --device cpu")
    river_overrides(args)  # unknown kernel names are refused before the model loads
    check_lossless_flags(args)
    if args.draft_tokens is not None and not os.path.isdir(args.model):
        # a model key or Hub id: its configs/ defaults hold the cap (a saved folder may carry its own: checked after loading)
        from .config import default_config

        with_draft_flags(default_config(args.model), args.draft_tokens)
    if args.tau is None:
        return None
    try:
        tau = float(args.tau)
    except ValueError:
        raise RiverError(f"--tau must be a number such as 0.95 (above 1 never exits), got {args.tau!r}") from None
    if tau != tau:
        raise RiverError("--tau must be a number, got nan")
    return tau


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[river-hf] {msg}", file=sys.stderr, flush=True)


def run_generate(args) -> int:
    tau = _check_args(args)
    return _generate(args, tau, progress=not args.no_progress)  # transformers' own bars: cli.main


def _generate(args, tau, *, progress: bool) -> int:
    import torch
    from transformers import TextStreamer

    from .modeling import RiverForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    _, config, tokenizer = check_model(args.model, progress=progress)
    inputs = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat_template)
    prompt_tokens = inputs["input_ids"].shape[1]
    context = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if context and prompt_tokens + args.max_new_tokens > context:
        raise RiverError(f"--max-new-tokens {args.max_new_tokens} does not fit: the prompt has {prompt_tokens} tokens and "
                         f"this model's context is {context}; use at most {max(context - prompt_tokens, 0)}")
    overrides = river_overrides(args)
    with negative_tau_noted(tau, lossless=args.lossless):  # one line of its own instead of the library's warning
        model = RiverForCausalLM.from_pretrained(args.model, tau=tau, dtype=dtype, device_map=device, config=config,
                                                 progress=progress, **overrides)
    model.river_config = with_draft_flags(model.river_config, args.draft_tokens, args.draft_schedule)
    river_mode = "lossless" if args.lossless else "route"
    label = "River lossless" if args.lossless else "River"
    inputs = inputs.to(device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)
    if args.sample:
        gen.update(temperature=0.7, top_p=0.95)
    if tokenizer.pad_token_id is None:
        gen["pad_token_id"] = tokenizer.eos_token_id

    def answer(mode, streamer=None, **extra):
        if args.sample:
            torch.manual_seed(args.seed)
        with model.river_mode(mode):
            out = model.generate(**inputs, **{**gen, **extra}, streamer=streamer)
        return out[0, prompt_tokens:], dict(model.river_stats)

    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    if prompt_tokens > LONG_PREFILL_TOKENS:
        _say(progress, f"prefilling {prompt_tokens} prompt tokens (a long prompt: this takes a while before the "
                       "first new token) ...")
    tokens, stats = answer(river_mode, streamer)
    if not args.json:
        print(flush=True)  # the streamed answer ends without a newline (and --compare's notes follow on stderr)
        print(_stats_line(label, stats, model), flush=True)  # before --compare's rounds, which take a while
    result = {"model": args.model, "prompt": args.prompt, "text": tokenizer.decode(tokens, skip_special_tokens=True),
              "new_tokens": int(tokens.shape[0]), "river_config": model.river_config.to_dict(), "stats": stats,
              "exit_layer_build_seconds": model.river_build_seconds, "kernels": model.river_kernels()}
    if args.compare:
        result.update(_compare(model, tokenizer, inputs, gen, tokens, answer, args, river_mode, label, progress))
        result["exit_fraction"] = stats.get("exit_fraction")  # River's own answer, not the last timed run
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if args.compare:
        print(result["comparison_table"])
        sp = result["speedup"]
        print(f"{label} vs unmodified, decode: {sp['median']:.2f}x (min-max {sp['min']:.2f}-{sp['max']:.2f} over "
              f"{args.repeats} rounds) {result['verdict']}; token match rate {result['token_match_rate']:.1%} "
              f"over {result['compared_tokens']} tokens")
        if args.sample:
            print("(--sample: both answers were sampled, so the token match rate compares two random draws; lossless "
                  "sampling matches the unmodified model in distribution, and the timed rounds are greedy)")
        note = _slow_note(result)
        if note:
            print(note)
    return 0


def _compare(model, tokenizer, inputs, gen, tokens, answer, args, river_mode="route", label="River",
             progress=False) -> dict:
    """River (in ``river_mode``) and the unmodified model timed side by side (river_hf.timing.compare) on as many new
    tokens as River's answer had, plus the unmodified answer and the token match rate. With ``progress``, one stderr
    line before each stage and a tqdm bar (stderr) over the timed rounds."""
    import os

    from ..timing import compare, measure_generate

    n = max(int(tokens.shape[0]), 2)
    _say(progress, f"--compare: answering with the unmodified model ({int(tokens.shape[0])} tokens) for the token match")
    base_tokens, base_stats = answer("backbone", max_new_tokens=int(tokens.shape[0]))

    full_bytes = model.river_step_bytes(len(model._river_step_bytes["river"]) - 1)  # every backbone layer + head

    def timed(mode, target=model):
        # the plain model keeps no river_stats: its weight bytes per step are the whole backbone's
        extra = {} if target is model else {"weight_bytes_per_step": full_bytes}

        def run():
            with model.river_mode(mode):
                return measure_generate(target, dict(inputs), **{**gen, "do_sample": False, "max_new_tokens": n,
                                                                  "min_new_tokens": n}, **extra)
        return run

    plain, reference_kind = unmodified(model)

    load_before = os.getloadavg()[0]
    _say(progress, f"--compare: timing {label} and the unmodified model on {n} new tokens each: one untimed warm-up "
                   f"run of each, then {args.repeats} alternating round(s)")
    comparison = compare({label: timed(river_mode), "unmodified": timed("backbone", plain)}, reference="unmodified",
                         repeats=args.repeats, progress=progress, reference_kind=reference_kind)
    m = min(len(tokens), len(base_tokens))
    match = float((tokens[:m] == base_tokens[:m]).float().mean()) if m else 0.0
    river = comparison.row(label)
    return {
        "baseline": {"text": tokenizer.decode(base_tokens, skip_special_tokens=True), "new_tokens": int(base_tokens.shape[0]), "stats": base_stats},
        "token_match_rate": match, "compared_tokens": m,
        "comparison": comparison.to_dict(), "comparison_table": comparison.table(),
        "speedup": river["speedup"], "verdict": river["verdict"], "timed_new_tokens": n,
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
    }


def _stats_line(label: str, s: dict, model) -> str:
    line = f"[{label}] {s['new_tokens']} tokens in {s['seconds']:.1f} s = {s['tokens_per_s']:.2f} tokens/s"
    if s.get("decode_tokens_per_s") is not None:
        line += f" (decode {s['decode_tokens_per_s']:.2f} tokens/s after a {s['prefill_seconds']:.2f} s prefill)"
    if s.get("bandwidth_gb_s") is not None:
        line += f", {s['bandwidth_gb_s']:.1f} GB/s of weights read"
    if s.get("lossless") and s["lossless"].get("acceptance_rate") is not None:
        ll = s["lossless"]
        line += (f", acceptance rate {ll['acceptance_rate']:.0%} ({ll['mean_accepted']:.1f} of "
                 f"{ll['drafts_per_verify']:.1f} drafts accepted per verify), drafting {ll['draft_seconds']:.1f} s, "
                 f"verifying {ll['verify_seconds']:.1f} s")
    elif label == "River" and s.get("mean_exit_layer") is not None:
        line += (f", τ={model.river_config.tau:g}, mean exit layer {s['mean_exit_layer']:.1f}/{s['num_layers']}, "
                 f"{s['exit_fraction']:.0%} of decode steps exited")
        kernel = (s.get("backbone_kernel") or {}).get("kernel")
        if kernel not in (None, "torch"):
            line += f", backbone Linears on {kernel}"
    return line


def _slow_note(result: dict) -> str | None:
    """What the measurement itself says when River was not clearly faster (no guesses)."""
    if result["verdict"] == "faster":
        return None
    facts = []
    sp = result["speedup"]
    if result["verdict"] == "not resolved":
        facts.append(f"the speedup's spread over the rounds ({sp['min']:.2f}-{sp['max']:.2f}x) contains 1.0, so this "
                     "run cannot tell the two apart; rerun with more --repeats or --max-new-tokens")
    load = result["load_average"]
    if max(load["before"], load["after"]) > 1.0:
        facts.append(f"the 1-minute load average was {load['before']:.1f} before and {load['after']:.1f} after the "
                     "timing: other processes shared the CPU")
    slow = [k for k in result["kernels"] if "slow" in k["kernel"]]
    if slow:
        facts.append("exit Linears on a slow kernel: " + ", ".join(f"{k['count']} x {k['shape']} ({k['kernel']})"
                                                                   for k in slow))
    if result.get("exit_fraction") in (0, 0.0):
        facts.append("no decode step left the backbone at this τ (lower --tau to exit more)")
    if result["timed_new_tokens"] < 16:
        facts.append(f"only {result['timed_new_tokens']} tokens were timed (the answer's length): prefill dominates")
    if not facts:
        return None
    return "Note: " + "; ".join(facts) + "."
