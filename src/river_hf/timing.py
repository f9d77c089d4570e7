"""The one side-by-side timer: every speed figure river-hf prints comes from here.

Rules (the project's benchmark standard):

* all configurations run in one process, on the same inputs, with the same number of new tokens;
* one untimed warm-up run of each configuration first (allocations, kernel selection, caches);
* ``repeats`` timed rounds (default 3) in alternating order (forward, reversed, forward, ...), so
  a slow drift of the machine falls evenly on every configuration;
* per configuration the median and the spread (min-max) over rounds; the speedup against the
  reference is taken *per round* (both runs of a round are neighbours in time) and reported as
  median and min-max; a speedup whose spread contains 1.0 is printed as "not resolved";
* decode speed is separated from prefill: TTFT (s, call start to the first new token) and decode
  tokens/s (tokens after the first / time from the first to the last token), measured by a
  streamer (:class:`TokenTimer`) that works for any ``generate``;
* the machine's own memory bandwidth is measured once per run (:func:`memory_bandwidth_gb_s`), and
  each configuration's achieved bandwidth (weight bytes read per decode step x decode steps/s) is
  printed as a share of it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

from transformers.generation.streamers import BaseStreamer

__all__ = ["TokenTimer", "Measurement", "memory_bandwidth_gb_s", "compare", "Comparison", "measure_generate"]


def memory_bandwidth_gb_s(nbytes: int | None = None, repeats: int = 5) -> float:
    """This machine's read bandwidth (GB/s, 1e9 bytes/s): the median over ``repeats`` of a
    read-reduce (``tensor.sum()``) over a float32 tensor of ``nbytes`` (default: 1 GiB, or 4x the
    last-level cache if larger, so it streams from memory). On a GPU, over a tensor on the GPU."""
    import torch

    from .quant import last_level_cache_bytes

    nbytes = nbytes or max(1 << 30, 4 * last_level_cache_bytes())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()
    times = []
    for _ in range(repeats):
        if device == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        if device == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


class TokenTimer(BaseStreamer):
    """A ``generate`` streamer that records when each new token arrives (batch 1).

    ``generate`` calls ``put`` once with the prompt, then with each new token (or several at once,
    in assisted generation), then ``end``. Pass ``inner`` to also stream to another streamer
    (e.g. a ``TextStreamer``). Times are ``time.perf_counter()`` seconds.

    Attributes:
        start: when the timer was made (call it right before ``generate``), or set by :meth:`reset`.
        arrivals: ``(time, tokens)`` per ``put`` after the prompt.
    """

    def __init__(self, inner=None):
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.arrivals: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        now = time.perf_counter()
        if self._prompt_seen:
            self.arrivals.append((now, int(value.numel())))
        self._prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()

    def measurement(self, weight_bytes_per_step: float | None = None) -> Measurement:
        """What was recorded, as a :class:`Measurement` (raises ValueError when no token came)."""
        if not self.arrivals:
            raise ValueError("no new token was streamed: was this timer passed as generate(streamer=...)?")
        first, last = self.arrivals[0][0], self.arrivals[-1][0]
        tokens = sum(n for _, n in self.arrivals)
        decode_tokens = tokens - self.arrivals[0][1]
        decode_s = last - first
        return Measurement(
            new_tokens=tokens, seconds=last - self.start, ttft_s=first - self.start,
            decode_tokens=decode_tokens, decode_s=decode_s, weight_bytes_per_step=weight_bytes_per_step,
            decode_steps=len(self.arrivals) - 1,
        )


@dataclasses.dataclass
class Measurement:
    """One timed run.

    Attributes:
        new_tokens: tokens generated (the first included).
        seconds: call start to last token (s).
        ttft_s: call start to first new token (s): prefill plus one step.
        decode_tokens: tokens after the first; decode_s: time from the first to the last (s).
        decode_steps: number of arrivals after the first (= decode_tokens except in assisted
            generation, where one step may bring several tokens).
        weight_bytes_per_step: mean weight bytes read per decode step (bytes), when known.
    """

    new_tokens: int
    seconds: float
    ttft_s: float
    decode_tokens: int
    decode_s: float
    decode_steps: int
    weight_bytes_per_step: float | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def bandwidth_gb_s(self) -> float | None:
        if self.weight_bytes_per_step is None or self.decode_s <= 0:
            return None
        return self.weight_bytes_per_step * self.decode_steps / self.decode_s / 1e9


def measure_generate(model, inputs: dict, **generate_kwargs) -> Measurement:
    """Run ``model.generate(**inputs, **generate_kwargs)`` under a :class:`TokenTimer` (batch 1).

    A River model's ``river_stats["weight_bytes_per_token"]`` gives the weight bytes (converted to
    per streamer step: in assisted or lossless decoding one step brings several tokens); otherwise
    pass ``weight_bytes_per_step=`` (bytes per step) among the keyword arguments.
    """
    bytes_per_step = generate_kwargs.pop("weight_bytes_per_step", None)
    timer = TokenTimer(generate_kwargs.pop("streamer", None))
    timer.reset()
    model.generate(**inputs, **generate_kwargs, streamer=timer)
    stats = getattr(model, "river_stats", None) or {}
    measured = timer.measurement(bytes_per_step)
    if bytes_per_step is None and stats.get("weight_bytes_per_token") is not None:
        # River counts bytes per generated token; a streamer step of assisted (lossless) decoding
        # brings several tokens, so per step = per token x tokens / steps
        per_token = stats["weight_bytes_per_token"]
        measured.weight_bytes_per_step = per_token * measured.decode_tokens / max(measured.decode_steps, 1)
    return measured


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


@dataclasses.dataclass
class Comparison:
    """Result of :func:`compare`: ``rows`` (one dict per configuration, see :func:`compare`),
    the reference label, the repeats and the machine's bandwidth (GB/s)."""

    rows: list[dict]
    reference: str
    repeats: int
    bandwidth_limit_gb_s: float | None

    def row(self, label: str) -> dict:
        return next(r for r in self.rows if r["label"] == label)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The comparison as aligned text lines, one per configuration."""
        limit = self.bandwidth_limit_gb_s
        head = (f"{'configuration':<22} {'decode tok/s (min-max)':>24} {'× ' + self.reference + ' (min-max)':>30} "
                f"{'TTFT s':>7} {'GB/s':>6} {'% of limit':>10}")
        lines = [head]
        for r in self.rows:
            d, sp = r["decode_tokens_per_s"], r["speedup"]
            bw = r["bandwidth_gb_s"]
            ratio = "reference" if r["label"] == self.reference else (
                f"{sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f}) {r['verdict']}")
            lines.append(
                f"{r['label']:<22} {d['median']:>8.2f} ({d['min']:.2f}-{d['max']:.2f}){'':>5} {ratio:>30} "
                f"{r['ttft_s']['median']:>7.2f} {'' if bw is None else f'{bw:6.1f}':>6} "
                f"{'' if bw is None or not limit else f'{100 * bw / limit:9.0f}%':>10}")
        if limit:
            lines.append(f"memory bandwidth of this machine (1 GiB read-reduce): {limit:.1f} GB/s; "
                         f"{self.repeats} alternating repeats after a warm-up, median (min-max)")
        return "\n".join(lines)


def compare(
    configs: dict[str, Callable[[], Measurement | list[Measurement]]],
    *,
    reference: str,
    repeats: int = 3,
    warmup: bool = True,
    bandwidth: bool = True,
    progress: bool = False,
    on_round: Callable[[int, str], None] | None = None,
) -> Comparison:
    """Time ``configs`` side by side (see the module docstring for the rules).

    Args:
        configs: label -> a function that runs one timed unit and returns its
            :class:`Measurement` (or a list of them, e.g. one per prompt: their tokens and times
            are summed).
        reference: the label the speedups are taken against.
        repeats: timed rounds (>= 1; 3 or more for a claim).
        warmup: run every configuration once, untimed, first.
        bandwidth: measure the machine's memory bandwidth once (about a second).
        progress: a tqdm bar over the runs.
        on_round: called as ``on_round(repeat, label)`` before each timed run.

    Returns:
        A :class:`Comparison`; each row has ``label``, ``decode_tokens_per_s``, ``tokens_per_s``,
        ``ttft_s`` (each ``{"median", "min", "max", "runs"}``), ``speedup`` (per-round decode
        tokens/s over the reference's, same form), ``verdict`` (``"faster"``, ``"slower"`` or
        ``"not resolved"`` when the speedup's min-max contains 1.0), ``new_tokens``,
        ``weight_bytes_per_step`` (bytes, median), ``bandwidth_gb_s`` (median).

    Raises:
        ValueError: ``reference`` is not a label, ``repeats`` < 1, or two configurations produced
            different numbers of new tokens in one round (their speeds would not compare).
    """
    from tqdm.auto import tqdm

    if reference not in configs:
        raise ValueError(f"reference {reference!r} is not one of the configurations {list(configs)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    labels = list(configs)
    if warmup:
        for label in labels:
            configs[label]()
    limit = memory_bandwidth_gb_s() if bandwidth else None
    runs: dict[str, list[Measurement]] = {label: [] for label in labels}
    bar = tqdm(total=repeats * len(labels), desc="timing", unit="run", disable=not progress)
    for r in range(repeats):
        for label in labels if r % 2 == 0 else labels[::-1]:
            if on_round is not None:
                on_round(r, label)
            m = configs[label]()
            runs[label].append(_sum(m) if isinstance(m, list) else m)
            bar.update()
        tokens = {label: runs[label][-1].new_tokens for label in labels}
        if len(set(tokens.values())) > 1:
            raise ValueError(f"round {r + 1}: the configurations generated different numbers of tokens {tokens}; "
                             "time them with min_new_tokens = max_new_tokens")
    bar.close()
    ref = runs[reference]
    rows = []
    for label in labels:
        ms = runs[label]
        ratios = [m.decode_tokens_per_s / b.decode_tokens_per_s for m, b in zip(ms, ref)]
        sp = _spread(ratios)
        verdict = "faster" if sp["min"] > 1.0 else "slower" if sp["max"] < 1.0 else "not resolved"
        bws = [m.bandwidth_gb_s for m in ms if m.bandwidth_gb_s is not None]
        bytes_ = [m.weight_bytes_per_step for m in ms if m.weight_bytes_per_step is not None]
        rows.append({
            "label": label,
            "decode_tokens_per_s": _spread([m.decode_tokens_per_s for m in ms]),
            "tokens_per_s": _spread([m.tokens_per_s for m in ms]),
            "ttft_s": _spread([m.ttft_s for m in ms]),
            "speedup": sp,
            "verdict": "reference" if label == reference else verdict,
            "new_tokens": ms[0].new_tokens,
            "weight_bytes_per_step": statistics.median(bytes_) if bytes_ else None,
            "bandwidth_gb_s": statistics.median(bws) if bws else None,
        })
    return Comparison(rows=rows, reference=reference, repeats=repeats, bandwidth_limit_gb_s=limit)


def _sum(ms: list[Measurement]) -> Measurement:
    """Several runs (one per prompt) as one: tokens and times added, TTFT averaged, weight bytes
    per step weighted by decode steps."""
    steps = sum(m.decode_steps for m in ms)
    weighted = [m for m in ms if m.weight_bytes_per_step is not None]
    bytes_ = (sum(m.weight_bytes_per_step * m.decode_steps for m in weighted) / max(steps, 1)) if weighted else None
    return Measurement(
        new_tokens=sum(m.new_tokens for m in ms), seconds=sum(m.seconds for m in ms),
        ttft_s=sum(m.ttft_s for m in ms) / len(ms), decode_tokens=sum(m.decode_tokens for m in ms),
        decode_s=sum(m.decode_s for m in ms), decode_steps=steps, weight_bytes_per_step=bytes_,
    )
