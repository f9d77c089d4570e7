"""``river-hf diffuse``: masked-diffusion generation, uncached or with dLLM-Cache.

Runs :func:`river_hf.diffusion.generate` on a random-weight test model (``--model tiny-llada``,
``tiny-llama``, ``small-llada``, ``small-llama``, ``1b-llada``, ``1b-llama``) or on a local model folder,
and prints the generated token ids (and text when the folder has a tokenizer) with speed and FLOPs
statistics; ``--compare`` also runs uncached generation and reports speedup and token agreement.
"""

from __future__ import annotations

import json
import os

from ..errors import RiverError

TEST_MODELS = ("tiny-llada", "tiny-llama", "small-llada", "small-llama", "1b-llada", "1b-llama")


SMALL_BATCH_LINEAR = {"off": False, "on": True, "auto": "auto"}  # --small-batch-linear -> DLLMCacheConfig

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "diffuse",
        help="masked-diffusion generation (LLaDA-style) with dLLM-Cache",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="tiny-llada", help=f"one of {', '.join(TEST_MODELS)} (random weights) or a local folder")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a folder's own modeling code (e.g. LLaDA, Dream)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs a tokenizer in the model folder)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.add_argument("--prompt-length", type=int, default=16, help="random prompt length when no prompt is given")
    p.add_argument("--steps", type=int, default=32, help="denoising steps (default 32)")
    p.add_argument("--gen-length", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--block-length", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--remasking", default="low_confidence", choices=["low_confidence", "random"])
    p.add_argument("--mask-id", type=int, help="[MASK] token id (default: the model's config.mask_token_id)")
    p.add_argument("--kp", type=int, default=50, help="prompt_interval Kp (default 50)")
    p.add_argument("--kr", type=int, default=7, help="response_interval Kr (default 7)")
    p.add_argument("--ratio", type=float, default=0.25, help="V-verify ratio rho (default 0.25)")
    p.add_argument("--small-batch-linear", default="off", choices=list(SMALL_BATCH_LINEAR),
                   help="run the cache's partial steps under river_hf.quant.dense.SmallBatchLinear (fp32 CPU): "
                        "off (default), on, or auto (measure it against F.linear on this machine, take the faster)")
    p.add_argument("--no-cache", action="store_true", help="uncached generation only")
    p.add_argument("--compare", action="store_true", help="also run uncached; report speedup and agreement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=handler)


def _load(args):
    """(model, tokenizer or None)."""
    import torch

    from .modeling import build_test_model

    if args.model in TEST_MODELS:
        size, layout = args.model.split("-")
        return build_test_model(layout, size, seed=args.seed), None
    if not os.path.isdir(args.model):
        raise RiverError(f"--model {args.model!r} is neither a test model ({', '.join(TEST_MODELS)}) nor a folder")
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoTokenizer

    from . import modeling  # noqa: F401  (registers the test model classes with the Auto classes)

    try:
        cfg = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise RiverError(f"cannot load a model from {args.model}: {e}".splitlines()[0]) from None
    remote = _check_diffusion_config(args, cfg)
    try:
        if remote:  # the folder's own code (LLaDA's auto_map names AutoModel, whose class has the LM head)
            model = AutoModel.from_pretrained(args.model, config=cfg, trust_remote_code=True)
        else:
            model = AutoModelForMaskedLM.from_pretrained(args.model, config=cfg, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise RiverError(f"cannot load a model from {args.model}: {e}".splitlines()[0]) from None
    model = model.to(torch.float32).eval()
    tok = None
    try:
        tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, TypeError):
        pass
    return model, tok


def _check_diffusion_config(args, cfg) -> bool:
    """Refuse, from the config alone (before any weight is read, so transformers prints no load
    report), a folder that holds no masked-diffusion LM: a model with neither a masked-LM head class
    in transformers nor its own code, or one with no [MASK] id while ``--mask-id`` is not given.

    Returns:
        True when the model loads through the folder's own ``AutoModel`` code (``auto_map``, with
        ``--trust-remote-code``), False for ``AutoModelForMaskedLM``.

    Raises:
        RiverError: naming the model type and what to pass instead.
    """
    from transformers import AutoModelForMaskedLM, GenerationConfig

    from ..compat import auto_class_supports

    auto_map = getattr(cfg, "auto_map", None) or {}
    remote = bool(args.trust_remote_code) and "AutoModelForMaskedLM" not in auto_map and "AutoModel" in auto_map
    masked = "AutoModelForMaskedLM" in auto_map or auto_class_supports(AutoModelForMaskedLM, cfg)
    kind = f"a {getattr(cfg, 'model_type', None)!r} model ({', '.join(getattr(cfg, 'architectures', None) or []) or 'no architectures'})"
    if not (masked or remote):
        raise RiverError(
            f"{args.model} holds {kind}, not a masked-diffusion LM: transformers has no masked-LM class for it "
            "and the folder brings no code of its own; pass a LLaDA- or Dream-layout folder (with "
            "--trust-remote-code for their own code) or a test model (" + ", ".join(TEST_MODELS) + ")"
        )
    if args.mask_id is None and getattr(cfg, "mask_token_id", None) is None:
        try:
            gen_mask = getattr(GenerationConfig.from_pretrained(args.model), "mask_token_id", None)
        except (OSError, ValueError):
            gen_mask = None  # no generation_config.json
        if gen_mask is None:
            raise RiverError(f"{args.model} holds {kind} with no mask_token_id in its config or generation_config; "
                             "pass --mask-id (LLaDA 126336, Dream 151666), or use a masked-diffusion LM")
    return remote


def _check_args(args) -> None:
    """Argument checks that need no model (one error before torch is even imported)."""
    for flag, value in (("--steps", args.steps), ("--gen-length", args.gen_length), ("--block-length", args.block_length),
                        ("--prompt-length", args.prompt_length), ("--kp", args.kp), ("--kr", args.kr)):
        if value < 1:
            raise RiverError(f"{flag} must be >= 1, got {value}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise RiverError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 <= args.ratio <= 1:
        raise RiverError(f"--ratio (V-verify ratio rho) must be in [0, 1], got {args.ratio}")
    if args.compare and args.no_cache:
        raise RiverError("--compare runs cached and uncached generation; drop --no-cache (or --compare)")
    if args.mask_id is not None and args.mask_id < 0:
        raise RiverError(f"--mask-id must be a token id >= 0, got {args.mask_id}")


def handler(args) -> int:
    _check_args(args)
    import torch

    from .cache import DLLMCacheConfig
    from .denoising import generate, mask_token_id

    model, tok = _load(args)
    mask_id = args.mask_id if args.mask_id is not None else mask_token_id(model)
    if mask_id is None:
        raise RiverError("the model has no mask_token_id in its config or generation_config; "
                         "pass --mask-id (LLaDA 126336, Dream 151666)")
    vocab = model.config.vocab_size
    if not 0 <= mask_id < vocab:
        raise RiverError(f"--mask-id {mask_id} is outside this model's vocabulary (0..{vocab - 1}); "
                         "use the model's [MASK] id (LLaDA 126336, Dream 151666)")
    if args.prompt is not None:
        if tok is None:
            raise RiverError("--prompt needs a tokenizer in the model folder; use --prompt-ids instead")
        ids = tok(args.prompt, return_tensors="pt").input_ids
    elif args.prompt_ids is not None:
        try:
            ids = torch.tensor([[int(t) for t in args.prompt_ids.split(",") if t.strip()]], dtype=torch.long)
        except ValueError:
            raise RiverError("--prompt-ids must be comma-separated integers, e.g. 1,2,3") from None
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise RiverError(f"--prompt-ids must be non-empty and within [0, {vocab})")
    else:
        if args.prompt_length < 1:
            raise RiverError("--prompt-length must be >= 1")
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, vocab - 1, (1, args.prompt_length), generator=g)
        ids = ids + (ids >= mask_id).long()  # random prompt tokens, never the [MASK] id

    kw = dict(steps=args.steps, gen_length=args.gen_length, block_length=args.block_length,
              temperature=args.temperature, remasking=args.remasking, mask_id=mask_id,
              progress=not args.json, return_stats=True)  # fmt: skip
    cache = None if args.no_cache else DLLMCacheConfig(args.kp, args.kr, args.ratio, SMALL_BATCH_LINEAR[args.small_batch_linear])

    def run(c):
        gen = torch.Generator().manual_seed(args.seed)
        res = generate(model, ids, cache=c, generator=gen, **kw)
        return res.sequences, res.stats

    out, stats = run(cache)
    result = {"model": args.model, "prompt_ids": ids[0].tolist(), "tokens": out[0, ids.shape[1] :].tolist(), "stats": stats}
    if tok is not None:
        result["text"] = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    if args.compare and cache is not None:
        ref, ref_stats = run(None)
        result["uncached_stats"] = ref_stats
        result["speedup"] = ref_stats["seconds"] / stats["seconds"]
        result["agreement"] = (out[:, ids.shape[1] :] == ref[:, ids.shape[1] :]).float().mean().item()

    if args.json:
        print(json.dumps(result, default=str))
        return 0
    print(f"model: {args.model}  cache: {'none' if cache is None else f'Kp={cache.prompt_interval} Kr={cache.response_interval} rho={cache.ratio}'}")
    print("tokens:", " ".join(map(str, result["tokens"])))
    if "text" in result:
        print("text:", result["text"])
    s = stats
    flops = "" if s["flops_ratio"] is None else f", layer-FLOPs ratio {s['flops_ratio']:.2f}x"
    print(f"{s['steps']} steps in {s['seconds']:.2f} s ({s['tokens_per_s']:.1f} tokens/s{flops})")
    if "speedup" in result:
        print(f"uncached {result['uncached_stats']['seconds']:.2f} s: speedup {result['speedup']:.2f}x, "
              f"token agreement {result['agreement']:.3f}")  # fmt: skip
    return 0
