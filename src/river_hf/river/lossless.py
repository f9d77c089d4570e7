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
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from transformers import StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator, PromptLookupCandidateGenerator

from ..compat import eos_token_ids
from ..errors import RiverError
from ..quant.dense import PrepackedLinear, onednn_available
from .arch import decoder_stack
from .config import DRAFT_PATHS, DRAFT_SCHEDULES, PROMPT_LOOKUP_RULES, VERIFY_KERNELS
from .draft_vocab import draft_head_for
from .layer import BACKBONE_ONLY, EXIT_ONLY, ROUTE

__all__ = ["ExitPathDrafter", "FirstStop", "LookupGate", "lossless_call", "DRAFT_PATHS", "DRAFT_SCHEDULES",
           "PROMPT_LOOKUP_RULES", "VERIFY_KERNELS", "verify_mode", "backbone_step_seconds"]


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
        schedule: one of :data:`DRAFT_SCHEDULES`.
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

    Raises:
        RiverError: ``draft_tokens`` < 1, ``max_draft_tokens`` < ``draft_tokens``, an unknown
            ``schedule``, ``draft_path`` or ``prompt_lookup_rule``.
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict = {}

    def __init__(self, model, generation_config, logits_processor, draft_tokens: int = 4,
                 schedule: str = "heuristic", record: dict | None = None, prompt_lookup_tokens: int = 0,
                 max_draft_tokens: int | None = None, prompt_lookup_rule: str = "always", draft_path: str = "route",
                 draft_rules=None, draft_head=None):
        if not isinstance(draft_tokens, int) or draft_tokens < 1:
            raise RiverError(f"draft_tokens must be an integer >= 1, got {draft_tokens!r}")
        if schedule not in DRAFT_SCHEDULES:
            raise RiverError(f"draft_schedule must be one of {', '.join(DRAFT_SCHEDULES)}, got {schedule!r}")
        self.model = model
        self.logits_processor = logits_processor
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.eos = eos_token_ids(generation_config)
        self.num_draft_tokens = draft_tokens
        self.max_draft_tokens = max_draft_tokens if max_draft_tokens is not None else 1 << 30
        if self.max_draft_tokens < draft_tokens:
            raise RiverError(f"max_draft_tokens ({max_draft_tokens}) must be >= draft_tokens ({draft_tokens})")
        self.schedule = schedule
        if draft_path not in DRAFT_PATHS:
            raise RiverError(f"draft_path must be one of {', '.join(DRAFT_PATHS)}, got {draft_path!r}")
        self.draft_mode = EXIT_ONLY if draft_path == "exit" else ROUTE
        self.draft_rules = draft_rules
        self.draft_head = draft_head
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
        token is not yet in it); the drafts are fed one by one through the exit path and the cache
        is cropped back to ``cur_len - 1`` before returning.

        Returns:
            ``(candidate_ids LongTensor [1, cur_len + n], scores float32 [1, n, vocab] or None)``,
            ``n`` <= k drafts; drafting stops early at an EOS draft or the length limit.
        """
        start = time.perf_counter()
        self._round_start = start
        self._drafted_now = 0
        if is_first_iteration:
            self._verify_start = time.perf_counter()
            return input_ids, None
        cur_len = input_ids.shape[1]
        k = min(int(self.num_draft_tokens), self.max_length - cur_len - 1)
        if k < 1:
            self._verify_start = time.perf_counter()
            return input_ids, None
        self._lookup_round = False
        if self.lookup is not None:
            found, _ = self.lookup.get_candidates(input_ids)
            if found.shape[1] > cur_len and self.gate.use():
                self._lookup_round = True
                self._drafted_now = found.shape[1] - cur_len
                self.record["lookup_drafted"] += self._drafted_now
                self._verify_start = time.perf_counter()
                self.record["draft_seconds"] += self._verify_start - start
                self.record["lookup_draft_seconds"] += self._verify_start - start
                return found, None  # no draft distribution: transformers' loop then samples from p and matches
            if found.shape[1] > cur_len:
                self.record["lookup_declined"] += 1
        cache = model_kwargs["cache"]
        position_ids = model_kwargs.get("position_ids")
        position = (position_ids[:, -1:] if position_ids is not None
                    else torch.full((1, 1), cur_len - 1, dtype=torch.long, device=input_ids.device))
        mask = model_kwargs.get("attention_mask")
        sequence, token = input_ids, input_ids[:, -1:]
        scores = []
        router = self.model.river
        stack = decoder_stack(self.model)[0] if self.draft_head is not None else None
        if self.call_vocab is not None:
            self.call_vocab.add(input_ids)
        with router.override(mode=self.draft_mode, rules=self.draft_rules), torch.no_grad():
            for j in range(k):
                step_mask = None if mask is None else torch.cat([mask, mask.new_ones((1, j))], dim=-1)
                if stack is None:
                    out = self.model(input_ids=token, attention_mask=step_mask, position_ids=position + j,
                                     cache=cache, use_cache=True, logits_to_keep=1)
                    logits = out.logits[:, -1, :].to(torch.float32)
                else:  # FR-Spec: the decoder stack, then the frequent-vocabulary head on the last hidden state
                    hidden = stack(input_ids=token, attention_mask=step_mask, position_ids=position + j,
                                   cache=cache, use_cache=True).last_hidden_state
                    logits = self.draft_head(hidden[:, -1:, :], self.call_vocab)[:, -1, :]
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
        drafted = len(scores)
        if self.call_vocab is not None:
            self.record["draft_vocab_call_ids"] = int(self.call_vocab.ids.numel())
        cache.crop(-drafted)  # the drafts' K/V; the verify pass writes the backbone's in their place
        self._drafted_now = drafted
        self.record["drafted"] += drafted
        self.record["draft_passes"] += drafted
        now = time.perf_counter()
        self.record["draft_seconds"] += now - start
        self._verify_start = now
        return sequence, torch.stack(scores, dim=1)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        """Count the round and adapt k (transformers' "heuristic" schedule, or none)."""
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
        if self.schedule == "heuristic":
            if num_matches == self._drafted_now:
                self.num_draft_tokens = min(self.num_draft_tokens + 2, self.max_draft_tokens)
            else:
                self.num_draft_tokens = max(1, self.num_draft_tokens - 1)

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
        see :func:`verify_mode`), the draft settings (``draft_path``, ``draft_vocab``: ids of the
        frequent set, ``draft_vocab_call_ids``: ids of the call's own tokens scored beside it,
        ``prompt_lookup_rule``), and the costs in backbone decode steps: ``backbone_step_seconds``
        (one one-token backbone pass of this model, :func:`backbone_step_seconds`),
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


