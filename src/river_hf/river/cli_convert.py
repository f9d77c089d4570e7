"""``river-hf convert MODEL OUT_DIR``: write a Hugging Face-native River folder.

The folder holds the base model's weights (under their own names), its tokenizer, config.json
with the River settings and an ``auto_map``, ``modeling_river.py`` and a model card, so that
``pipeline("text-generation", model=OUT_DIR, trust_remote_code=True)`` runs River
(see :mod:`river_hf.river.serialization`). With ``--measure`` the card gets figures measured right
then on this machine: tokens/s of River and of the unmodified model (the plain transformers model, ``river_hf.plain_model``),
next-token match (:func:`river_hf.eval.agreement.next_token_agreement`, River-LLM's measure) and
the mean exit layer; without it the card says they were not measured.
"""

from __future__ import annotations

import datetime
import platform
import shlex

from ..errors import RiverError
from ..models import encode_prompt

#: Prompts of the ``--measure`` run (chat template applied when the tokenizer has one).
MEASURE_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is in two sentences.",
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="write a River folder that transformers' Auto classes and pipeline load (trust_remote_code=True)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("model", metavar="MODEL", help="model key (e.g. qwen2.5-coder-0.5b), Hub id or local folder")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write: a new folder, or an earlier River folder whose River files are replaced (each written to a temporary file, then renamed; other files in it are kept)")
    p.add_argument("--tau", default=None, help="threshold τ stored in the folder (default: per-model config)")
    p.add_argument("--offload-from", type=int, default=None,
                   help="store an offload policy: backbone layers K.. stay off the compute device when loaded")
    p.add_argument("--measure", action="store_true",
                   help="measure speed, next-token match and mean exit layer now and put them in the model card")
    p.add_argument("--measure-tokens", type=int, default=32, help="new tokens per prompt for --measure (default 32)")
    from ..cli_args import add_river_arguments

    add_river_arguments(p)
    p.set_defaults(func=handler)


