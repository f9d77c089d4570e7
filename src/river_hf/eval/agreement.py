"""Agreement of a River model with its unmodified backbone on the same prefixes.

Next-token match is the River-LLM paper's quality measure: follow the unmodified model's greedy
continuation, and at every position ask River (with its own KV cache, filled by whichever layers
served each earlier step) for its argmax given the same prefix. The match rate is the fraction of
positions where the two argmaxes agree; the KL divergence KL(unmodified || River) of the two
next-token distributions is averaged over the same positions.
"""

from __future__ import annotations

import contextlib

import torch

from ..river.cache import RiverCache

__all__ = ["next_token_agreement", "reference_continuation", "kv_cosine_similarity"]


@torch.no_grad()
def reference_continuation(model, input_ids: torch.Tensor, max_new_tokens: int = 64, eos_token_id=None):
    """The unmodified model's greedy continuation of one prompt.

    ``model``: a River model (run in ``river_mode("backbone")``) or a plain transformers model of the
    same weights (e.g. :func:`river_hf.bench.plain_reference`), run as it is.

    Returns:
        ``(tokens, logits)``: ``[N]`` long tensor of new tokens and ``[N, V]`` float32 raw logits
        (N <= max_new_tokens; shorter when EOS came first). Independent of τ: compute it once and
        pass it to :func:`next_token_agreement` for several τ.
    """
    input_ids = input_ids.to(model.device)
    gen_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    if eos_token_id is not None:
        gen_kwargs["eos_token_id"] = eos_token_id
    backbone = model.river_mode("backbone") if hasattr(model, "river_mode") else contextlib.nullcontext()
    with backbone:
        ref = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **gen_kwargs)
    return ref.sequences[0, input_ids.shape[1]:], torch.stack([l[0] for l in ref.logits]).float()


