"""Agreement of a River model with its unmodified backbone on the same prefixes.

Next-token match is the River-LLM paper's quality measure: follow the unmodified model's greedy
continuation, and at every position ask River (with its own KV cache, filled by whichever layers
served each earlier step) for its argmax given the same prefix. The match rate is the fraction of
positions where the two argmaxes agree; the KL divergence KL(unmodified || River) of the two
next-token distributions is averaged over the same positions.
"""

from __future__ import annotations

import torch

from ..river.cache import RiverCache

__all__ = ["next_token_agreement", "reference_continuation"]


@torch.no_grad()
def reference_continuation(model, input_ids: torch.Tensor, max_new_tokens: int = 64, eos_token_id=None):
    """The unmodified model's greedy continuation of one prompt.

    Returns:
        ``(tokens, logits)``: ``[N]`` long tensor of new tokens and ``[N, V]`` float32 raw logits
        (N <= max_new_tokens; shorter when EOS came first). Independent of τ: compute it once and
        pass it to :func:`next_token_agreement` for several τ.
    """
    input_ids = input_ids.to(model.device)
    gen_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    if eos_token_id is not None:
        gen_kwargs["eos_token_id"] = eos_token_id
    with model.river_mode("backbone"):
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
        steps (number of backbone layers run; ``num_layers`` = no exit), ``exit_fraction`` and
        ``num_layers``.

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

    model.river.log.clear()
    cache = RiverCache(config=model.config.get_text_config(decoder=True))
    logits = [model(input_ids=input_ids, cache=cache, use_cache=True).logits[0, -1]]
    for t in range(n - 1):
        step = ref_tokens[t : t + 1][None]
        logits.append(model(input_ids=step, cache=cache, use_cache=True).logits[0, -1])
    river_logits = torch.stack(logits).float()  # [N, V]

    matches = int((river_logits.argmax(-1) == ref_logits.argmax(-1)).sum())
    ref_logp = torch.log_softmax(ref_logits, -1)
    kl = (ref_logp.exp() * (ref_logp - torch.log_softmax(river_logits, -1))).sum(-1)
    decode = [e for (_, _, e) in model.river.log[1:]]
    L = model.river.num_layers
    return {
        "positions": n,
        "matches": matches,
        "match_rate": matches / n if n else None,
        "mean_kl": float(kl.mean()) if n else None,
        "mean_exit_layer": sum(decode) / len(decode) if decode else None,
        "exit_fraction": sum(e < L for e in decode) / len(decode) if decode else None,
        "num_layers": L,
    }
