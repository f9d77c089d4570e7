"""The inference side of ``river-hf serve``: one thread owns the model and runs the queued requests,
one at a time in arrival order (FIFO) or batched, up to ``max_batch_size`` rows:

- route mode (River): a running batch (:mod:`.batch`): requests join it between decode steps
  (their prompts prefilled together) and leave it as soon as they finish, so a request never
  waits for another one's answer to end; each row exits at its own layer.
- otherwise (lossless mode, a strategy that takes one decision per batch, a model with
  sliding-window cache layers): the requests waiting when the thread becomes free run together as
  one ``model.generate`` call (left-padded), grouped only when their sampling settings and stop
  strings are equal.

Only transformers' public generation API is used: ``generate`` with an ``attention_mask``, a
``BaseStreamer`` (:class:`RowStreamer`, which routes each row's new tokens to its request) and a
``StoppingCriteria`` (:class:`RowStops`: a row is finished at its own ``max_tokens`` or when its
client left). Each request's answer is its row cut at its own ``max_tokens``, first EOS and first
stop string (:meth:`Scheduler.cut`).

Lossless mode batches too: a call of several requests runs River's batched lossless loop
(:mod:`river_hf.river.lossless_batch`), which takes no stopping criteria and no stop strings (they
read the token history; it would fall back to the backbone), so such a call runs to the largest
``max_tokens`` of its requests and stops a row only at EOS; each answer is then cut as above, which
gives the tokens the request alone would have got (greedy: the plain model's).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Callable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .batch import RunningBatch, RunningRow, unsupported, warpers_for
from .requests import Settings

__all__ = ["Job", "Result", "Cancelled", "RowStreamer", "RowStops", "Scheduler", "response_stats"]


@dataclasses.dataclass(eq=False)
class Job:
    """One queued request.

    Attributes:
        settings: the checked request (:class:`~river_hf.serve.requests.Settings`).
        deliver: called from the inference thread with each event (must be thread-safe):
            ``("tokens", ids)`` (a stream's new token ids, in order), then one of
            ``("done", Result)`` or ``("error", message)``.
        received: ``time.perf_counter()`` when the request arrived (s).
        cancelled: set when the client has gone; its row stops at the next step (the whole call
            when every row's client has gone).
    """

    settings: Settings
    deliver: Callable[[tuple], None]
    received: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def __post_init__(self):
        self.group = self.settings.group()


@dataclasses.dataclass
class Result:
    """A finished request: ``ids`` its answer's tokens (the EOS that ended it included),
    ``finish_reason`` ``"stop"`` (EOS, a stop string, or the model's own stop) or ``"length"``
    (``max_tokens`` reached), ``prompt_tokens``, ``river`` (:func:`response_stats`)."""

    ids: list[int]
    finish_reason: str
    prompt_tokens: int
    river: dict


class Cancelled(Exception):
    """Raised inside ``generate`` (by :class:`RowStreamer`) when every request of the call has gone."""


def response_stats(stats: dict, queued_seconds: float, *, batch_size: int = 1, new_tokens: int | None = None,
                   batching: str = "call") -> dict:
    """The ``river`` key of a completion: the parts of ``model.river_stats`` (see
    :func:`river_hf.river.stats.summarize`) that describe one served call.

    Returns ``mode`` (``route``, ``lossless``, or ``backbone``), ``strategy``, ``num_layers``,
    ``new_tokens`` (this request's tokens when given, else the call's), ``seconds`` (the generate
    call, s), ``prefill_seconds`` (its TTFT, s), ``decode_tokens_per_s`` and ``tokens_per_s``
    (tokens/s of the whole call: all rows of a batch), ``queued_seconds`` (s the request waited
    before its call started), ``batch_size`` (requests in that call), ``batching`` (``"call"``:
    whole ``generate`` calls; the running batch writes ``"step"``, :meth:`RunningRow.stats
    <river_hf.serve.batch.RunningRow.stats>`), and in route mode
    ``mean_exit_layer`` (0..L; L: no exit) and ``exit_fraction``, in lossless mode
    ``acceptance_rate``, ``tokens_per_verify`` and ``mean_draft_exit_layer``. A figure that could
    not be measured (a call of one token has no decode phase) is None.
    """
    out = {k: stats.get(k) for k in ("mode", "strategy", "num_layers", "new_tokens", "seconds", "prefill_seconds",
                                     "decode_tokens_per_s", "tokens_per_s")}
    lossless = stats.get("lossless")
    if lossless is not None:
        out.update({k: lossless.get(k) for k in ("acceptance_rate", "tokens_per_verify", "mean_draft_exit_layer")})
    else:
        out.update({k: stats.get(k) for k in ("mean_exit_layer", "exit_fraction")})
    if new_tokens is not None:
        out["new_tokens"] = new_tokens
    out["queued_seconds"] = max(queued_seconds, 0.0)
    out["batch_size"] = batch_size
    out["batching"] = batching
    return out


class RowStreamer(BaseStreamer):
    """A ``generate`` streamer for a batch of requests: the first put (the prompts) is skipped;
    each later put is split by row: ``[B]`` (one token per row, ``generate``'s steps), ``[1, n]``
    (a lossless round of one request) or ``[B, n]`` (columns of River's batched lossless loop,
    final for every row). Each streaming request gets its row's tokens up to its ``max_tokens``
    and its first EOS (padding after a finished row is never sent).

    Args:
        jobs: the call's requests, one per row.
        eos_ids: the tokens that end an answer.
        hold_rounds: hold each put until the next one (lossless mode with one request: River cuts
            the last round of transformers' assisted decoding where a stop fired, so its tokens are
            sent only with the final answer; the batched loop's columns are final and need no hold).

    Raises:
        Cancelled: from ``put``, when every request of the call has been cancelled.
    """

    def __init__(self, jobs: list[Job], eos_ids: set[int], *, hold_rounds: bool = False):
        self.jobs, self.eos_ids, self.hold = jobs, eos_ids, hold_rounds
        self.counts = [0] * len(jobs)
        self.done = [False] * len(jobs)
        self.pending: list[list[int]] = [[] for _ in jobs]
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if all(j.cancelled.is_set() for j in self.jobs):
            raise Cancelled()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for i, (job, ids) in enumerate(zip(self.jobs, value.reshape(len(self.jobs), -1).tolist())):
            if self.done[i]:
                continue
            ids = ids[: job.settings.max_tokens - self.counts[i]]
            for k, t in enumerate(ids):
                if t in self.eos_ids:
                    ids = ids[: k + 1]
                    self.done[i] = True
                    break
            self.counts[i] += len(ids)
            self.done[i] = self.done[i] or self.counts[i] >= job.settings.max_tokens
            if self.hold:
                ids, self.pending[i] = self.pending[i], ids
            if job.settings.stream and ids and not job.cancelled.is_set():
                job.deliver(("tokens", ids))

    def end(self) -> None:
        """Nothing: held tokens go out with the final answer (:class:`Result`)."""


class RowStops(StoppingCriteria):
    """Row ``i`` of the batch is finished once it has ``jobs[i].settings.max_tokens`` new tokens or
    its client has gone (``generate`` then pads it and stops when every row is finished).

    Args:
        jobs: the call's requests, one per row. prompt_length: the padded prompt length (tokens).
    """

    def __init__(self, jobs: list[Job], prompt_length: int):
        self.jobs, self.prompt_length = jobs, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids.shape[1] - self.prompt_length
        done = [j.cancelled.is_set() or new >= j.settings.max_tokens for j in self.jobs]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class Scheduler:
    """The inference thread of a served model.

    Args:
        model: the River model (``generate``, ``river_stats``).
        tokenizer: its tokenizer (stop strings, decoding).
        max_batch_size: most requests in flight at once (1: FIFO, one at a time).
        lossless: the model runs lossless mode: a call of one request streams its rounds one
            round late (``hold_rounds``, see :class:`RowStreamer`); a call of several is given no
            :class:`RowStops` and no stop strings (see the module's docstring).

    Requests are taken in arrival order. With the running batch (:attr:`batching` ``"step"``) the
    waiting requests join it between decode steps while it has fewer than ``max_batch_size`` rows.
    Otherwise (:attr:`batching` ``"call"``, :attr:`step_refusal` says why) the first waiting request
    starts the next ``generate`` call, and the later waiting requests of its group join it, up to
    ``max_batch_size``; the others wait for the next call, first in line.
    """

    def __init__(self, model, tokenizer, *, max_batch_size: int = 8, lossless: bool = False):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size, self.lossless = max_batch_size, lossless
        gen = model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        pad = gen.pad_token_id if gen.pad_token_id is not None else tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._running: list[Job] = []
        self.calls = 0  # generate calls (or running-batch passes) made (for tests and logs)
        #: why requests do not join a running batch between steps (None: they do)
        self.step_refusal = ("one request at a time" if max_batch_size == 1 else
                             "lossless mode batches whole calls" if lossless else unsupported(model))
        #: "step": route mode's running batch; "call": whole generate calls; "fifo": one at a time
        self.batching = "fifo" if max_batch_size == 1 else "step" if self.step_refusal is None else "call"

    def start(self) -> None:
        """Start the inference thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="river-serve-inference", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (any thread)."""
        self._queue.put(job)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the call in flight, answer the waiting requests with an error, end the thread."""
        for job in list(self._running):
            job.cancelled.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _drain(self, waiting: collections.deque, block: bool) -> bool:
        """Move the queued requests into ``waiting`` (first waiting for one when ``block``);
        True when the server is stopping."""
        if block:
            job = self._queue.get()
            if job is None:
                return True
            waiting.append(job)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return False
            if job is None:
                return True
            waiting.append(job)

    def _loop(self) -> None:
        waiting: collections.deque[Job] = collections.deque()
        if self.batching == "step":
            self._step_loop(waiting)
        else:
            while not self._drain(waiting, block=not waiting):
                batch = self._take(waiting)
                if batch:
                    self.run(batch)
        for job in waiting:
            job.deliver(("error", "the server is stopping"))

    def _step_loop(self, waiting: collections.deque) -> None:
        """Route mode's running batch: between decode steps the waiting requests join (one
        prefill pass for those that fit), finished rows leave, and each row's answer goes out as
        soon as it is finished."""
        batch = RunningBatch(self.model, self.pad_id)
        gen, device = self.model.generation_config, self.model.device
        while not self._drain(waiting, block=not waiting and not batch.rows):
            live = [j for j in waiting if not j.cancelled.is_set()]
            new, rest = live[: self.max_batch_size - len(batch.rows)], live[self.max_batch_size - len(batch.rows):]
            waiting.clear()
            waiting.extend(rest)
            now = time.perf_counter()
            rows = [RunningRow(job, [], *warpers_for(job.settings, gen, device), started=now) for job in new]
            self._running = [r.job for r in batch.rows] + new
            try:
                if rows:
                    batch.admit(rows)
                elif batch.rows:
                    rows = list(batch.rows)
                    batch.step()
                else:
                    continue
                self.calls += 1
            except Exception as e:  # noqa: BLE001 - reported to each request in the batch
                message = f"generation failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                for row in batch.rows + [r for r in rows if r not in batch.rows]:
                    row.job.deliver(("error", message))
                batch = RunningBatch(self.model, self.pad_id)
                continue
            self._after_pass(batch, rows)
        for row in batch.rows:
            row.job.deliver(("error", "the server is stopping"))
        self._running = []

    def _after_pass(self, batch: RunningBatch, moved: list[RunningRow]) -> None:
        """Stream the token each row of ``moved`` just got, then answer and drop the rows that are
        finished (EOS, ``max_tokens``, a stop string) or whose client has gone."""
        keep = []
        strategy = self.model.river.strategy.name
        for row in batch.rows:
            job, settings = row.job, row.job.settings
            if row in moved and settings.stream and not job.cancelled.is_set():
                job.deliver(("tokens", row.ids[-1:]))
            if job.cancelled.is_set():
                keep.append(False)
                continue
            done = (row.ids[-1] in self.eos_ids or len(row.ids) >= settings.max_tokens
                    or bool(settings.stop) and self._has_stop(row.ids, settings.stop))
            if done:
                ids, finish = self.cut(row.ids, settings)
                stats = row.stats(batch.num_layers, row.started - job.received)
                stats["strategy"] = strategy
                job.deliver(("done", Result(ids, finish, len(settings.prompt_ids), stats)))
            keep.append(not done)
        batch.retire(keep)

    def _take(self, waiting: collections.deque) -> list[Job]:
        """The next call's requests, removed from ``waiting`` (cancelled ones are dropped)."""
        live = [j for j in waiting if not j.cancelled.is_set()]
        if not live:
            waiting.clear()
            return []
        batch = [live[0]]
        for job in live[1:]:
            if len(batch) >= self.max_batch_size:
                break
            if job.group == batch[0].group:
                batch.append(job)
        chosen = set(map(id, batch))
        rest = [j for j in live if id(j) not in chosen]
        waiting.clear()
        waiting.extend(rest)
        return batch

    def run(self, jobs: list[Job]) -> None:
        """One ``generate`` call for ``jobs`` (same group) on this thread; each job gets its events."""
        settings = jobs[0].settings
        length = max(len(j.settings.prompt_ids) for j in jobs)
        rows = [[self.pad_id] * (length - len(j.settings.prompt_ids)) + list(j.settings.prompt_ids) for j in jobs]
        mask = [[0] * (length - len(j.settings.prompt_ids)) + [1] * len(j.settings.prompt_ids) for j in jobs]
        device = self.model.device
        batched_lossless = self.lossless and len(jobs) > 1  # River's batched loop: columns are final
        kwargs = {"input_ids": torch.tensor(rows, device=device), "attention_mask": torch.tensor(mask, device=device),
                  "max_new_tokens": max(j.settings.max_tokens for j in jobs), "do_sample": settings.do_sample,
                  "pad_token_id": self.pad_id,
                  "streamer": RowStreamer(jobs, self.eos_ids, hold_rounds=self.lossless and len(jobs) == 1)}
        if settings.do_sample:
            kwargs.update(temperature=settings.temperature, top_p=settings.top_p)
        if settings.stop and not batched_lossless:
            kwargs.update(stop_strings=list(settings.stop), tokenizer=self.tokenizer)
        if len(jobs) > 1 and not batched_lossless:
            kwargs["stopping_criteria"] = StoppingCriteriaList([RowStops(jobs, length)])
        self._running = jobs
        start = time.perf_counter()
        try:
            if settings.seed is not None:
                torch.manual_seed(settings.seed)
            sequences = self.model.generate(**kwargs)
            stats = dict(self.model.river_stats)  # per thread: this call's
            self.calls += 1
        except Cancelled:
            return
        except Exception as e:  # noqa: BLE001 - reported to each request (HTTP 500 / an error event)
            for job in jobs:
                job.deliver(("error", f"generation failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"))
            return
        finally:
            self._running = []
        for i, job in enumerate(jobs):
            ids, finish = self.cut(sequences[i, length:].tolist(), job.settings)
            job.deliver(("done", Result(ids, finish, len(job.settings.prompt_ids),
                                        response_stats(stats, start - job.received, batch_size=len(jobs),
                                                       new_tokens=len(ids)))))

    def cut(self, ids: list[int], settings: Settings) -> tuple[list[int], str]:
        """A row's answer: ``ids`` cut at ``settings.max_tokens``, after the first EOS and after the
        first token that completes a stop string; with its finish reason."""
        ids = ids[: settings.max_tokens]
        finish = "length" if len(ids) >= settings.max_tokens else "stop"
        for k, t in enumerate(ids):
            if t in self.eos_ids:
                return ids[: k + 1], "stop"
        if settings.stop and self._has_stop(ids, settings.stop):
            lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop string
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self._has_stop(ids[:mid], settings.stop) else (mid + 1, hi)
            return ids[:lo], "stop"
        return ids, finish

    def _has_stop(self, ids: list[int], stop: tuple[str, ...]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in stop)
