"""The running batch of ``river-hf serve`` in route mode: requests join it after their prefill and
leave it when finished, between decode steps (continuous batching at the level of whole steps).

Each decode step is one forward pass of the River model over every running request (one new token
per row, left-padded rows in one ``DynamicCache``); River's router takes each row's exit decision
on that row's own state transition similarity (per-row exit, :mod:`river_hf.river.rows`), so a
row's tokens are those it gets alone, up to the summation order of batched products. Between steps
the requests that arrived are prefilled together (left-padded, one pass) and their rows appended
to the batch: both caches are padded on the left to the longer one and concatenated along the
batch dimension (:func:`join_rows`); finished rows are dropped with the cache's own
``batch_select_indices`` and the columns that became padding in every row are cut
(:func:`keep_rows`). KV share is what makes this possible: a row that left the backbone still wrote
its layer's keys and values, so every row's slot is complete whatever path it took.

Only transformers' public API is used: the model's ``forward`` with ``attention_mask``,
``position_ids`` (as ``generate`` computes them: ``cumsum(mask) - 1``), ``cache`` and
``logits_to_keep``; ``DynamicCache`` layers' ``keys`` / ``values``; and its logits warpers for
sampled requests. Each pass runs inside one :class:`~river_hf.river.call.GenerateCall` per running
batch, so the backbone layers get the kernel a ``generate`` call would give them
(:func:`~river_hf.river.verify_kernel.backbone_mode`). :func:`unsupported` says when a model
cannot run this way (the server then batches whole ``generate`` calls instead,
:class:`~river_hf.serve.scheduler.Scheduler`).
"""

from __future__ import annotations

import dataclasses
import random
import time

import torch
import torch.nn.functional as F
from transformers import (DynamicCache, GenerationConfig, LogitsProcessorList, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)
from transformers.cache_utils import DynamicLayer

from ..river.call import GenerateCall
from ..river.layer import ROUTE
from ..river.rows import position_ids
from ..river.verify_kernel import backbone_mode

__all__ = ["RunningRow", "RunningBatch", "unsupported", "join_rows", "keep_rows", "warpers_for",
           "UNSUPPORTED_GENERATION_SETTINGS"]

#: Generation settings the step loop does not apply; a model whose ``generation_config`` sets one
#: of them away from transformers' default is served by whole ``generate`` calls instead.
UNSUPPORTED_GENERATION_SETTINGS = (
    "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens", "sequence_bias", "suppress_tokens",
    "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "encoder_repetition_penalty",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty", "renormalize_logits",
    "watermarking_config", "guidance_scale", "top_h",
)


