"""``river-hf generate``: answer a prompt with River, optionally side by side with the unmodified model."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import RiverError
from ..models import encode_prompt

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="answer a prompt with River early exit (default model: %s)" % DEFAULT_MODEL,
        description="Generate an answer with River-LLM early exit and print one line of statistics.",
    )
    p.add_argument("prompt", help="the user message (the chat template is applied when the model has one)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model key, Hub id or local folder (default: %(default)s)")
    p.add_argument("--tau", default=None, help="state transition similarity threshold τ; > 1 never exits (default: per-model config)")
    p.add_argument("--min-layer", type=int, default=None, help="backbone layers always run before an exit is considered")
    p.add_argument("--backend", default=None, help="exit-layer quantization backend: quanto (default), quanto-int8, copy")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
    p.add_argument("--sample", action="store_true", help="sample (temperature 0.7) instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0, help="random seed for --sample")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--compare", action="store_true", help="also run the unmodified model; print both speeds and the token match rate")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
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
    if args.min_layer is not None and args.min_layer < 1:
        raise RiverError(f"--min-layer must be at least 1 (one backbone layer always runs), got {args.min_layer}")
    if args.device is not None:
        import torch

        if args.device != "cpu" and not args.device.startswith("cuda"):
            raise RiverError(f"--device must be cpu or cuda (cuda:N), got {args.device!r}")
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise RiverError("--device cuda was asked for, but this torch build sees no CUDA GPU; use --device cpu")
    if args.tau is None:
        return None
    try:
        tau = float(args.tau)
    except ValueError:
        raise RiverError(f"--tau must be a number such as 0.95 (above 1 never exits), got {args.tau!r}") from None
    if tau != tau:
        raise RiverError("--tau must be a number, got nan")
    return tau


def _timed_generate(model, inputs, gen_kwargs, streamer=None):
    import torch

    if gen_kwargs.get("do_sample"):
        torch.manual_seed(gen_kwargs.pop("seed"))
    else:
        gen_kwargs.pop("seed", None)
    out = model.generate(**inputs, **gen_kwargs, streamer=streamer)
    return out[0, inputs["input_ids"].shape[1]:], dict(model.river_stats)


def run_generate(args) -> int:
    tau = _check_args(args)
    import torch
    from transformers import AutoConfig, AutoTokenizer, TextStreamer

    from ..models import resolve
    from ..quant import fast_kernel_fraction, get_backend
    from .modeling import RiverForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    path = resolve(args.model)
    if args.backend is not None:
        get_backend(args.backend)  # an unknown backend is refused before the model loads
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt_tokens = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat_template)["input_ids"].shape[1]
    context = getattr(AutoConfig.from_pretrained(path).get_text_config(decoder=True), "max_position_embeddings", None)
    if context and prompt_tokens + args.max_new_tokens > context:
        raise RiverError(f"--max-new-tokens {args.max_new_tokens} does not fit: the prompt has {prompt_tokens} tokens and "
                         f"this model's context is {context}; use at most {max(context - prompt_tokens, 0)}")
    model = RiverForCausalLM.from_pretrained(
        args.model, tau=tau, min_layer=args.min_layer, backend=args.backend, dtype=dtype, device_map=device,
        progress=not args.json,
    )
    inputs = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat_template).to(device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, seed=args.seed)
    if args.sample:
        gen.update(temperature=0.7, top_p=0.95)
    if tokenizer.pad_token_id is None:
        gen["pad_token_id"] = tokenizer.eos_token_id

    def warm_up():  # first calls pay one-time costs (allocator, kernel selection) in both modes
        for mode in ("backbone", "route"):
            with model.river_mode(mode):
                model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=gen.get("pad_token_id"))

    if args.compare:
        warm_up()
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    tokens, stats = _timed_generate(model, inputs, dict(gen), streamer)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    result = {"model": args.model, "prompt": args.prompt, "text": text, "new_tokens": int(tokens.shape[0]),
              "river_config": model.river_config.to_dict(), "stats": stats,
              "exit_layer_build_seconds": model.river_build_seconds}
    if args.compare:
        with model.river_mode("backbone"):
            base_tokens, base_stats = _timed_generate(model, inputs, dict(gen))
        n = min(len(tokens), len(base_tokens))
        match = float((tokens[:n] == base_tokens[:n]).float().mean()) if n else 0.0
        result["baseline"] = {"text": tokenizer.decode(base_tokens, skip_special_tokens=True),
                              "new_tokens": int(base_tokens.shape[0]), "stats": base_stats}
        result["token_match_rate"] = match
        result["speedup"] = stats["tokens_per_s"] / base_stats["tokens_per_s"]
        result["fast_int4_kernel_fraction"] = fast_kernel_fraction(model)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print()
    print(_stats_line("River", stats, model))
    if args.compare:
        print(_stats_line("unmodified", result["baseline"]["stats"], model))
        print(f"speedup {result['speedup']:.2f}x, token match rate {match:.1%} over {n} tokens")
        note = _slow_note(result, model)
        if note:
            print(note)
    return 0


def _stats_line(label: str, s: dict, model) -> str:
    line = f"[{label}] {s['new_tokens']} tokens in {s['seconds']:.1f} s = {s['tokens_per_s']:.2f} tokens/s"
    if s.get("bandwidth_gb_s") is not None:
        line += f", {s['bandwidth_gb_s']:.1f} GB/s of weights read"
    if label == "River" and s.get("mean_exit_layer") is not None:
        line += (f", τ={model.river_config.tau:g}, mean exit layer {s['mean_exit_layer']:.1f}/{s['num_layers']}, "
                 f"{s['exit_fraction']:.0%} of decode steps exited")
    return line


def _slow_note(result: dict, model) -> str | None:
    """A plain explanation when River was not faster than the unmodified model."""
    if result["speedup"] >= 1.0:
        return None
    reasons = []
    frac = result["fast_int4_kernel_fraction"]
    if frac is not None and frac < 1.0:
        reasons.append(
            f"only {frac:.0%} of the exit layers' Linears got the packed int4 kernel (on CPU it needs in_features "
            "divisible by 128 and bf16 activations; the rest take a slow fallback)"
        )
    if result["stats"].get("exit_fraction") in (0, 0.0):
        reasons.append("no decode step exited at this τ (lower --tau to exit more)")
    if not reasons:
        reasons.append("the model is too small for the int4 kernels' fixed cost per Linear (about 60 µs on a 2-core CPU)")
    return "River was not faster here: " + "; ".join(reasons) + ". See docs/river.md."


def main() -> None:  # pragma: no cover - convenience
    from ..cli import main as cli_main

    sys.exit(cli_main(["generate", *sys.argv[1:]]))
