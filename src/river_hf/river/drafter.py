"""Lossless mode's drafter: :class:`ExitPathDrafter` (a transformers ``CandidateGenerator``
that drafts through River's exit path in the main model's cache) and :class:`LookupGate` (which
prompt-lookup matches a round proposes).

Each round is a few named steps, like transformers' own candidate generators: the round's k
(:meth:`ExitPathDrafter.get_candidates`), a prompt-lookup proposal when one is found and the gate
takes it (``_lookup``), else up to k one-token passes through the exit path (``_draft``: each
pass ``_draft_logits``, FR-Spec's frequent-vocabulary head where configured), the cache crop, and
the round's counts and seconds (``_account``); after transformers' verify,
:meth:`ExitPathDrafter.update_candidate_strategy` counts the round and adapts k. The loop around
them (verify, acceptance, cache crop to what was accepted) is transformers' assisted decoding;
see :mod:`.lossless` for the whole picture.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.candidate_generator import CandidateGenerator, PromptLookupCandidateGenerator

from ..compat import eos_token_ids
from ..errors import RiverError
from .arch import decoder_stack
from .config import DRAFT_PATHS, DRAFT_SCHEDULES, PROMPT_LOOKUP_RULES
from .draft_schedule import bytes_cost, make_schedule
from .exit_step import ExitStep
from .layer import EXIT_ONLY, ROUTE

__all__ = ["ExitPathDrafter", "LookupGate"]


class LookupGate:
    """Whether a round that found a prompt-lookup match proposes it (``RiverConfig.prompt_lookup_rule``).

    Prompt lookup proposes tokens at no draft cost, but a verify of n rejected tokens costs more
    than a one-token step (the k+1-row backbone pass), so on text that does not repeat its context it
    is slower than exit-path drafts. ``adaptive`` compares, within one call, the two sources'
    produced tokens (accepted drafts + the verify's own token) per second of round time (draft +
    verify), each as an exponential moving average over its rounds (weight :attr:`DECAY` on the
    past): a match is proposed while lookup's rate is at least the exit path's, for the first
    :attr:`WARMUP` lookup rounds, while no exit-path round has been timed yet, and once every
    :attr:`RETRY` skipped matches (so a later stretch that repeats its context is noticed).
    ``always``: every match is proposed (Saxena 2023, prompt lookup decoding, as transformers does).

    Raises:
        RiverError: an unknown rule.
    """

    WARMUP = 2
    RETRY = 8
    DECAY = 0.7

    def __init__(self, rule: str = "always"):
        if rule not in PROMPT_LOOKUP_RULES:
            raise RiverError(f"prompt_lookup_rule must be one of {', '.join(PROMPT_LOOKUP_RULES)}, got {rule!r}")
        self.rule = rule
        self.tokens = {"lookup": 0.0, "exit": 0.0}
        self.seconds = {"lookup": 0.0, "exit": 0.0}
        self.rounds = {"lookup": 0, "exit": 0}
        self.skipped = 0
        self.declined = 0

    def rate(self, source: str) -> float | None:
        """Produced tokens per second of round time of ``source`` (``lookup`` / ``exit``), or None."""
        return self.tokens[source] / self.seconds[source] if self.seconds[source] > 0 else None

    def use(self) -> bool:
        """Whether this round's match is proposed (call once per round that found a match)."""
        if self.rule == "always" or self.rounds["lookup"] < self.WARMUP or self.rounds["exit"] == 0:
            return True
        if self.rate("lookup") >= self.rate("exit"):
            return True
        self.skipped += 1
        if self.skipped >= self.RETRY:
            self.skipped = 0
            return True
        self.declined += 1
        return False

    def update(self, source: str, tokens: int, seconds: float) -> None:
        """Add one round of ``source``: ``tokens`` produced in ``seconds`` of round time."""
        self.tokens[source] = self.DECAY * self.tokens[source] + tokens
        self.seconds[source] = self.DECAY * self.seconds[source] + max(seconds, 0.0)
        self.rounds[source] += 1