def _check_out_dir(out_dir: str) -> None:
    """Refuse, before any loading, an output path that would mix River files with someone else's."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RiverError(f"OUT_DIR {out_dir!r} is a file; pass a folder path")
    if out.is_dir() and any(out.iterdir()):
        try:
            is_river = "river" in json.loads((out / "config.json").read_text())
        except (OSError, ValueError):
            is_river = False
        if not is_river:
            raise RiverError(f"OUT_DIR {out_dir!r} exists and is not a River folder; choose a new folder or empty it")
    from ..cli_args import check_writable_place

    check_writable_place(out, "OUT_DIR")  # the save writes a temporary folder next to it, then renames it


def handler(args) -> int:
    import torch

    from .cli_common import check_model
    from .modeling import RiverForCausalLM
    from .serialization import model_card

    tau = None
    if args.tau is not None:
        try:
            tau = float(args.tau)
        except ValueError:
            raise RiverError(f"--tau must be a number (e.g. 0.95; above 1 never exits), got {args.tau!r}") from None
    if args.measure_tokens < 1:
        raise RiverError("--measure-tokens must be >= 1")
    _check_out_dir(args.out_dir)
    from .modeling import RiverConfig

    # settings checked before loading (one error, not after minutes of loading and quantizing)
    from ..cli_args import river_overrides

    settings = river_overrides(args)
    RiverConfig(tau=2.0 if tau is None else tau, offload_from=args.offload_from, **settings)
    path, config, tokenizer = check_model(args.model)  # the same checks as generate, before any weight is read
    model = RiverForCausalLM.from_pretrained(path, tau=tau, dtype=torch.float32, config=config, **settings)
    if args.offload_from is not None:
        import dataclasses

        n = model.river.num_layers
        if not 0 <= args.offload_from < n:
            raise RiverError(f"--offload-from must be in 0..{n - 1} for this model, got {args.offload_from}")
        # Only stored: offloading here would just slow the measurement and the save down.
        model.river_config = dataclasses.replace(model.river_config, offload_from=args.offload_from)
    measurement = None
    if args.measure:
        measurement = measure(model, tokenizer, args.measure_tokens)
        argv = [args.model, args.out_dir, "--measure", "--measure-tokens", str(args.measure_tokens)]
        for flag, value in (("--tau", args.tau), ("--min-layer", args.min_layer), ("--offload-from", args.offload_from),
                            ("--backend", args.backend), ("--exit-head", args.exit_head), ("--prefill", args.prefill)):
            if value is not None:
                argv += [flag, str(value)]
        measurement["command"] = "river-hf convert " + shlex.join(argv)
    from ..models import REGISTRY

    base = REGISTRY[args.model].hub_id if args.model in REGISTRY else None
    card = model_card(model, base_model=base, measurement=measurement)
    model.save_pretrained(args.out_dir, card=card, tokenizer=tokenizer)
    line = f"wrote {args.out_dir} (τ={model.river_config.tau}, {model.river.num_layers} layers"
    if measurement:
        sp = measurement["speedup"]
        line += (f"; decode River {measurement['river_tokens_per_s']:.2f} vs unmodified "
                 f"{measurement['unmodified_tokens_per_s']:.2f} tokens/s ({sp['median']:.2f}x, "
                 f"{sp['min']:.2f}-{sp['max']:.2f}, {measurement['verdict']}), "
                 f"next-token match {100 * measurement['match']:.1f} %, mean exit layer {measurement['mean_exit_layer']:.2f}")
    print(line + ")")
    return 0


def measure(model, tokenizer, max_new_tokens: int, repeats: int = 3) -> dict:
    """Figures for the model card, measured now on :data:`MEASURE_PROMPTS` (greedy).

    River and the unmodified model (the plain transformers model on River's backbone tensors,
    :func:`river_hf.plain_model`; River in backbone mode where the backbone is offloaded) are
    timed side by side with the shared timer (:func:`river_hf.timing.compare`: warm-up, ``repeats``
    rounds with the reference next to River, the same number of new tokens). Returns a dict with ``unmodified_tokens_per_s`` and
    ``river_tokens_per_s`` (median decode tokens/s over all prompts), ``speedup`` (per-round,
    median/min/max) and ``verdict``, ``match`` (next-token match over all compared positions),
    ``mean_exit_layer`` and ``exit_fraction`` (River's decode steps), and the conditions.
    """
    import torch

    from ..eval.agreement import next_token_agreement
    from ..timing import compare, measure_generate

    prompts = [encode_prompt(tokenizer, p).to(model.device) for p in MEASURE_PROMPTS]
    gen = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    if tokenizer.pad_token_id is None:
        gen["pad_token_id"] = tokenizer.eos_token_id
    exits = []

    from .cli_common import unmodified

    plain, reference_kind = unmodified(model)

    def timed(mode):
        def run():
            out = []
            target = plain if mode == "backbone" else model
            with model.river_mode(mode):
                for ids in prompts:
                    out.append(measure_generate(target, dict(ids), **gen))
                    if mode == "route" and model.river_stats.get("decode_steps"):
                        s = model.river_stats
                        exits.append((s["decode_steps"], s["mean_exit_layer"], s["exit_fraction"]))
            return out
        return run

    comparison = compare({"River": timed("route"), "unmodified": timed("backbone")}, reference="unmodified",
                         repeats=repeats, progress=True, reference_kind=reference_kind)
    matches = positions = 0
    for ids in prompts:
        ag = next_token_agreement(model, ids["input_ids"], max_new_tokens)
        matches, positions = matches + ag["matches"], positions + ag["positions"]
    steps = sum(n for n, _, _ in exits)
    river, base = comparison.row("River"), comparison.row("unmodified")
    sp = river["speedup"]
    device = str(model.device)
    if model.device.type == "cpu":
        device = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return {
        "device": device,
        "date": datetime.date.today().isoformat(),
        "prompts": len(MEASURE_PROMPTS),
        "max_new_tokens": max_new_tokens,
        "unmodified_tokens_per_s": base["decode_tokens_per_s"]["median"],
        "river_tokens_per_s": river["decode_tokens_per_s"]["median"],
        "speedup": sp,
        "verdict": river["verdict"],
        "comparison": comparison.to_dict(),
        "mean_exit_layer": sum(n * e for n, e, _ in exits) / max(steps, 1),
        "exit_fraction": sum(n * f for n, _, f in exits) / max(steps, 1),
        "num_layers": model.river.num_layers,
        "match": matches / max(positions, 1),
        "match_name": "next-token match (teacher-forced on the unmodified greedy continuation)",
        "note": (f"Decode tokens/s, median of {repeats} alternating rounds after a warm-up; per-round speedup "
                 f"{sp['median']:.2f}x (min-max {sp['min']:.2f}-{sp['max']:.2f}, {river['verdict']}). Speeds depend on "
                 "the machine and its load. The offline registry checkpoints are GGUF files (Q4_K_M / Q4_1) dequantized "
                 "to fp32: the unmodified model's weights already sit on a 4-bit grid."),
    }