_PACK_LOCK = threading.Lock()
PACK_MEMORY_SHARE = 0.5  # the packed copy may take at most this share of the memory available when it is built
#: rows at which ``auto`` times prompt passes (a prompt of a few sentences or a short function) ...
PROMPT_TIMED_ROWS = 128
#: ... and the most rows a prompt pass reroutes to the packed copy when oneDNN won there
PROMPT_MAX_ROWS = 1 << 20


def available_memory_bytes() -> int | None:
    """Memory the kernel says is available now (``MemAvailable`` of ``/proc/meminfo``, bytes), or
    None where it cannot be read (then River does not pack)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _representative_shape(linears, head) -> tuple[int, int]:
    """``(in_features, out_features)`` of the backbone Linear shape that holds the most weight bytes
    in total (an MLP projection in every model here), the LM head left out: timing it costs a few
    copies of one layer's product, not of a 0.5-3.7 GB head."""
    totals: dict[tuple[int, int], int] = {}
    for m in linears:
        if m is head:
            continue
        shape = (m.in_features, m.out_features)
        totals[shape] = totals.get(shape, 0) + m.weight.numel()
    if not totals:
        return head.in_features, head.out_features
    return max(totals, key=totals.get)


def verify_mode(model, choice: str, rows: int):
    """The ``TorchFunctionMode`` the verify passes of ``model`` run in (or None: plain ``F.linear``)
    and a dict saying why (``model._river_verify_linear[1]``, reported in ``river_stats["lossless"]
    ["verify_kernel"]``).

    ``choice`` is ``RiverConfig.verify_kernel``; ``rows`` the most rows a verify pass runs
    (``max_draft_tokens + 1``). The decision is taken once per model (the first lossless call):

    - ``torch``, no oneDNN in this torch, or no fp32 CPU backbone Linear: no packing.
    - The packed copy (as many bytes as the fp32 backbone Linears, the LM head included) must fit:
      it is built only when it takes at most :data:`PACK_MEMORY_SHARE` of the memory available
      (``/proc/meminfo``) at that moment; otherwise plain ``F.linear`` is used and a warning says so,
      for ``onednn`` too.
    - ``auto`` first times ``F.linear`` against oneDNN on the backbone's most common Linear shape
      (an MLP projection, not the LM head) at ``min(rows, 8)`` rows and packs only when oneDNN was
      faster (``RIVER_HF_AUTOTUNE=0``: no measurement, no packing).
    - The prompt pass (prefill) is a backbone pass too: once the copy is packed, ``auto`` also times
      the two at :data:`PROMPT_TIMED_ROWS` rows, and where oneDNN wins there the mode reroutes
      calls of up to :data:`PROMPT_MAX_ROWS` rows, so the prompt is read through the packed copy
      as well (on the 2-core AMD EPYC Zen 5, 0.5B: time to first token 0.88 s on ``F.linear``,
      0.41 s for the plain model on the packed copy); ``onednn`` always does. ``info["prompt"]``
      says which. The timing goes through
      :meth:`river_hf.quant.autotune.KernelTuner.choose_mode`: cached in ``kernels.json`` with the
      exit kernels' timings, so a second process on this machine measures nothing.

    Every later call only :meth:`~river_hf.quant.dense.PrepackedLinear.refresh` es the copy: weights
    changed since they were packed (``load_state_dict``, ``param.data = ...``, a PEFT merge) are
    repacked, so a verify always computes with the model's current weights. Opt out with
    ``RiverConfig(verify_kernel="torch")``.

    Returns:
        ``(mode or None, info)``; ``info`` has ``kernel`` (``onednn-prepacked`` or ``torch``),
        ``why``, ``packed_bytes`` (memory the copy adds, bytes), ``timing_us`` (the measurement, or
        None), ``shape`` (the timed ``in x out``), ``max_rows`` (the verify rows), ``prompt`` (the
        kernel of prompt passes, ``onednn-prepacked`` or ``torch``), ``prompt_timing_us`` (its
        measurement at :data:`PROMPT_TIMED_ROWS` rows, or None) and ``repacked`` (weights repacked
        by this call's refresh).
    """
    info = {"kernel": "torch", "why": "", "packed_bytes": 0, "timing_us": None, "shape": None,
            "max_rows": rows, "prompt": "torch", "prompt_timing_us": None, "repacked": 0}
    if choice == "torch":
        return None, {**info, "why": "verify_kernel='torch'"}
    if not onednn_available():
        return None, {**info, "why": "this torch build has no oneDNN"}
    with _PACK_LOCK:
        cached = model.__dict__.get("_river_verify_linear")
        if cached is None:
            cached = _decide_verify_kernel(model, choice, rows, dict(info))
            model._river_verify_linear = cached
        mode, decided = cached
        info = dict(decided)
        if mode:
            info["repacked"] = mode.refresh()
            info["packed_bytes"] = mode.packed_bytes
        return mode or None, info


