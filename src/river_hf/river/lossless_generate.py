"""Lossless mode inside ``generate``: which calls can draft, and the two places where River's
drafter enters transformers' assisted decoding.

:meth:`~river_hf.river.modeling.RiverForCausalLM.generate` asks :func:`can_draft` (one sequence,
no beams, one return sequence, a cache, and no other drafter); a call that can runs transformers'
assisted-decoding loop with the model as its own assistant, and the model's
``_get_candidate_generator`` / ``_get_stopping_criteria`` hand it :func:`drafter` (an
:class:`~river_hf.river.lossless.ExitPathDrafter`) and :func:`first_stop` (the criteria wrapped in
:class:`~river_hf.river.lossless.FirstStop`). The drafting itself is :mod:`.lossless`.

A batch of several sequences gets a :class:`~river_hf.river.lossless_batch.BatchPlan` from
:func:`can_draft` instead (:func:`batch_plan`): River's own loop (:mod:`.lossless_batch`) runs it,
as transformers' assisted decoding is batch 1 only.
"""

from __future__ import annotations

import warnings

import torch

from ..compat import eos_token_ids, logits_processors, prepare_generation_config, prepare_lengths
from ..errors import RiverError
from .layer import LOSSLESS
from .drafter import ExitPathDrafter
from .lossless import FirstStop
from .lossless_batch import BatchPlan, history_free

__all__ = ["OTHER_DRAFTERS", "BATCH_FALLBACK_ARGS", "BATCH_FALLBACK_SETTINGS", "can_draft", "batch_plan", "drafter",
           "first_stop"]

#: ``generate`` arguments that bring their own drafter or decoding loop (refused in lossless mode).
OTHER_DRAFTERS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate", "use_mtp",
                  "assistant_tokenizer")


def can_draft(model, kwargs: dict, gen_config, prompt, stacklevel: int = 2, args: tuple = ()):
    """Whether this lossless-mode call of ``model.generate`` can draft and verify, and how.

    Returns ``True`` for one sequence (transformers' assisted decoding with River's drafter), a
    :class:`~river_hf.river.lossless_batch.BatchPlan` for a batch River's own loop can carry
    (:func:`batch_plan`), or ``False``: no beams, one return sequence and a cache are needed, and a
    batch only takes settings that depend on the current logits alone. A call that cannot draft
    runs on the backbone alone (warned once per model and reason, naming the setting;
    ``stacklevel`` 2: the warning points at the caller of this function's caller).

    Raises:
        RiverError: arguments, or generation-config settings, that bring another drafter.
    """
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
    reasons = [why for why, bad in (("num_beams=%d" % beams, beams > 1),
                                    ("num_return_sequences=%d" % returns, returns > 1),
                                    ("use_cache=False", use_cache is False)) if bad]
    plan = True
    if not reasons and batch > 1:
        plan, reasons = batch_plan(model, args, kwargs, gen_config, prompt)
    if not reasons:
        return plan
    warned = model.__dict__.setdefault("_river_warned_lossless_batch", set())
    key = tuple(r.split("=")[0].split(" (")[0] for r in reasons)
    if key not in warned:
        warned.add(key)
        warnings.warn(
            f"River's lossless mode cannot draft this call ({'; '.join(reasons)}): it drafts for one sequence with "
            "transformers' assisted decoding, or for a batch with River's own loop when every logits processor reads "
            "the current logits only (temperature, top-k, top-p, ...), with no beams, one return sequence and a "
            "cache; so it runs on the backbone alone: the same tokens, not faster (river_stats['mode'] says "
            "'backbone')", UserWarning, stacklevel=stacklevel + 1)
    return False


#: ``generate`` arguments a batched lossless call leaves to the backbone path when given
#: (they read the token history or bring inputs or a cache River's batched loop does not take).
#: A ``streamer`` is not among them: the batched loop puts rectangles of final columns
#: (:mod:`.lossless_batch`).
BATCH_FALLBACK_ARGS = ("stopping_criteria", "prefix_allowed_tokens_fn", "negative_prompt_ids",
                       "negative_prompt_attention_mask", "synced_gpus", "inputs_embeds", "cache", "past_key_values")
#: generation settings a batched lossless call leaves to the backbone path when set.
BATCH_FALLBACK_SETTINGS = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                           "output_hidden_states", "stop_strings", "max_time")


