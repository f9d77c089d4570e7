"""Lossless River for a batch of sequences: River's own draft / verify / accept loop.

Each round every unfinished row drafts k tokens through the exit path (route mode, the whole batch
in one one-token pass per draft, K/V written into the shared cache; a batch exits when its
slowest real row does), the k drafted positions are cropped, and ONE backbone pass verifies
[last token + k drafts] for all rows (B x (k+1) tokens). Each row accepts its own longest prefix
(greedy: drafts equal to the backbone's argmax; sampling: Leviathan et al. 2023, Alg. 1, per row:
accept draft x with min(1, p(x)/q(x)), on rejection sample from norm(max(p - q, 0)), the bonus
token from p when all were accepted) plus one backbone token.

Rows advance by different amounts, yet the cache keeps ONE common length: a row's rejected drafts
stay in the cache as positions whose 2-D attention mask is 0 (padding in the middle of the mask,
which transformers' ``masking_utils`` padding mask reads per key position), and position ids come
from the cumulative mask (as ``generate`` computes them for left padding), so each row's real
positions stay contiguous. Columns no row accepted are cropped off. The returned sequences drop
those masked positions: ``[B, prompt + new]``, rows padded with ``pad_token_id`` after their EOS.

Why not transformers' assisted loop (``_assisted_decoding``): it is batch 1 by construction, one
cache length and one ``n_matches`` per round (``_speculative_sampling`` judges a single row), so a
batch whose rows accept different numbers of drafts cannot be carried there.

A streamer gets rectangles, as ``generate`` gives them, although rows advance by different
amounts (``_stream_columns``): the prompt once, then after each verify round the new-token
columns every still-unfinished row has reached and that were not put yet (``[B, n]``, nothing
when n = 0; a row already finished shows ``pad_token_id`` in columns past its end, as ``generate``
pads finished rows), and at the end the columns left, then ``end()``. So the first column arrives
right after the prefill (what :class:`river_hf.timing.TokenTimer` needs to time the decode apart
from the time to first token), every put holds only final tokens (a later round never changes a
column already put), and the puts concatenated are the returned sequences' new tokens.

Only logits warpers that read nothing but the current scores are applied here
(:data:`HISTORY_FREE`); :func:`river_hf.river.lossless_generate.can_draft` sends any other setting
to the backbone path. Prompt lookup and the FR-Spec draft vocabulary apply to batch-1 calls only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import (EpsilonLogitsWarper, EtaLogitsWarper, LogitNormalization, LogitsProcessorList,
                          MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
                          TypicalLogitsWarper)

from .cache import RiverCache
from .draft_schedule import bytes_cost, make_schedule
from .layer import EXIT_ONLY, ROUTE
from .rows import position_ids

__all__ = ["HISTORY_FREE", "history_free", "BatchPlan", "generate_batch"]

#: Logits processors that depend only on the current scores (never on the tokens so far), so the
#: same processed distribution is computed for a draft, a verify position and plain decoding. A
#: processor of the caller's own joins them by saying so: a class attribute ``history_free = True``
#: (:func:`history_free`).
HISTORY_FREE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
                EpsilonLogitsWarper, EtaLogitsWarper, LogitNormalization)


def history_free(processor) -> bool:
    """Whether ``processor`` reads only the current scores: one of :data:`HISTORY_FREE`, or a
    processor whose ``history_free`` attribute is True (e.g. one that masks fixed token ids)."""
    return isinstance(processor, HISTORY_FREE) or getattr(processor, "history_free", False) is True


@dataclass
class BatchPlan:
    """What one batched lossless call needs (built by ``lossless_generate.can_draft``).

    Attributes:
        input_ids: ``LongTensor [B, n]``, the prompts as given (left padding included).
        attention_mask: ``LongTensor [B, n]``, 1 for real prompt tokens.
        max_length: the longest output, prompt padding included (generate's ``max_length``).
        eos: EOS token ids, or None.
        pad_token_id: what finished rows are padded with.
        do_sample: sampling (else greedy).
        processors: the call's processors, all of :data:`HISTORY_FREE` types.
        streamer: the call's ``streamer`` (a transformers ``BaseStreamer``), or None; it gets
            the prompt, then rectangles of new-token columns (``_stream_columns``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_length: int
    eos: set[int] | None
    pad_token_id: int
    do_sample: bool
    processors: LogitsProcessorList
    streamer: object = None

    def generate(self, model, call) -> torch.Tensor:
        """The call's output, ``LongTensor [B, prompt + new]`` (see :func:`generate_batch`)."""
        return generate_batch(model, self, call)


@dataclass
class _State:
    ids: torch.Tensor  # [B, T]: every column the cache has seen plus the pending last token
    mask: torch.Tensor  # [B, T] long: 1 = a real token of that row, 0 = padding / rejected draft
    cache: RiverCache  # holds T - 1 columns
    new: torch.Tensor  # [B] long: real new tokens per row
    done: torch.Tensor  # [B] bool
    streamed: int = 0  # new-token columns already put to the streamer


def _pass_mask(state: _State) -> torch.Tensor:
    """The mask a pass sees: a finished row's pending last token counts as padding (so it does not
    hold back the exit decision of the live rows)."""
    return torch.cat([state.mask[:, :-1], state.mask[:, -1:] * (~state.done).long()[:, None]], -1)


def _scores(plan: BatchPlan, logits: torch.Tensor) -> torch.Tensor:
    """Processed scores of ``logits [..., V]`` (history-free processors: no token ids are read)."""
    if not len(plan.processors):
        return logits
    flat = logits.reshape(-1, logits.shape[-1])
    dummy = torch.zeros((flat.shape[0], 1), dtype=torch.long, device=flat.device)
    return plan.processors(dummy, flat).view(logits.shape)


def _choose(plan: BatchPlan, scores: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` tokens: a sample of softmax(scores) or its argmax."""
    if plan.do_sample:
        return torch.multinomial(scores.softmax(-1), num_samples=1)
    return scores.argmax(-1, keepdim=True)


def _is_eos(plan: BatchPlan, tokens: torch.Tensor) -> torch.Tensor:
    if not plan.eos:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return torch.isin(tokens, torch.tensor(sorted(plan.eos), device=tokens.device))


def _prompt_pass(model, plan: BatchPlan) -> _State:
    """The prompt on the backbone (lossless mode keeps it there) and the first new token."""
    ids, mask = plan.input_ids, plan.attention_mask.long()
    cache = RiverCache(config=model.config.get_text_config(decoder=True))
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask, ids.shape[1]), cache=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1].float()
    first = _choose(plan, _scores(plan, logits))
    new = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)
    done = _is_eos(plan, first)[:, 0] | (ids.shape[1] + new >= plan.max_length)
    return _State(torch.cat([ids, first], -1), torch.cat([mask, torch.ones_like(first)], -1), cache, new, done)


def _draft(model, state: _State, k: int, plan: BatchPlan, call):
    """Up to ``k`` drafts per row through the exit path, their K/V cropped again.

    Returns ``(drafts LongTensor [B, j], q float32 [B, j, V] or None)``, j <= k (fewer when every
    live row drafted an EOS)."""
    settings, record = call.draft_settings, call.record
    mode = EXIT_ONLY if call.draft_path == "exit" else ROUTE
    live = (~state.done).long()[:, None]
    mask, token = _pass_mask(state), state.ids[:, -1:]
    drafts, qs = [], []
    ended = state.done.clone()
    with model.river.override(mode=mode, rules=settings.get("draft_rules")):
        for j in range(k):
            if j:
                mask = torch.cat([mask, live], -1)
            logits = model(input_ids=token, attention_mask=mask, position_ids=position_ids(mask, 1), cache=state.cache,
                           use_cache=True, logits_to_keep=1).logits[:, -1].float()
            record["draft_exit_layers"].append(model.river.exit_layer)
            scores = _scores(plan, logits)
            token = _choose(plan, scores).masked_fill(state.done[:, None], plan.pad_token_id)
            drafts.append(token)
            if plan.do_sample:
                qs.append(scores.softmax(-1))
            ended |= _is_eos(plan, token)[:, 0]
            if bool(ended.all()):
                break
    state.cache.crop(-len(drafts))  # the drafts' K/V; the verify pass writes the backbone's in their place
    record["draft_passes"] += len(drafts)
    return torch.cat(drafts, -1), (torch.stack(qs, 1) if plan.do_sample else None)


def _verify(model, state: _State, drafts: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
    """One backbone pass over [last token + drafts] for every row: processed scores
    ``float32 [B, k+1, V]`` (position j scores the token after draft j)."""
    k = drafts.shape[1]
    tokens = torch.cat([state.ids[:, -1:], drafts], -1)
    mask = torch.cat([_pass_mask(state), (~state.done).long()[:, None].expand(-1, k)], -1)
    logits = model(input_ids=tokens, attention_mask=mask, position_ids=position_ids(mask, k + 1), cache=state.cache,
                   use_cache=True).logits.float()
    return _scores(plan, logits)


def _accept(plan: BatchPlan, drafts: torch.Tensor, q, scores: torch.Tensor, limit: torch.Tensor):
    """Each row's accepted drafts ``n [B]`` (at most ``limit [B]``) and its next token ``[B, 1]``:
    greedy longest prefix equal to the argmax, or the speculative-sampling rule per row."""
    B, k = drafts.shape
    if k == 0:
        return limit.new_zeros(B), _choose(plan, scores[:, 0])
    judged = torch.arange(k, device=drafts.device)[None, :] < limit[:, None]
    rows = torch.arange(B, device=drafts.device)
    if not plan.do_sample:
        best = scores.argmax(-1)
        n = ((drafts == best[:, :k]) & judged).long().cumprod(-1).sum(-1)
        return n, best[rows, n][:, None]
    p = scores.softmax(-1)
    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    q_draft = q.gather(-1, drafts[..., None])[..., 0]
    ok = (torch.rand_like(p_draft) <= p_draft / q_draft) & judged
    n = ok.long().cumprod(-1).sum(-1)
    p_n = p[rows, n]
    rejected = n < limit  # a judged draft was rejected: sample from the residual, else from p
    q_n = torch.cat([q, torch.zeros_like(p[:, :1])], 1)[rows, n] * rejected[:, None]
    residual = (p_n - q_n).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_n)
    return n, torch.multinomial(residual, num_samples=1)


def _advance(state: _State, plan: BatchPlan, drafts: torch.Tensor, n: torch.Tensor, bonus: torch.Tensor) -> None:
    """Append the round: accepted drafts stay real, rejected ones become masked columns (cropped
    where no row accepted them), the next token becomes the pending last column; rows stop at EOS
    or the length limit."""
    live = ~state.done
    m = int(n[live].max()) if bool(live.any()) else 0
    k = drafts.shape[1]
    if k > m:
        state.cache.crop(m - k)  # columns no row accepted
    cols = torch.cat([drafts[:, :m], bonus], -1)  # [B, m+1]
    j = torch.arange(m + 1, device=cols.device)[None, :]
    real = ((j < n[:, None]) | (j == m)) & live[:, None]
    emitted_eos = _is_eos(plan, cols) & real
    first = torch.where(emitted_eos.any(-1), emitted_eos.long().argmax(-1), m + 1)  # column of the first EOS
    real &= j <= first[:, None]
    state.ids = torch.cat([state.ids, cols.masked_fill(~real, plan.pad_token_id)], -1)
    state.mask = torch.cat([state.mask, real.long()], -1)
    state.new += real.sum(-1)
    state.done |= emitted_eos.any(-1) | (plan.input_ids.shape[1] + state.new >= plan.max_length)


def _new_columns(state: _State, plan: BatchPlan, start: int, stop: int) -> torch.Tensor:
    """``LongTensor [B, stop - start]``: new-token columns ``start .. stop - 1`` of the output,
    each row's real new tokens (the masked positions removed), ``pad_token_id`` past a row's end."""
    n = plan.input_ids.shape[1]
    out = torch.full((state.ids.shape[0], stop - start), plan.pad_token_id, dtype=torch.long, device=state.ids.device)
    for b in range(out.shape[0]):
        row = state.ids[b, n:][state.mask[b, n:].bool()][start:stop]
        out[b, :row.numel()] = row
    return out


def _sequences(state: _State, plan: BatchPlan) -> torch.Tensor:
    """``[B, prompt + new]``: the prompts as given, each row's real new tokens, then padding."""
    return torch.cat([plan.input_ids, _new_columns(state, plan, 0, int(state.new.max()))], -1)


def _stream_columns(state: _State, plan: BatchPlan, *, final: bool = False) -> None:
    """Put to ``plan.streamer`` the new-token columns every unfinished row has reached and that
    were not put yet (every column left when ``final`` or when no row is unfinished), as one
    ``LongTensor [B, n]`` on the CPU (nothing when n = 0); ``final`` then calls ``end()``.

    The rule and its reason: a transformers streamer expects one rectangle per put (``generate``
    puts ``[B]`` per step, finished rows padded), but rows accept different numbers of drafts; the
    columns every live row has reached are final for every row (a finished row's are its tokens,
    then ``pad_token_id``, as in the returned sequences), so nothing put is ever taken back and the
    puts concatenated equal the returned new tokens."""
    if plan.streamer is None:
        return
    live = ~state.done
    reach = int(state.new.max()) if final or not bool(live.any()) else int(state.new[live].min())
    if reach > state.streamed:
        plan.streamer.put(_new_columns(state, plan, state.streamed, reach).cpu())
        state.streamed = reach
    if final:
        plan.streamer.end()


def generate_batch(model, plan: BatchPlan, call) -> torch.Tensor:
    """Lossless decoding of a batch with ``model`` (a River model in lossless mode) for ``call``,
    its :class:`~river_hf.river.call.GenerateCall` (prepared by
    :func:`~river_hf.river.lossless.lossless_call`, which sets the draft settings).

    Returns ``LongTensor [B, prompt + new]``: the plain model's tokens per row (greedy: identical;
    sampling: the same distribution), rows padded with ``plan.pad_token_id`` after their EOS.
    ``call.record`` gets the call's statistics counted per row (``rounds``: live rows per verify pass,
    ``drafted``, ``accepted``), ``verify_passes``, ``batch_size`` and the draft/verify seconds.
    ``plan.streamer`` (when given) gets the prompt ``[B, prompt]``, the first new-token column
    right after the prefill, after each verify round the columns every unfinished row has reached
    (``[B, n]``, none when n = 0), the columns left at the end, then ``end()``: rectangles of final
    tokens whose concatenation is the output's new tokens (why: ``_stream_columns``).
    """
    config, record = model.river_config, call.record
    for key in ("rounds", "drafted", "accepted", "draft_passes", "verify_passes"):
        record.setdefault(key, 0)
    for key in ("draft_seconds", "verify_seconds", "exit_verify_seconds"):
        record.setdefault(key, 0.0)
    record.setdefault("draft_exit_layers", [])
    record.update(batch_size=plan.input_ids.shape[0], draft_path=call.draft_path, draft_schedule=config.draft_schedule,
                  draft_tokens=config.draft_tokens, max_draft_tokens=config.max_draft_tokens)
    schedule = make_schedule(config.draft_schedule, config.draft_tokens, config.max_draft_tokens,
                             call.draft_settings.get("verify_cost"))
    k = schedule.k
    if plan.streamer is not None:
        plan.streamer.put(plan.input_ids.cpu())  # the prompt, once, as generate puts it
    with torch.no_grad():
        state = _prompt_pass(model, plan)
        _stream_columns(state, plan)
        while not bool(state.done.all()):
            start = time.perf_counter()
            live = ~state.done
            room = plan.max_length - plan.input_ids.shape[1] - state.new - 1  # drafts a row may still accept
            k_round = max(0, min(k, int(room[live].max())))
            if k_round:
                drafts, q = _draft(model, state, k_round, plan, call)
            else:
                drafts, q = state.ids.new_zeros((state.ids.shape[0], 0)), None
            verify_start = time.perf_counter()
            scores = _verify(model, state, drafts, plan)
            limit = room.clamp(min=0, max=drafts.shape[1])
            n, bonus = _accept(plan, drafts, q, scores, limit)
            _advance(state, plan, drafts, n, bonus)
            now = time.perf_counter()
            record["draft_seconds"] += verify_start - start
            record["verify_seconds"] += now - verify_start
            record["exit_verify_seconds"] += now - verify_start
            record["last_round_end"] = now
            record["verify_passes"] += 1
            if drafts.shape[1]:
                passes = drafts.shape[1]
                cost = bytes_cost(model, record["draft_exit_layers"][-passes:])
                k = _judge_round(record, schedule, n[live], limit[live], passes, cost)
            _stream_columns(state, plan)
    _stream_columns(state, plan, final=True)
    return _sequences(state, plan)


def _judge_round(record: dict, schedule, n: torch.Tensor, limit: torch.Tensor, draft_passes: int,
                 draft_cost: float) -> int:
    """Count a round's live rows (accepted ``n``, judged ``limit``) and return the next k from the
    call's :mod:`~river_hf.river.draft_schedule` (every live row's outcome: the ``heuristic``
    schedule grows k only when every row accepted every draft it judged)."""
    record["rounds"] += int(n.numel())
    record["drafted"] += int(limit.sum())
    record["accepted"] += int(n.sum())
    return schedule.update(n.tolist(), limit.tolist(), draft_passes, draft_cost)