@torch.no_grad()
def next_token_agreement(
    model, input_ids: torch.Tensor, max_new_tokens: int = 64, eos_token_id=None, reference=None
) -> dict:
    """Teacher-forced comparison of River routing against the unmodified (backbone-only) model.

    Args:
        model: a River model (see :func:`river_hf.enable_river`), routing as configured.
        input_ids: ``[1, prompt_tokens]`` long tensor (one prompt; no padding).
        max_new_tokens: length of the unmodified greedy continuation to follow.
        eos_token_id: stop the reference continuation at this token (default: generation config).
        reference: ``(tokens, logits)`` from :func:`reference_continuation`, to reuse across τ.

    Returns:
        dict with ``positions`` (compared positions: the prefill's prediction plus each decode
        step), ``matches``, ``match_rate``, ``mean_kl`` (nats), ``mean_exit_layer`` over the decode
        steps as they ran (number of backbone layers run; ``num_layers`` = no exit; from the
        router's pass log, so the exited steps that ``recompute`` later re-feeds count too),
        ``exit_fraction``, ``decode_steps`` and ``num_layers``.

    Raises:
        ValueError: ``input_ids`` is not a single unpadded prompt.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"next_token_agreement takes one prompt of shape [1, tokens], got {tuple(input_ids.shape)}")
    input_ids = input_ids.to(model.device)
    if reference is None:
        reference = reference_continuation(model, input_ids, max_new_tokens, eos_token_id)
    ref_tokens, ref_logits = reference  # [N], [N, V]
    n = ref_tokens.shape[0]

    cache = RiverCache(config=model.config.get_text_config(decoder=True))
    strategy = model.river.strategy
    # The router's pass log, not the cache's per-step records: the recompute strategy trims the
    # records of exited steps when it re-feeds them (RiverCache.trim_records), so the cache would
    # only show the full-depth re-feed passes; the log keeps every pass as it ran.
    with model.river.recording() as passes:
        logits = [model(input_ids=input_ids, cache=cache, use_cache=True).logits[0, -1]]
        for t in range(n - 1):
            seq = torch.cat([input_ids[0], ref_tokens[: t + 1]])[None]
            # as generate would: the strategy may re-feed earlier tokens (recompute: the exited ones)
            feed = strategy.prepare_inputs(model, seq, {"cache": cache}) if model.river.mode == "route" else None
            logits.append(model(input_ids=seq[:, -(feed or 1):], cache=cache, use_cache=True).logits[0, -1])
    river_logits = torch.stack(logits).float()  # [N, V]

    matches = int((river_logits.argmax(-1) == ref_logits.argmax(-1)).sum())
    ref_logp = torch.log_softmax(ref_logits, -1)
    kl = (ref_logp.exp() * (ref_logp - torch.log_softmax(river_logits, -1))).sum(-1)
    decode = [entry[2] for entry in passes[1:]]  # exit layer of each pass after the prefill
    L = model.river.num_layers
    return {
        "positions": n,
        "matches": matches,
        "match_rate": matches / n if n else None,
        "mean_kl": float(kl.mean()) if n else None,
        "mean_exit_layer": sum(decode) / len(decode) if decode else None,
        "exit_fraction": sum(e < L for e in decode) / len(decode) if decode else None,
        "decode_steps": len(decode),
        "num_layers": L,
    }


@torch.no_grad()
def kv_cosine_similarity(model, input_ids: torch.Tensor) -> dict:
    """Per-layer cosine similarity of exit-layer vs backbone keys and values on the same inputs.

    One backbone-only forward pass over ``input_ids``; forward hooks on each backbone layer's
    ``self_attn.k_proj``/``v_proj`` capture that projection's input (the layer's normed hidden
    states) and output, and the exit layer's own ``k_proj``/``v_proj`` are run on that same input.
    The cosine is taken per token over the whole projection (all KV heads) and averaged over the
    tokens. Keys are compared before rotary embedding; RoPE rotates both vectors of a position by
    the same orthogonal map, so the cosine is the same after it. (River-LLM reports this figure to
    show that an exit layer's KV can stand in for its backbone's: "KV share".)

    Args:
        model: a River model (its layers are :class:`~river_hf.river.layer.RiverLayer`).
        input_ids: ``[batch, tokens]`` long tensor without padding.

    Returns:
        dict with ``k_cosine`` and ``v_cosine`` (lists of L floats, layer order), and their means
        ``mean_k_cosine``, ``mean_v_cosine``.

    Raises:
        ValueError: the model's decoder layers have no ``self_attn.k_proj``/``v_proj``.
    """
    from ..river.layer import RiverLayer

    layers = [m for m in model.modules() if isinstance(m, RiverLayer)]
    layers.sort(key=lambda m: m.river_layer_idx)
    sims = {"k": [None] * len(layers), "v": [None] * len(layers)}
    handles = []

    def hook(exit_proj, kind, idx):
        def fn(module, args, output):
            other = exit_proj(args[0])
            cos = torch.nn.functional.cosine_similarity(output.float(), other.float(), dim=-1)
            sims[kind][idx] = float(cos.mean())
        return fn

    try:
        for layer in layers:
            b_attn = getattr(layer.backbone, "self_attn", None)
            e_attn = getattr(layer.exit_layer, "self_attn", None)
            if b_attn is None or not hasattr(b_attn, "k_proj") or not hasattr(b_attn, "v_proj"):
                raise ValueError(f"layer {layer.river_layer_idx} has no self_attn.k_proj/v_proj to compare")
            for kind in ("k", "v"):
                proj = f"{kind}_proj"
                handles.append(getattr(b_attn, proj).register_forward_hook(
                    hook(getattr(e_attn, proj), kind, layer.river_layer_idx)))
        input_ids = input_ids.to(model.device)
        with model.river_mode("backbone"):
            model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {
        "k_cosine": sims["k"],
        "v_cosine": sims["v"],
        "mean_k_cosine": sum(sims["k"]) / len(layers),
        "mean_v_cosine": sum(sims["v"]) / len(layers),
    }
