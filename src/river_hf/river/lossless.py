"""Lossless River: the exit path drafts, the backbone verifies, one shared KV cache.

River's exit path (backbone layers until the exit rule fires, then exit layers and the exit head)
agrees with the backbone on most next tokens; that is a draft model with a high acceptance rate
and no weights or cache of its own. In lossless mode each round of decoding

1. **drafts** up to k tokens one by one through the exit path (:class:`ExitPathDrafter`), each
   draft pass writing its K/V into the same cache slots as always (River-LLM "KV share");
2. **crops** the cache back to the last accepted position, so the drafts' K/V are gone;
3. **verifies**: the backbone runs once over [last accepted token + k drafts], writing full
   precision K/V in their place; greedy keeps the longest prefix of drafts equal to the
   backbone's argmax plus the backbone's next token, sampling applies the speculative-sampling
   rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023): accept draft x with min(1, p(x)/q(x)),
   on rejection sample from norm(max(p - q, 0)), q being exactly the processed distribution the
   draft was sampled from and p the backbone's processed distribution.

The prompt is prefilled on the backbone. The tokens are the unmodified model's: identical in
greedy decoding (up to fp32 summation order of a multi-token pass against one-token passes, as in
every batched verify), the same distribution in sampling.

Step 3 and the loop are transformers' own assisted decoding (``GenerationMixin._assisted_decoding``
with ``_speculative_sampling``, its logits processors, stopping criteria and streamers), entered by
passing the River model as its own ``assistant_model``: the drafter is a transformers
``CandidateGenerator`` that is handed the main model's cache through ``model_kwargs``
(``requires_model_outputs``), as transformers' own MTP drafter is, so no loop is copied. The draft
length k adapts like transformers' ``num_assistant_tokens_schedule="heuristic"`` (+2 when every
draft was accepted, -1 otherwise) or stays fixed.

Multi-token verify passes (and the prompt pass) of fp32 CPU models run their backbone Linears through
:class:`river_hf.quant.dense.PrepackedLinear` where that measured faster (``RiverConfig.verify_kernel``).

The pieces: :mod:`.drafter` (:class:`ExitPathDrafter`, :class:`LookupGate`: one round's draft),
:mod:`.verify_kernel` (:func:`verify_mode`, :func:`backbone_step_seconds`: the backbone passes'
kernel and the cost unit), and here what one call carries around the loop: :func:`lossless_call`
(fills the call's :class:`~river_hf.river.call.GenerateCall`: record, verify kernel, draft
settings), :func:`draft_settings`, :class:`FirstStop` and :func:`cut_at_stop`. The drafter's and
the verify kernel's names are re-exported here.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import StoppingCriteriaList

from .config import DRAFT_PATHS, DRAFT_SCHEDULES, PROMPT_LOOKUP_RULES, VERIFY_KERNELS
from .draft_vocab import draft_head_for
from .drafter import ExitPathDrafter, LookupGate
from .verify_kernel import (PACK_MEMORY_SHARE, PROMPT_MAX_ROWS, PROMPT_TIMED_ROWS, available_memory_bytes,
                            backbone_mode, backbone_step_seconds, verify_mode, verify_row_costs)

__all__ = ["ExitPathDrafter", "FirstStop", "LookupGate", "lossless_call", "draft_settings", "cut_at_stop",
           "DRAFT_PATHS", "DRAFT_SCHEDULES", "PROMPT_LOOKUP_RULES", "VERIFY_KERNELS", "verify_mode", "backbone_mode",
           "backbone_step_seconds", "available_memory_bytes", "PACK_MEMORY_SHARE", "PROMPT_TIMED_ROWS",
           "PROMPT_MAX_ROWS"]


class FirstStop(StoppingCriteriaList):
    """The call's stopping criteria, asked token by token over the tokens a round added.

    transformers' assisted-decoding loop appends a whole round (accepted drafts + the bonus token)
    and then asks the criteria once, on the whole sequence; a stop string completed in the middle
    of the round (or a custom criterion that would have fired there) is then missed, and decoding
    goes on. This list asks its criteria on every prefix the round added, in order; at the first
    one that fires it records that length (``stop_at``, tokens incl. the prompt) and says stop.
    River's ``generate`` then cuts the output back to ``stop_at``: exactly the unmodified model's
    tokens, which would have stopped there. (A streamer has already been given the round's
    tokens past that point.)
    """

    def __init__(self, criteria):
        super().__init__(criteria)
        self.stop_at: int | None = None
        self._seen: int | None = None

    def __call__(self, input_ids, scores, **kwargs):
        n = input_ids.shape[1]
        start = n if self._seen is None else min(self._seen + 1, n)
        self._seen = n
        for end in range(start, n + 1):
            done = super().__call__(input_ids[:, :end], scores, **kwargs)
            if bool(done.all()):
                self.stop_at = end if self.stop_at is None else self.stop_at
                return done
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def cut_at_stop(out, stop_at: int | None, prompt_length: int):
    """``generate``'s output cut back to ``stop_at`` tokens (see :class:`FirstStop`): the
    sequences, the per-token tuples of a ``return_dict_in_generate`` output, and its cache."""
    if stop_at is None:
        return out
    if isinstance(out, torch.Tensor):
        return out[:, :stop_at] if out.shape[1] > stop_at else out
    sequences = getattr(out, "sequences", None)
    if not isinstance(sequences, torch.Tensor) or sequences.shape[1] <= stop_at:
        return out
    extra = sequences.shape[1] - stop_at
    out.sequences = sequences[:, :stop_at]
    keep = stop_at - prompt_length
    for name in ("scores", "logits", "attentions", "hidden_states"):
        value = getattr(out, name, None)
        if isinstance(value, tuple) and len(value) > keep:
            setattr(out, name, value[:keep])
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is not None and hasattr(cache, "crop"):
        cache.crop(-extra)
    return out


def draft_settings(model) -> dict:
    """The drafter's keyword arguments from ``model.river_config`` (draft path, rules, FR-Spec head).

    Raises:
        RiverError: ``draft_vocab`` > 0 and no tokenizer loads (see
            :func:`river_hf.river.draft_vocab.draft_head_for`).
    """
    config = model.river_config
    head = None
    if config.draft_vocab and not getattr(model.config.get_text_config(), "final_logit_softcapping", None):
        # (a softcapped head is applied by the architecture's own forward: its drafts keep the exit head)
        head = draft_head_for(model, config.draft_vocab)
    return {"draft_path": config.draft_path, "draft_rules": config.build_draft_rules(), "draft_head": head,
            "prompt_lookup_rule": config.prompt_lookup_rule}


@contextlib.contextmanager
def lossless_call(model, call):
    """Within the block, ``call`` (this thread's :class:`~river_hf.river.call.GenerateCall`, in
    flight through ``model.river.calling``) is a lossless one: ``model._get_candidate_generator``
    hands transformers' ``_assisted_decoding`` (entered by passing the model as its own
    ``assistant_model``) an :class:`ExitPathDrafter` filling ``call.record``, and forward passes on
    the backbone (prefill, verify) run in the kernel mode of :func:`verify_mode` (River's forward
    hooks enter ``call.verify_linear``; draft passes do not: their Linears are quantized, and
    one-token calls are fast already). The draft settings (:func:`draft_settings`, with the verify
    pass's cost by its rows, :func:`verify_row_costs`, for the ``cost`` schedule) are prepared on
    entry, before the call's timer starts; after the call the record gets the model's backbone step
    time (:func:`backbone_step_seconds`, measured once per model)."""
    config = model.river_config
    call.lossless = True
    call.verify_linear, call.record["verify_kernel"] = verify_mode(model, config.verify_kernel,
                                                                   config.max_draft_tokens + 1)
    call.draft_settings = draft_settings(model)
    curve = verify_row_costs(model, call.verify_linear)
    call.draft_settings["verify_cost"] = curve
    call.record["verify_row_costs"] = [list(p) for p in curve.points] if curve is not None else None
    yield call
    call.record["backbone_step_seconds"] = backbone_step_seconds(model)
