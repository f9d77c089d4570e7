"""Lossless mode inside ``generate``: which calls can draft, and the two places where River's
drafter enters transformers' assisted decoding.

:meth:`~river_hf.river.modeling.RiverForCausalLM.generate` asks :func:`can_draft` (one sequence,
no beams, one return sequence, a cache, and no other drafter); a call that can runs transformers'
assisted-decoding loop with the model as its own assistant, and the model's
``_get_candidate_generator`` / ``_get_stopping_criteria`` hand it :func:`drafter` (an
:class:`~river_hf.river.lossless.ExitPathDrafter`) and :func:`first_stop` (the criteria wrapped in
:class:`~river_hf.river.lossless.FirstStop`). The drafting itself is :mod:`.lossless`.
"""

from __future__ import annotations

import warnings

from ..compat import prepare_generation_config
from ..errors import RiverError
from .layer import LOSSLESS
from .lossless import ExitPathDrafter, FirstStop

__all__ = ["OTHER_DRAFTERS", "can_draft", "drafter", "first_stop"]

#: ``generate`` arguments that bring their own drafter or decoding loop (refused in lossless mode).
OTHER_DRAFTERS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate", "use_mtp",
                  "assistant_tokenizer")


def can_draft(model, kwargs: dict, gen_config, prompt, stacklevel: int = 2) -> bool:
    """Whether this lossless-mode call of ``model.generate`` can draft and verify: one sequence,
    no beams, one return sequence, a cache. When it cannot, the call runs on the backbone alone
    (warned once per model and reason; ``stacklevel`` 2: the warning points at the caller of this
    function's caller). Refuses arguments, or generation-config settings, that bring another
    drafter."""
    # the config transformers' generate will use: the call's config (or a fresh one) with the
    # model's generation_config filling what it leaves unset, then the call's keyword arguments
    base, _ = prepare_generation_config(
        model, gen_config, **{k: v for k, v in kwargs.items() if k != "generation_config"})
    given = [k for k in OTHER_DRAFTERS if kwargs.get(k) is not None or getattr(base, k, None) not in (None, False)]
    if given:
        raise RiverError(
            f"River's lossless mode drafts with the model's own exit path; {', '.join(given)} would replace that "
            "drafter: drop it (from the call or the generation config), or leave lossless mode "
            "(model.river_mode('backbone') or 'route'); for prompt lookup inside lossless mode set "
            "RiverConfig.prompt_lookup_tokens"
        )
    beams = getattr(base, "num_beams", None) or 1
    returns = getattr(base, "num_return_sequences", None) or 1
    use_cache = getattr(base, "use_cache", True)
    batch = prompt.shape[0] if prompt is not None else 1
    reasons = [why for why, bad in (("a batch of %d sequences" % batch, batch > 1), ("num_beams=%d" % beams, beams > 1),
                                    ("num_return_sequences=%d" % returns, returns > 1),
                                    ("use_cache=False", use_cache is False)) if bad]
    if not reasons:
        return True
    warned = model.__dict__.setdefault("_river_warned_lossless_batch", set())
    key = tuple(r.split("=")[0].split(" of ")[0] for r in reasons)
    if key not in warned:
        warned.add(key)
        warnings.warn(
            f"River's lossless mode drafts for one sequence at a time (transformers' assisted decoding: batch 1, "
            f"num_beams=1, num_return_sequences=1, with a cache); this call has {', '.join(reasons)}, so it runs on "
            "the backbone alone: the same tokens, not faster (river_stats['mode'] says 'backbone')",
            UserWarning, stacklevel=stacklevel + 1)
    return False


def drafter(model, generation_config, logits_processor) -> ExitPathDrafter | None:
    """In a lossless call of ``model``, River's :class:`ExitPathDrafter` with the settings of
    ``model.river_config``; None otherwise (transformers then makes its own choice)."""
    record = model.river._local.lossless_record
    if record is None or model.river.mode != LOSSLESS:
        return None
    config = model.river_config
    settings = getattr(model.river._local, "draft_settings", None) or {}
    return ExitPathDrafter(model, generation_config, logits_processor, draft_tokens=config.draft_tokens,
                           schedule=config.draft_schedule, record=record,
                           prompt_lookup_tokens=config.prompt_lookup_tokens,
                           max_draft_tokens=config.max_draft_tokens, **settings)


def first_stop(model, criteria):
    """In a lossless call of ``model``, ``criteria`` wrapped in :class:`FirstStop` (asked token by
    token over each round, so a stop string inside a round stops there) and remembered for the
    cut after the loop; else ``criteria`` itself."""
    local = model.river._local
    if local.lossless_record is not None and model.river.mode == LOSSLESS:
        criteria = FirstStop(criteria)
        local.first_stop = criteria
    return criteria