def _decide_verify_kernel(model, choice: str, rows: int, info: dict):
    import warnings

    from ..quant.autotune import LinearSpec, default_tuner, last_level_cache_bytes  # default_tuner(): None when RIVER_HF_AUTOTUNE=0

    head = model.get_output_embeddings()
    head = getattr(head, "backbone", head)
    linears = [m for m in model.river_backbone_modules() if isinstance(m, torch.nn.Linear)
               and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    if not linears:
        return False, {**info, "why": "no fp32 CPU backbone Linear"}
    need = sum(m.weight.numel() * 4 for m in linears)
    available = available_memory_bytes()
    if available is None or need > PACK_MEMORY_SHARE * available:
        have = "unknown" if available is None else f"{available / 1e9:.1f} GB"
        why = (f"a packed copy of the backbone Linears needs {need / 1e9:.2f} GB, more than "
               f"{PACK_MEMORY_SHARE:.0%} of the memory available ({have}): verify passes use F.linear")
        if choice == "onednn":
            warnings.warn(f"River lossless verify_kernel='onednn': {why}", UserWarning, stacklevel=4)
        return False, {**info, "why": why}
    if choice == "auto":
        tuner = default_tuner()
        if tuner is None:
            return False, {**info, "why": "RIVER_HF_AUTOTUNE=0: not measured, not packed"}
        k_in, k_out = _representative_shape(linears, head)
        stream = min(2 * last_level_cache_bytes(), int(0.1 * available))

        def faster(timed_rows: int) -> tuple[str, dict]:  # F.linear or oneDNN at that many rows (cached)
            return tuner.choose_mode(LinearSpec(k_in, k_out, False), timed_rows, ("torch", "onednn"),
                                     lambda: PrepackedLinear.measure(k_in, k_out, timed_rows, stream_bytes=stream))

        best, timing = faster(max(2, min(rows, 8)))
        info.update(timing_us=timing, shape=f"{k_in}x{k_out}")
        if best != "onednn":
            return False, {**info, "why": "F.linear measured faster than prepacked oneDNN"}
        info["why"] = "prepacked oneDNN measured faster than F.linear"
        best, info["prompt_timing_us"] = faster(PROMPT_TIMED_ROWS)
        prompt = best == "onednn"
    else:
        info["why"] = "verify_kernel='onednn'"
        prompt = True
    mode = PrepackedLinear(linears, max_rows=PROMPT_MAX_ROWS if prompt else max(2, rows))
    return mode, {**info, "kernel": "onednn-prepacked", "packed_bytes": mode.packed_bytes,
                  "prompt": "onednn-prepacked" if prompt else "torch"}


def backbone_step_seconds(model, repeats: int = 3) -> float:
    """Seconds of one one-token decode pass of ``model``'s backbone (the unit of the lossless
    costs in ``river_stats["lossless"]``): the median of ``repeats`` passes on a fresh cache after
    one untimed pass, in ``backbone`` mode, plain kernels. Measured on the first lossless call of a
    model and kept (``_river_backbone_step``); about ``repeats + 1`` decode steps once."""
    cached = model.__dict__.get("_river_backbone_step")
    if cached is not None:
        return cached
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    times = []
    # its own recording: these passes are not the call's, so they stay out of its river_stats
    # (forward passes, weight bytes per token, GB/s)
    with model.river.recording(), model.river.override(mode=BACKBONE_ONLY), torch.no_grad():
        cache = DynamicCache(config=model.config)
        for i in range(repeats + 1):
            start = time.perf_counter()
            model(input_ids=ids, position_ids=torch.full((1, 1), i, dtype=torch.long, device=device), cache=cache,
                  use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - start)
    value = sorted(times[1:])[len(times[1:]) // 2]
    model._river_backbone_step = value
    return value


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
    one-token calls are fast already). The draft settings (:func:`draft_settings`) are prepared on
    entry, before the call's timer starts; after the call the record gets the model's backbone step
    time (:func:`backbone_step_seconds`, measured once per model)."""
    config = model.river_config
    call.lossless = True
    call.verify_linear, call.record["verify_kernel"] = verify_mode(model, config.verify_kernel,
                                                                   config.max_draft_tokens + 1)
    call.draft_settings = draft_settings(model)
    yield call
    call.record["backbone_step_seconds"] = backbone_step_seconds(model)
