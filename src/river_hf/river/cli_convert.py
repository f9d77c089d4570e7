"""``river-hf convert MODEL OUT_DIR``: write a Hugging Face-native River folder.

The folder holds the base model's weights (under their own names), its tokenizer, config.json
with the River settings and an ``auto_map``, ``modeling_river.py`` and a model card, so that
``pipeline("text-generation", model=OUT_DIR, trust_remote_code=True)`` runs River
(see :mod:`river_hf.river.serialization`). With ``--measure`` the card gets figures measured right
then on this machine: tokens/s of River and of the unmodified model (``river_mode("backbone")``),
next-token match (:func:`river_hf.eval.agreement.next_token_agreement`, River-LLM's measure) and
the mean exit layer; without it the card says they were not measured.
"""

from __future__ import annotations

import datetime
import platform
import shlex
import time

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
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (replaced atomically)")
    p.add_argument("--tau", default=None, help="threshold τ stored in the folder (default: per-model config)")
    p.add_argument("--min-layer", type=int, default=None, help="backbone layers always run before an exit")
    p.add_argument("--offload-from", type=int, default=None,
                   help="store an offload policy: backbone layers K.. stay off the compute device when loaded")
    p.add_argument("--measure", action="store_true",
                   help="measure speed, next-token match and mean exit layer now and put them in the model card")
    p.add_argument("--measure-tokens", type=int, default=32, help="new tokens per prompt for --measure (default 32)")
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
    from ..eval.common import check_writable_place

    check_writable_place(out, "OUT_DIR")  # the save writes a temporary folder next to it, then renames it


def handler(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from ..models import resolve
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
    RiverConfig(tau=2.0 if tau is None else tau, offload_from=args.offload_from,
                **({} if args.min_layer is None else {"min_layer": args.min_layer}))
    path = resolve(args.model)
    model = RiverForCausalLM.from_pretrained(path, tau=tau, min_layer=args.min_layer, dtype=torch.float32)
    if args.offload_from is not None:
        import dataclasses

        n = model.river.num_layers
        if not 0 <= args.offload_from < n:
            raise RiverError(f"--offload-from must be in 0..{n - 1} for this model, got {args.offload_from}")
        # Only stored: offloading here would just slow the measurement and the save down.
        model.river_config = dataclasses.replace(model.river_config, offload_from=args.offload_from)
    tokenizer = AutoTokenizer.from_pretrained(path)
    measurement = None
    if args.measure:
        measurement = measure(model, tokenizer, args.measure_tokens)
        argv = [args.model, args.out_dir, "--measure", "--measure-tokens", str(args.measure_tokens)]
        for flag, value in (("--tau", args.tau), ("--min-layer", args.min_layer), ("--offload-from", args.offload_from)):
            if value is not None:
                argv += [flag, str(value)]
        measurement["command"] = "river-hf convert " + shlex.join(argv)
    from ..models import REGISTRY

    base = REGISTRY[args.model].hub_id if args.model in REGISTRY else None
    card = model_card(model, base_model=base, measurement=measurement)
    model.save_pretrained(args.out_dir, card=card, tokenizer=tokenizer)
    line = f"wrote {args.out_dir} (τ={model.river_config.tau}, {model.river.num_layers} layers"
    if measurement:
        line += (f"; River {measurement['river_tokens_per_s']:.2f} vs unmodified {measurement['unmodified_tokens_per_s']:.2f} tokens/s, "
                 f"next-token match {100 * measurement['match']:.1f} %, mean exit layer {measurement['mean_exit_layer']:.2f}")
    print(line + ")")
    return 0


def measure(model, tokenizer, max_new_tokens: int) -> dict:
    """Figures for the model card, measured now on :data:`MEASURE_PROMPTS` (greedy).

    Returns a dict with ``unmodified_tokens_per_s`` and ``river_tokens_per_s`` (tokens/s over all
    prompts, the two runs side by side), ``match`` (next-token match over all compared positions),
    ``mean_exit_layer`` and ``exit_fraction`` (River's own generate, decode steps), and the
    conditions (device, date, prompts, tokens).
    """
    import torch
    from tqdm.auto import tqdm

    from ..eval.agreement import next_token_agreement

    gen = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    totals = {"base_s": 0.0, "base_n": 0, "river_s": 0.0, "river_n": 0, "matches": 0, "positions": 0,
              "exit_sum": 0.0, "exit_steps": 0, "exited": 0}
    for prompt in tqdm(MEASURE_PROMPTS, desc="measuring", unit="prompt"):
        ids = encode_prompt(tokenizer, prompt).to(model.device)
        with model.river_mode("backbone"):
            t0 = time.perf_counter()
            out = model.generate(**ids, **gen)
            totals["base_s"] += time.perf_counter() - t0
        totals["base_n"] += out.shape[1] - ids["input_ids"].shape[1]
        t0 = time.perf_counter()
        out = model.generate(**ids, **gen)
        totals["river_s"] += time.perf_counter() - t0
        totals["river_n"] += out.shape[1] - ids["input_ids"].shape[1]
        s = model.river_stats
        if s.get("decode_steps"):
            totals["exit_sum"] += s["mean_exit_layer"] * s["decode_steps"]
            totals["exit_steps"] += s["decode_steps"]
            totals["exited"] += s["exit_fraction"] * s["decode_steps"]
        ag = next_token_agreement(model, ids["input_ids"], max_new_tokens)
        totals["matches"] += ag["matches"]
        totals["positions"] += ag["positions"]
    device = str(model.device)
    if model.device.type == "cpu":
        device = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    result = {
        "device": device,
        "date": datetime.date.today().isoformat(),
        "prompts": len(MEASURE_PROMPTS),
        "max_new_tokens": max_new_tokens,
        "unmodified_tokens_per_s": totals["base_n"] / totals["base_s"],
        "river_tokens_per_s": totals["river_n"] / totals["river_s"],
        "mean_exit_layer": totals["exit_sum"] / max(totals["exit_steps"], 1),
        "exit_fraction": totals["exited"] / max(totals["exit_steps"], 1),
        "num_layers": model.river.num_layers,
        "match": totals["matches"] / max(totals["positions"], 1),
        "match_name": "next-token match (teacher-forced on the unmodified greedy continuation)",
        "note": "Speeds depend on the machine and its load; the two runs were taken side by side.",
    }
    return result