def unsupported(model) -> str | None:
    """Why ``model`` cannot be served by :class:`RunningBatch`, or None when it can: it must be in
    route mode with a strategy that exits per row (River's exit layers and the baselines marked
    ``per_row``), its ``DynamicCache`` slots must be plain ``DynamicLayer`` (no sliding window,
    whose slots drop old positions), and its ``generation_config`` may set no
    :data:`UNSUPPORTED_GENERATION_SETTINGS`."""
    router = model.river
    if router.mode != ROUTE:
        return f"the model runs in {router.mode!r} mode (the step loop runs route mode)"
    if not router.strategy.per_row:
        return f"strategy {router.strategy.name!r} takes one exit decision per batch"
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return "the model has sliding-window cache layers"
    gen, default = model.generation_config, GenerationConfig()
    for name in UNSUPPORTED_GENERATION_SETTINGS:
        if getattr(gen, name, None) != getattr(default, name, None):
            return f"its generation_config sets {name}"
    return None


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``x`` with ``width`` zeros prepended along ``dim`` (a negative dim counted from the end)."""
    if width == 0:
        return x
    pad = [0, 0] * (x.dim() - dim % x.dim() - 1) + [width, 0]
    return F.pad(x, pad)


def join_rows(cache: DynamicCache, mask: torch.Tensor, new_cache: DynamicCache, new_mask: torch.Tensor):
    """Append the rows of ``new_cache`` to ``cache`` (in place) and return the joined 2-D mask.

    Args:
        cache, mask: the running rows' cache (every slot a filled ``DynamicLayer``, keys and values
            ``[B, heads, T, head_dim]``) and padding mask ``[B, T]`` (long, 1 = real token).
        new_cache, new_mask: the same for the rows that join (``[B2, heads, T2, head_dim]``,
            ``[B2, T2]``), as their prefill left them.

    Returns:
        The mask ``[B + B2, max(T, T2)]``: the shorter side padded on the left with zeros, as its
        cache slots are (padding is never attended to, so each row's attention is unchanged).
    """
    width = max(mask.shape[1], new_mask.shape[1])
    for layer, new in zip(cache.layers, new_cache.layers):
        layer.keys = torch.cat([_pad_left(layer.keys, width - mask.shape[1], -2),
                                _pad_left(new.keys, width - new_mask.shape[1], -2)])
        layer.values = torch.cat([_pad_left(layer.values, width - mask.shape[1], -2),
                                  _pad_left(new.values, width - new_mask.shape[1], -2)])
    return torch.cat([_pad_left(mask, width - mask.shape[1], -1), _pad_left(new_mask, width - new_mask.shape[1], -1)])


def keep_rows(cache: DynamicCache, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Keep only ``rows`` of ``cache`` (in place, the cache's ``batch_select_indices``) and cut the
    leading columns that are padding in every kept row; returns the kept rows' mask.

    Args:
        cache: the running rows' cache. mask: its padding mask ``[B, T]``. rows: the rows to keep
            (ascending indices, at least one).
    """
    index = torch.tensor(rows, dtype=torch.long, device=mask.device)
    if len(rows) != mask.shape[0]:
        cache.batch_select_indices(index)
        mask = mask.index_select(0, index)
    first = int(mask.any(0).nonzero()[0])
    if first:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        mask = mask[:, first:]
    return mask


@dataclasses.dataclass(eq=False)
class RunningRow:
    """One request in the running batch.

    Attributes:
        job: the request (a :class:`~river_hf.serve.scheduler.Job`).
        ids: its new tokens so far.
        warpers: its logits warpers (empty: greedy).
        generator: its random generator (sampled requests; seeded by the request's ``seed``), or None.
        started: ``time.perf_counter()`` when its prefill began (s). prefill_end: when it ended (s).
        exits: its exit layer in each decode step (0..L; L: it stayed on the backbone).
        batch_sizes: rows in the batch at each of its decode steps.
    """

    job: object
    ids: list[int]
    warpers: LogitsProcessorList
    generator: torch.Generator | None
    started: float
    prefill_end: float = 0.0
    exits: list[int] = dataclasses.field(default_factory=list)
    batch_sizes: list[int] = dataclasses.field(default_factory=list)

    def stats(self, num_layers: int, queued_seconds: float) -> dict:
        """The ``river`` key of its completion (the names of
        :func:`~river_hf.serve.scheduler.response_stats`): ``batch_size`` is the mean number of rows
        over its decode steps, ``decode_tokens_per_s`` its own tokens per second after its prefill."""
        end = time.perf_counter()
        decode = end - self.prefill_end
        n = len(self.ids)
        exits = self.exits
        return {
            "mode": "route", "num_layers": num_layers, "new_tokens": n, "seconds": end - self.started,
            "prefill_seconds": self.prefill_end - self.started,
            "decode_tokens_per_s": (n - 1) / decode if n > 1 and decode > 0 else None,
            "tokens_per_s": n / (end - self.started) if end > self.started else None,
            "mean_exit_layer": sum(exits) / len(exits) if exits else None,
            "exit_fraction": sum(e < num_layers for e in exits) / len(exits) if exits else None,
            "queued_seconds": max(queued_seconds, 0.0),
            "batch_size": sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 1,
            "batching": "step",
        }


class RunningBatch:
    """The rows in flight, their one KV cache and padding mask.

    Args:
        model: a River model in route mode (:func:`unsupported` returned None).
        pad_id: the token id fed for padding positions (never attended to).

    Use: :meth:`admit` new requests (a prefill pass; each row gets its first token), then
    :meth:`step` (one decode pass; each row gets one token) while :attr:`rows` is not empty, and
    :meth:`retire` the finished rows after each (the caller delivers their answers).
    """

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id
        self.num_layers = model.river.num_layers
        self.rows: list[RunningRow] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.last: torch.Tensor | None = None  # [B, 1] the token each row feeds next
        self.call = GenerateCall()  # what the model's hooks read: the backbone layers' kernel

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache):
        """One forward pass; returns the last position's logits ``[B, vocab]`` (fp32) and each
        row's exit layer."""
        router = self.model.river
        with torch.no_grad(), router.recording() as log, router.calling(self.call):
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids(mask, input_ids.shape[1]),
                             cache=cache, use_cache=True, logits_to_keep=1)
        exits = log[-1][4] if log else (self.num_layers,) * input_ids.shape[0]
        return out.logits[:, -1, :].float(), exits

    def admit(self, rows: list[RunningRow]) -> None:
        """Prefill ``rows`` (their prompts left-padded, one pass), pick each one's first token and
        append them to the batch."""
        device = self.model.device
        prompts = [list(r.job.settings.prompt_ids) for r in rows]
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        cache = DynamicCache(config=self.model.config.get_text_config(decoder=True))
        self.model.river_refresh_exit_layers()
        self.call.backbone_linear, self.call.backbone_kernel = backbone_mode(self.model,
                                                                             self.model.river_config.backbone_kernel)
        logits, _ = self._forward(ids, mask, cache)
        first = self._choose(rows, logits)
        now = time.perf_counter()
        for row, token in zip(rows, first):
            row.prefill_end = now
            row.ids.append(token)
        new_last = torch.tensor(first, device=device).unsqueeze(1)
        if self.cache is None:
            self.cache, self.mask, self.last = cache, mask, new_last
        else:
            self.mask = join_rows(self.cache, self.mask, cache, mask)
            self.last = torch.cat([self.last, new_last])
        self.rows.extend(rows)

    def step(self) -> list[int]:
        """One decode pass over every row; returns each row's new token (in :attr:`rows` order)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        logits, exits = self._forward(self.last, self.mask, self.cache)
        tokens = self._choose(self.rows, logits)
        for row, token, exit_layer in zip(self.rows, tokens, exits):
            row.ids.append(token)
            row.exits.append(int(exit_layer))
            row.batch_sizes.append(len(self.rows))
        self.last = torch.tensor(tokens, device=self.mask.device).unsqueeze(1)
        return tokens

    def retire(self, keep: list[bool]) -> None:
        """Drop the rows whose ``keep`` entry is False (their answers are the caller's); an empty
        batch drops its cache."""
        rows = [i for i, k in enumerate(keep) if k]
        if not rows:
            self.rows, self.cache, self.mask, self.last = [], None, None, None
            return
        self.mask = keep_rows(self.cache, self.mask, rows)
        self.last = self.last[rows]
        self.rows = [self.rows[i] for i in rows]

    def _choose(self, rows: list[RunningRow], logits: torch.Tensor) -> list[int]:
        """Each row's next token from its logits row: argmax when greedy, else its warpers and one
        draw from its own generator (so a seeded request's tokens do not depend on its neighbours)."""
        out = []
        greedy = logits.argmax(-1).tolist()
        for i, row in enumerate(rows):
            if not row.warpers:
                out.append(greedy[i])
                continue
            history = torch.tensor([list(row.job.settings.prompt_ids) + row.ids], device=logits.device)
            scores = row.warpers(history, logits[i:i + 1])
            if row.generator is None:
                out.append(int(scores.argmax(-1)))
                continue
            probs = torch.softmax(scores, dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=row.generator)))
        return out


def warpers_for(settings, generation_config: GenerationConfig,
                device="cpu") -> tuple[LogitsProcessorList, torch.Generator | None]:
    """The logits processors a request's tokens go through, as ``generate`` would build them from
    the request's settings over the model's ``generation_config`` (transformers' own warpers:
    repetition penalty, then temperature, top-k, top-p, min-p when sampling), and its generator
    (None when greedy; on ``device``, seeded by ``settings.seed``, else from Python's ``random``)."""
    procs = LogitsProcessorList()
    penalty = generation_config.repetition_penalty
    if penalty is not None and penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty))
    if not settings.do_sample:
        return procs, None
    temperature = settings.temperature if settings.temperature is not None else generation_config.temperature
    top_p = settings.top_p if settings.top_p is not None else generation_config.top_p
    if temperature is not None and temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if generation_config.top_k:
        procs.append(TopKLogitsWarper(generation_config.top_k))
    if top_p is not None and top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    if generation_config.min_p:
        procs.append(MinPLogitsWarper(generation_config.min_p))
    generator = torch.Generator(device=device)
    generator.manual_seed(settings.seed if settings.seed is not None else random.getrandbits(63))
    return procs, generator