class ExitPathDrafter(CandidateGenerator):
    """Drafts candidate tokens with the River model's own exit path, in the main model's cache.

    A transformers ``CandidateGenerator`` for ``_assisted_decoding``: ``get_candidates`` is given
    the main model's ``model_kwargs`` (hence the cache object the verify passes use) and returns
    the candidates and their processed scores; ``update_candidate_strategy`` adapts k.

    Args:
        model: the River model (also the verifying model).
        generation_config: the call's ``GenerationConfig`` (``do_sample``, ``max_length``, EOS).
        logits_processor: the call's processors (warpers included); drafts are chosen from the
            scores they return, exactly as the verify pass processes the backbone's logits.
        draft_tokens: k of the first round (>= 1).
        max_draft_tokens: the largest k the schedule may reach (>= ``draft_tokens``; default: no cap).
        schedule: one of :data:`DRAFT_SCHEDULES` (:mod:`.draft_schedule`).
        record: dict the statistics of the call are accumulated into (see :meth:`stats`).
        prompt_lookup_tokens: when > 0, each round first looks for the last tokens (an n-gram of
            up to 2) earlier in the sequence, and when found proposes the up to this many tokens
            that followed them (transformers' ``PromptLookupCandidateGenerator``: Saxena 2023,
            prompt lookup decoding); such a round costs no draft pass. Rounds without a match
            draft through the exit path. The backbone verifies both kinds alike.
        prompt_lookup_rule: which matches are proposed (:class:`LookupGate`).
        draft_path: ``route`` (River's exit path) or ``exit`` (every layer its exit copy), see
            :data:`DRAFT_PATHS`.
        draft_rules: the exit rules of ``route`` draft passes (an ``ExitRuleList``; None: the model's).
        draft_head: a :class:`~river_hf.river.draft_vocab.FrequentVocabHead` the draft passes score
            with instead of the exit head (FR-Spec), or None.
        verify_cost: ``v(rows)`` for the ``cost`` schedule (:func:`~river_hf.river.draft_schedule.make_schedule`),
            or None.

    Raises:
        RiverError: ``draft_tokens`` < 1, ``max_draft_tokens`` < ``draft_tokens``, an unknown
            ``schedule``, ``draft_path`` or ``prompt_lookup_rule``.
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict = {}

    def __init__(self, model, generation_config, logits_processor, draft_tokens: int = 4,
                 schedule: str = "heuristic", record: dict | None = None, prompt_lookup_tokens: int = 0,
                 max_draft_tokens: int | None = None, prompt_lookup_rule: str = "always", draft_path: str = "route",
                 draft_rules=None, draft_head=None, verify_cost=None):
        if not isinstance(draft_tokens, int) or draft_tokens < 1:
            raise RiverError(f"draft_tokens must be an integer >= 1, got {draft_tokens!r}")
        self.model = model
        self.logits_processor = logits_processor
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.eos = eos_token_ids(generation_config)
        self.num_draft_tokens = draft_tokens
        self.max_draft_tokens = max_draft_tokens if max_draft_tokens is not None else 1 << 30
        if self.max_draft_tokens < draft_tokens:
            raise RiverError(f"max_draft_tokens ({max_draft_tokens}) must be >= draft_tokens ({draft_tokens})")
        self.schedule = make_schedule(schedule, draft_tokens, self.max_draft_tokens, verify_cost)
        if draft_path not in DRAFT_PATHS:
            raise RiverError(f"draft_path must be one of {', '.join(DRAFT_PATHS)}, got {draft_path!r}")
        self.draft_mode = EXIT_ONLY if draft_path == "exit" else ROUTE
        self.draft_rules = draft_rules
        self.draft_head = draft_head
        self.stack = decoder_stack(model)[0] if draft_head is not None else None  # FR-Spec's draft passes
        self.call_vocab = draft_head.call_vocab() if draft_head is not None else None
        self.gate = LookupGate(prompt_lookup_rule)
        self.record = record if record is not None else {}
        self.lookup = None
        if prompt_lookup_tokens:
            self.lookup = PromptLookupCandidateGenerator(
                eos_token_id=None if self.eos is None else torch.tensor(sorted(self.eos)),
                num_output_tokens=int(prompt_lookup_tokens), max_matching_ngram_size=2,
                max_length=generation_config.max_length, logits_processor=logits_processor,
                vocab_size=model.config.get_text_config().vocab_size)
        self._lookup_round = False
        for key in ("rounds", "drafted", "accepted", "lookup_rounds", "lookup_drafted", "lookup_accepted",
                    "lookup_declined", "draft_passes"):
            self.record.setdefault(key, 0)
        for key in ("draft_seconds", "verify_seconds", "exit_verify_seconds", "lookup_verify_seconds",
                    "lookup_draft_seconds"):
            self.record.setdefault(key, 0.0)
        self.record["prompt_lookup_rule"] = prompt_lookup_rule if self.lookup is not None else None
        self.record["draft_path"] = draft_path
        self.record.update(draft_schedule=schedule, draft_tokens=draft_tokens, max_draft_tokens=max_draft_tokens)
        self.record["draft_vocab"] = None if draft_head is None else int(draft_head.ids.numel())
        self.record["draft_vocab_call_ids"] = 0
        self._round_start = None
        self.record.setdefault("draft_exit_layers", [])
        self._drafted_now = 0
        self._verify_start = None
        self._prefilled = False

    @property
    def num_drafting_tokens(self) -> int:
        """Drafts the next round proposes at most (k; part of the public ``CandidateGenerator``
        interface since transformers 5.25, which sizes the cache's past recording with it)."""
        return int(self.num_draft_tokens)

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        """Up to k draft tokens after ``input_ids`` (``LongTensor [1, cur_len]``).

        The first iteration drafts nothing: transformers' loop then runs the prefill (on the
        backbone) as its verify pass. Later, the cache holds ``cur_len - 1`` positions (the last
        token is not yet in it); a round proposes a prompt-lookup match (:meth:`_lookup`) or
        drafts through the exit path (:meth:`_draft`, which crops the cache back to
        ``cur_len - 1``), and :meth:`_account` counts it.

        Returns:
            ``(candidate_ids LongTensor [1, cur_len + n], scores float32 [1, n, vocab] or None)``,
            ``n`` <= k drafts; drafting stops early at an EOS draft or the length limit.
        """
        self._round_start = time.perf_counter()
        self._drafted_now = 0
        self._lookup_round = False
        k = 0 if is_first_iteration else min(int(self.num_draft_tokens), self.max_length - input_ids.shape[1] - 1)
        if k < 1:  # the prefill's round, or the length limit: nothing to draft
            return self._account(input_ids, None, source=None, drafted=0)
        found = self._lookup(input_ids)
        if found is not None:  # no draft distribution: transformers' loop then samples from p and matches
            return self._account(found, None, source="lookup", drafted=found.shape[1] - input_ids.shape[1])
        sequence, scores = self._draft(input_ids, model_kwargs, k)
        return self._account(sequence, scores, source="exit", drafted=scores.shape[1])

    def _lookup(self, input_ids):
        """The prompt-lookup candidates (``LongTensor [1, cur_len + n]``) when prompt lookup is on,
        the last tokens occurred earlier and :class:`LookupGate` proposes the match; else None (a
        declined match is counted in ``lookup_declined``)."""
        if self.lookup is None:
            return None
        found, _ = self.lookup.get_candidates(input_ids)
        if found.shape[1] <= input_ids.shape[1]:
            return None
        if self.gate.use():
            return found
        self.record["lookup_declined"] += 1
        return None

    def _draft(self, input_ids, model_kwargs: dict, k: int):
        """Up to ``k`` one-token passes through the draft path (``self.draft_mode``, with the draft
        rules), each writing its K/V into the main model's cache; the argmax (or a sample) of the
        call's processed scores is the next draft; stops after an EOS draft. The cache is then
        cropped back by the drafts (the verify pass writes the backbone's K/V in their place).

        Returns:
            ``(sequence LongTensor [1, cur_len + n], scores float32 [1, n, vocab])``, 1 <= n <= k.
        """
        cache = model_kwargs["cache"]
        cur_len = input_ids.shape[1]
        position_ids = model_kwargs.get("position_ids")
        position = (position_ids[:, -1:] if position_ids is not None
                    else torch.full((1, 1), cur_len - 1, dtype=torch.long, device=input_ids.device))
        mask = model_kwargs.get("attention_mask")
        sequence, token = input_ids, input_ids[:, -1:]
        scores = []
        router = self.model.river
        if self.call_vocab is not None:
            self.call_vocab.add(input_ids)
        with router.override(mode=self.draft_mode, rules=self.draft_rules), torch.no_grad():
            # exit-path drafts without the forward's glue where nothing needs it (river.exit_step)
            step = ExitStep.prepare(self.model, cache, mask, 1) if self.draft_head is None else None
            try:
                sequence = self._draft_steps(k, step, sequence, token, mask, position, cache, scores)
            finally:
                if step is not None:
                    step.close()
        if self.call_vocab is not None:
            self.record["draft_vocab_call_ids"] = int(self.call_vocab.ids.numel())
        cache.crop(-len(scores))  # the drafts' K/V; the verify pass writes the backbone's in their place
        return sequence, torch.stack(scores, dim=1)

    def _draft_steps(self, k: int, step, sequence, token, mask, position, cache, scores: list):
        """:meth:`_draft`'s passes, through ``step`` (an :class:`~river_hf.river.exit_step.ExitStep`) or the
        model's forward (None): appends each draft's processed scores to ``scores``, returns the sequence
        with the drafts."""
        router = self.model.river
        for j in range(k):
            step_mask = None if mask is None else torch.cat([mask, mask.new_ones((1, j))], dim=-1)
            if step is not None:
                logits = step(token, position + j, step_mask)[:, -1, :].to(torch.float32)
            else:
                logits = self._draft_logits(token, step_mask, position + j, cache)
            self.record["draft_exit_layers"].append(router.exit_layer)
            processed = self.logits_processor(sequence, logits) if len(self.logits_processor) else logits
            if self.do_sample:
                token = torch.multinomial(processed.softmax(dim=-1), num_samples=1)
            else:
                token = processed.argmax(dim=-1, keepdim=True)
            sequence = torch.cat([sequence, token], dim=-1)
            scores.append(processed)
            if self.eos is not None and int(token) in self.eos:
                break
        return sequence

    def _draft_logits(self, token, mask, position, cache) -> torch.Tensor:
        """``float32 [1, vocab]`` logits of one draft pass of ``token`` (``[1, 1]``) at ``position``:
        the model through its exit head, or with FR-Spec (``draft_head``) the decoder stack and the
        frequent-vocabulary head on the last hidden state."""
        if self.draft_head is None:
            out = self.model(input_ids=token, attention_mask=mask, position_ids=position, cache=cache,
                             use_cache=True, logits_to_keep=1)
            return out.logits[:, -1, :].to(torch.float32)
        hidden = self.stack(input_ids=token, attention_mask=mask, position_ids=position, cache=cache,
                       use_cache=True).last_hidden_state
        return self.draft_head(hidden[:, -1:, :], self.call_vocab)[:, -1, :]

    def _account(self, candidates, scores, source: str | None, drafted: int):
        """End the round's draft half: count ``drafted`` candidates of ``source`` (``lookup``,
        ``exit`` or None: nothing proposed), add the seconds since the round began to the draft
        time, and start the verify's clock. Returns ``(candidates, scores)``."""
        now = time.perf_counter()
        self._verify_start = now
        if source is None:
            return candidates, scores
        self._drafted_now = drafted
        seconds = now - self._round_start
        self.record["draft_seconds"] += seconds
        if source == "lookup":
            self._lookup_round = True
            self.record["lookup_drafted"] += drafted
            self.record["lookup_draft_seconds"] += seconds
        else:
            self.record["drafted"] += drafted
            self.record["draft_passes"] += drafted
        return candidates, scores

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        """Count the round and adapt k (the call's :mod:`~river_hf.river.draft_schedule`)."""
        now = time.perf_counter()
        verify = 0.0
        if self._verify_start is not None and self._prefilled:
            verify = now - self._verify_start  # (the prefill's own time is not a verify)
            self.record["verify_seconds"] += verify
        self._verify_start = None
        self._prefilled = True
        self.record["last_round_end"] = now
        num_matches = int(num_matches)
        if self._drafted_now == 0:
            return  # the prefill, or a round at the length limit: no draft to judge
        round_seconds = now - self._round_start if self._round_start is not None else verify
        if self._lookup_round:
            self.record["lookup_rounds"] += 1
            self.record["lookup_accepted"] += num_matches
            self.record["lookup_verify_seconds"] += verify
            self.gate.update("lookup", num_matches + 1, round_seconds)
            return  # k belongs to the exit-path drafts
        self.record["rounds"] += 1
        self.record["accepted"] += num_matches
        self.record["exit_verify_seconds"] += verify
        self.gate.update("exit", num_matches + 1, round_seconds)
        passes = self._drafted_now
        cost = bytes_cost(self.model, self.record["draft_exit_layers"][-passes:])
        self.num_draft_tokens = self.schedule.update([num_matches], [passes], passes, cost)

    @staticmethod
    def stats(record: dict) -> dict:
        """River's lossless statistics of one call from the record a drafter filled.

        Returns a dict with ``rounds`` (verify passes after the prefill that judged exit-path
        drafts), ``drafted`` and ``accepted`` exit-path draft tokens, ``acceptance_rate``
        (accepted / drafted), ``mean_accepted`` (accepted drafts per round), ``drafts_per_verify``
        (drafted per round), the same counts of prompt-lookup rounds (``lookup_rounds``,
        ``lookup_drafted``, ``lookup_accepted``, ``lookup_acceptance_rate``, and
        ``lookup_declined``: matches the adaptive rule did not propose), ``tokens_per_verify``
        (tokens emitted per verify pass of either kind, the bonus included), ``draft_seconds`` and
        ``verify_seconds`` (wall time spent drafting, and from the end of a draft to the round's
        acceptance: the verify forward, its logits processing and the acceptance rule),
        ``mean_draft_exit_layer`` (mean exit layer of the draft passes), ``verify_kernel`` (the
        kernel the verify passes' backbone Linears ran on, why, and the memory its packed copy adds:
        see :func:`~river_hf.river.verify_kernel.verify_mode`), ``verify_row_costs`` (``[[rows,
        cost], ...]``: a verify pass of that many rows over a one-row backbone pass, as the ``cost``
        schedule took it, :func:`~river_hf.river.verify_kernel.verify_row_costs`; None: not
        measured), the draft settings (``draft_schedule``, ``draft_tokens``: k of the first round,
        ``max_draft_tokens``: the cap on k, None for none, ``draft_path``, ``draft_vocab``: ids of the
        frequent set, ``draft_vocab_call_ids``: ids of the call's own tokens scored beside it,
        ``prompt_lookup_rule``), and the costs in backbone decode steps: ``backbone_step_seconds``
        (one one-token backbone pass of this model,
        :func:`~river_hf.river.verify_kernel.backbone_step_seconds`),
        ``draft_cost_steps`` (seconds per exit-path draft pass / that step), ``verify_cost_steps``
        (seconds per verify pass / that step), and ``by_source``: for ``exit_path`` and
        ``prompt_lookup`` each, rounds, drafted, accepted, acceptance rate, tokens per verify and
        verify cost in steps. Costs are None where nothing was timed.
        """
        rounds, drafted, accepted = record.get("rounds", 0), record.get("drafted", 0), record.get("accepted", 0)
        l_rounds, l_drafted, l_accepted = (record.get("lookup_rounds", 0), record.get("lookup_drafted", 0),
                                           record.get("lookup_accepted", 0))
        exits = record.get("draft_exit_layers", [])
        verifies = rounds + l_rounds
        step = record.get("backbone_step_seconds")

        def steps(seconds, count):
            return seconds / count / step if step and count else None

        passes = record.get("draft_passes", 0)
        exit_draft_seconds = record.get("draft_seconds", 0.0) - record.get("lookup_draft_seconds", 0.0)
        return {
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted": accepted / rounds if rounds else None,
            "drafts_per_verify": drafted / rounds if rounds else None,
            "lookup_rounds": l_rounds,
            "lookup_drafted": l_drafted,
            "lookup_accepted": l_accepted,
            "lookup_acceptance_rate": l_accepted / l_drafted if l_drafted else None,
            "lookup_declined": record.get("lookup_declined", 0),
            "tokens_per_verify": (accepted + l_accepted + verifies) / verifies if verifies else None,
            "draft_seconds": record.get("draft_seconds", 0.0),
            "verify_seconds": record.get("verify_seconds", 0.0),
            "mean_draft_exit_layer": sum(exits) / len(exits) if exits else None,
            "verify_kernel": record.get("verify_kernel"),
            "verify_row_costs": record.get("verify_row_costs"),
            "draft_schedule": record.get("draft_schedule"),
            "draft_tokens": record.get("draft_tokens"),
            "max_draft_tokens": record.get("max_draft_tokens"),
            "draft_path": record.get("draft_path"),
            "draft_vocab": record.get("draft_vocab"),
            "draft_vocab_call_ids": record.get("draft_vocab_call_ids"),
            "prompt_lookup_rule": record.get("prompt_lookup_rule"),
            "backbone_step_seconds": step,
            "draft_cost_steps": steps(exit_draft_seconds, passes),
            "verify_cost_steps": steps(record.get("verify_seconds", 0.0), verifies),
            "by_source": {
                "exit_path": {
                    "rounds": rounds, "drafted": drafted, "accepted": accepted,
                    "acceptance_rate": accepted / drafted if drafted else None,
                    "tokens_per_verify": (accepted + rounds) / rounds if rounds else None,
                    "draft_cost_steps": steps(exit_draft_seconds, passes),
                    "verify_cost_steps": steps(record.get("exit_verify_seconds", 0.0), rounds),
                },
                "prompt_lookup": {
                    "rounds": l_rounds, "drafted": l_drafted, "accepted": l_accepted,
                    "acceptance_rate": l_accepted / l_drafted if l_drafted else None,
                    "tokens_per_verify": (l_accepted + l_rounds) / l_rounds if l_rounds else None,
                    "verify_cost_steps": steps(record.get("lookup_verify_seconds", 0.0), l_rounds),
                },
            },
        }