def batch_plan(model, args: tuple, kwargs: dict, gen_config, prompt):
    """``(BatchPlan, [])`` when River's own batched loop (:mod:`.lossless_batch`) can carry this
    call exactly, else ``(False, reasons)``: each reason names the argument or setting (a
    processor that reads the token history such as ``repetition_penalty``, ``no_repeat_ngram_size``,
    ``min_new_tokens``, suppressed tokens; stopping criteria, stop strings,
    ``return_dict_in_generate``; a sliding window the call may outgrow; other model inputs). A
    ``streamer`` is carried: the plan holds it (see :mod:`.lossless_batch` for what it is put)."""
    if len(args) > 2:
        return False, ["positional arguments after generation_config"]
    config, extra = prepare_generation_config(
        model, gen_config, **{k: v for k, v in kwargs.items() if k != "generation_config"})
    reasons = [f"{k} given" for k in BATCH_FALLBACK_ARGS if kwargs.get(k) is not None]
    reasons += [f"{k} given" for k, v in extra.items() if v is not None and k not in BATCH_FALLBACK_ARGS
                and k not in ("input_ids", "inputs", "attention_mask", "logits_processor", "tokenizer", "streamer")]
    reasons += [f"{k}={getattr(config, k)!r}" for k in BATCH_FALLBACK_SETTINGS if getattr(config, k, None)]
    if config.cache_implementation not in (None, "dynamic"):
        reasons.append(f"cache_implementation={config.cache_implementation!r}")
    if reasons:
        return False, reasons
    has_default = {f: kwargs.get(f) is None and (gen_config is None or getattr(gen_config, f) is None)
                   and getattr(model.generation_config, f) is None for f in ("max_length", "min_length")}
    mask = kwargs.get("attention_mask")
    try:
        config = prepare_lengths(model, config, prompt, has_mask=mask is not None, has_default=has_default)
    except ValueError as e:  # the prompt is already max_length long
        raise RiverError(str(e)) from e
    processors = logits_processors(model, config, prompt, logits_processor=kwargs.get("logits_processor"),
                                   prefix_allowed_tokens_fn=None, model_kwargs=dict(extra))
    reasons = [f"{type(p).__name__} (reads the tokens so far)" for p in processors if not history_free(p)]
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    longest = prompt.shape[1] + (config.max_length - prompt.shape[1]) * (model.river_config.max_draft_tokens + 1)
    if window is not None and longest > window:
        reasons.append(f"sliding_window={window} (a batch's masked draft positions would take window slots)")
    if reasons:
        return False, reasons
    eos = eos_token_ids(config)
    pad = config.pad_token_id if config.pad_token_id is not None else (min(eos) if eos else 0)
    if mask is None:  # as generate infers it: padding where the pad token is (unless it is also EOS)
        mask = prompt.ne(pad).long() if (prompt == pad).any() and not (eos and pad in eos) else torch.ones_like(prompt)
    return BatchPlan(input_ids=prompt, attention_mask=mask, max_length=config.max_length, eos=eos,
                     pad_token_id=int(pad), do_sample=bool(config.do_sample), processors=processors,
                     streamer=kwargs.get("streamer")), []


def _lossless_call(model):
    """The lossless :class:`~river_hf.river.call.GenerateCall` in flight on ``model`` (this
    thread's), or None: no call, another mode, or a call that cannot draft."""
    call = model.river.current_call
    return call if call is not None and call.lossless and model.river.mode == LOSSLESS else None


def drafter(model, generation_config, logits_processor) -> ExitPathDrafter | None:
    """In a lossless call of ``model``, River's :class:`ExitPathDrafter` with the settings of
    ``model.river_config`` and of the call (its record and draft settings); None otherwise
    (transformers then makes its own choice)."""
    call = _lossless_call(model)
    if call is None:
        return None
    config = model.river_config
    return ExitPathDrafter(model, generation_config, logits_processor, draft_tokens=config.draft_tokens,
                           schedule=config.draft_schedule, record=call.record,
                           prompt_lookup_tokens=config.prompt_lookup_tokens,
                           max_draft_tokens=config.max_draft_tokens, **call.draft_settings)


def first_stop(model, criteria):
    """In a lossless call of ``model``, ``criteria`` wrapped in :class:`FirstStop` (asked token by
    token over each round, so a stop string inside a round stops there) and left on the call
    (``GenerateCall.first_stop``) for the cut after the loop; else ``criteria`` itself."""
    call = _lossless_call(model)
    if call is not None:
        criteria = call.first_stop = FirstStop(criteria)
    return criteria
