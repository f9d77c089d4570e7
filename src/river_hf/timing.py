"""The one side-by-side timer: every speed figure river-hf prints comes from here.

Rules (the project's benchmark standard):

* all configurations run in one process, on the same inputs, with the same number of new tokens;
* one untimed warm-up run of each configuration first (allocations, kernel selection, caches);
* ``repeats`` timed rounds; in each the reference runs next to every other configuration
  (``R A R B R C`` on even rounds, the same reversed, ``C R B R A R``, on odd ones), so a slow
  drift of the machine falls evenly on every configuration and every speedup compares two runs
  that are neighbours in time (with two configurations this is plain alternation: ``R A``, ``A R``);
* per configuration the median and the spread (min-max) over rounds; the speedup against the
  reference is taken *per pair* (a run over the reference run next to it) and reported as
  median and min-max; a speedup whose spread contains 1.0 is printed as "not resolved";
* decode speed is separated from prefill: TTFT (s, call start to the first new token) and decode
  tokens/s (tokens after the first / time from the first to the last token), measured by a
  streamer (:class:`TokenTimer`) that works for any ``generate``;
* the machine's STREAM copy and triad bandwidth are measured once per run, at the run's thread
  count (:func:`stream_bandwidth`), and each configuration's achieved bandwidth (weight bytes read
  per decode step x decode steps/s) is printed as a share of the **STREAM triad** figure. That is a
  sustained-bandwidth benchmark, not a hard limit: a decode step can come near it or pass it;
* every table names its reference (``reference_kind``: e.g. the plain transformers model, or a
  River model in backbone mode).

The STREAM figures are measured by :mod:`river_hf.bandwidth`, and the Markdown rows and bar figures
of a comparison are drawn by :mod:`river_hf.timing_report`; both are re-exported here, so every
name above is imported from ``river_hf.timing``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

from transformers.generation.streamers import BaseStreamer

from .bandwidth import memory_bandwidth_gb_s, stream_bandwidth, stream_line
from .timing_report import bandwidth_cell, bar_figure, markdown_rows

__all__ = ["TokenTimer", "Measurement", "stream_bandwidth", "memory_bandwidth_gb_s", "compare", "Comparison",
           "measure_generate", "markdown_rows", "bandwidth_cell", "bar_figure", "spread", "stream_line"]


class TokenTimer(BaseStreamer):
    """A ``generate`` streamer that records when each new token arrives.

    ``generate`` calls ``put`` once with the prompt, then with each new token (or several at once,
    in assisted generation), then ``end``. Each put counts ``value.numel()`` tokens, so a batch
    counts every row: ``generate`` puts ``[B]`` per step (finished rows padded), River's batched
    lossless loop ``[B, n]`` rectangles whose concatenation is the returned new tokens
    (:mod:`river_hf.river.lossless_batch`), its first put right after the prefill; the tokens of
    a batch are then ``B`` x the returned new columns, each counted once. Pass ``inner`` to also
    stream to another streamer (e.g. a ``TextStreamer``). Times are ``time.perf_counter()`` seconds.

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

    def measurement(self, weight_bytes_per_step: float | None = None, returned_tokens: int | None = None) -> Measurement:
        """What was recorded, as a :class:`Measurement`.

        Args:
            weight_bytes_per_step: mean weight bytes read per decode step, when known.
            returned_tokens: the new tokens ``generate`` actually returned (a batch: rows x new
                columns). A stop string (or a stopping criterion inside an assisted-decoding
                round, batch 1) can cut the output after the streamer was already given more
                tokens; only the first ``returned_tokens`` streamed tokens are then counted, and
                the run ends when the last of them arrived. None: every streamed token counts.

        Raises:
            ValueError: no new token came (or ``returned_tokens`` < 1).
        """
        arrivals = list(self.arrivals)
        if returned_tokens is not None:
            kept, left = [], int(returned_tokens)
            for t, n in arrivals:
                if left <= 0:
                    break
                kept.append((t, min(n, left)))
                left -= n
            arrivals = kept
        if not arrivals:
            raise ValueError("no new token was streamed (or returned): was this timer passed as generate(streamer=...)?")
        first, last = arrivals[0][0], arrivals[-1][0]
        tokens = sum(n for _, n in arrivals)
        decode_tokens = tokens - arrivals[0][1]
        decode_s = last - first
        return Measurement(
            new_tokens=tokens, seconds=last - self.start, ttft_s=first - self.start,
            decode_tokens=decode_tokens, decode_s=decode_s, weight_bytes_per_step=weight_bytes_per_step,
            decode_steps=len(arrivals) - 1,
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
    """Run ``model.generate(**inputs, **generate_kwargs)`` under a :class:`TokenTimer` (any batch:
    tokens count every row).

    A River model's ``river_stats["weight_bytes_per_token"]`` gives the weight bytes (converted to
    per streamer step: in assisted or lossless decoding one step brings several tokens); otherwise
    pass ``weight_bytes_per_step=`` (bytes per step) among the keyword arguments. Only the tokens
    the call returned are counted (a stop string may cut tokens the streamer already saw).
    """
    bytes_per_step = generate_kwargs.pop("weight_bytes_per_step", None)
    timer = TokenTimer(generate_kwargs.pop("streamer", None))
    timer.reset()
    out = model.generate(**inputs, **generate_kwargs, streamer=timer)
    stats = getattr(model, "river_stats", None) or {}
    measured = timer.measurement(bytes_per_step, returned_tokens=_returned_tokens(out, inputs))
    if bytes_per_step is None and stats.get("weight_bytes_per_token") is not None:
        # River counts bytes per generated token; a streamer step of assisted (lossless) decoding
        # brings several tokens, so per step = per token x tokens / steps
        per_token = stats["weight_bytes_per_token"]
        measured.weight_bytes_per_step = per_token * measured.decode_tokens / max(measured.decode_steps, 1)
    return measured


def _returned_tokens(out, inputs: dict) -> int | None:
    """New tokens of a ``generate`` output (a tensor or a ``GenerateOutput``): rows x new columns
    (padding after a row's EOS included, as the streamer was given it), or None."""
    import torch

    seq = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if not isinstance(seq, torch.Tensor) or seq.dim() != 2:
        return None
    prompt = inputs.get("input_ids", inputs.get("inputs"))
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 2:
        return int(seq.shape[0] * (seq.shape[1] - prompt.shape[1]))
    return int(seq.shape[0] * seq.shape[1]) if inputs.get("inputs_embeds") is not None else None


def spread(values: list[float], *, runs: bool = True) -> dict:
    """The form every timed figure takes: ``{"median", "min", "max"}`` of ``values`` and, with
    ``runs``, ``"runs"`` (the values themselves, in order). :func:`compare` gives each row's figures
    this way; the benchmarks that time with their own loop use it too.

    Raises:
        ValueError: ``values`` is empty (``statistics.StatisticsError``).
    """
    out = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    if runs:
        out["runs"] = list(values)
    return out


@dataclasses.dataclass
class Comparison:
    """Result of :func:`compare`: ``rows`` (one dict per configuration, see :func:`compare`), the
    reference label and what that reference is (``reference_kind``), the repeats, and the
    machine's STREAM triad and copy bandwidth (GB/s, :func:`stream_bandwidth`; None when not
    measured)."""

    rows: list[dict]
    reference: str
    repeats: int
    stream_triad_gb_s: float | None
    stream_copy_gb_s: float | None = None
    stream_threads: int | None = None
    reference_kind: str | None = None
    interleaved: bool = True

    def row(self, label: str) -> dict:
        return next(r for r in self.rows if r["label"] == label)

    @property
    def bandwidth_limit_gb_s(self) -> float | None:
        """The old name of :attr:`stream_triad_gb_s` (it was never a limit)."""
        return self.stream_triad_gb_s

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """The comparison as aligned text lines, one per configuration, then what the reference
        was and the STREAM triad figure the bandwidth shares are taken of."""
        triad = self.stream_triad_gb_s
        head = (f"{'configuration':<22} {'decode tok/s (min-max)':>24} {'× ' + self.reference + ' (min-max)':>30} "
                f"{'TTFT s':>7} {'GB/s':>6} {'% STREAM triad':>14}")
        lines = [head]
        for r in self.rows:
            d, sp = r["decode_tokens_per_s"], r["speedup"]
            bw = r["bandwidth_gb_s"]
            ratio = "reference" if r["label"] == self.reference else (
                f"{sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f}) {r['verdict']}")
            lines.append(
                f"{r['label']:<22} {d['median']:>8.2f} ({d['min']:.2f}-{d['max']:.2f}){'':>5} {ratio:>30} "
                f"{r['ttft_s']['median']:>7.2f} {'' if bw is None else f'{bw:6.1f}':>6} "
                f"{'' if bw is None or not triad else f'{100 * bw / triad:13.0f}%':>14}")
        lines.append(f"reference {self.reference!r}: {self.reference_kind or 'not stated by the caller'}")
        order = ("reference run next to each configuration (R A R B ...), order reversed every other round"
                 if self.interleaved else "alternating order")
        lines.append(f"{self.repeats} timed round{'s' if self.repeats != 1 else ''}, {order}; median (min-max)")
        if triad:
            lines.append(stream_line(triad, self.stream_copy_gb_s, self.stream_threads))
        return "\n".join(lines)


def _schedule(labels: list[str], reference: str, round_: int, interleave: bool) -> list[tuple[str, int]]:
    """One round's run order as ``(label, partner)`` pairs: ``partner`` is the index, in this
    round's order, of the reference run a configuration's speedup is taken against."""
    others = [label for label in labels if label != reference]
    if not interleave:
        order = labels if round_ % 2 == 0 else labels[::-1]
        r = order.index(reference)
        return [(label, r) for label in order]
    order: list[str] = []
    for label in others or []:
        order += [reference, label]
    if not others:
        order = [reference]
    if round_ % 2:
        order = order[::-1]
    out = []
    for i, label in enumerate(order):
        if label == reference:
            out.append((label, i))
        else:  # the reference run right before it (even rounds) or right after it (odd rounds)
            out.append((label, i + 1 if round_ % 2 else i - 1))
    return out


def compare(
    configs: dict[str, Callable[[], Measurement | list[Measurement]]],
    *,
    reference: str,
    repeats: int = 3,
    warmup: bool = True,
    bandwidth: bool = True,
    progress: bool = False,
    on_round: Callable[[int, str], None] | None = None,
    reference_kind: str | None = None,
    interleave: bool = True,
) -> Comparison:
    """Time ``configs`` side by side (see the module docstring for the rules).

    Args:
        configs: label -> a function that runs one timed unit and returns its
            :class:`Measurement` (or a list of them, e.g. one per prompt: their tokens and times
            are summed).
        reference: the label the speedups are taken against.
        repeats: timed rounds (>= 1; 3 or more for a claim).
        warmup: run every configuration once, untimed, first.
        bandwidth: measure the machine's STREAM copy and triad bandwidth once (:func:`stream_bandwidth`).
        progress: a tqdm bar over the runs.
        on_round: called as ``on_round(repeat, label)`` before each timed run.
        reference_kind: what the reference is (e.g. "plain transformers model"); printed with the
            table and kept in the result.
        interleave: run the reference next to every configuration (``R A R B R C``, reversed on
            odd rounds), so each speedup compares neighbours in time; False: each configuration
            once per round, alternating order (the reference then runs once per round).

    Returns:
        A :class:`Comparison`; each row has ``label``, ``decode_tokens_per_s``, ``tokens_per_s``,
        ``ttft_s`` (each ``{"median", "min", "max", "runs"}``; the reference's runs are all its
        runs, one per neighbour), ``speedup`` (per pair: decode tokens/s over the neighbouring
        reference run's, same form), ``reference_runs`` (those reference decode tokens/s, one per
        round), ``verdict`` (``"faster"``, ``"slower"`` or ``"not resolved"`` when the speedup's
        min-max contains 1.0), ``new_tokens``, ``weight_bytes_per_step`` (bytes, median),
        ``bandwidth_gb_s`` (median).

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
    stream = stream_bandwidth() if bandwidth else None
    runs: dict[str, list[Measurement]] = {label: [] for label in labels}
    paired: dict[str, list[Measurement]] = {label: [] for label in labels}
    total = sum(len(_schedule(labels, reference, r, interleave)) for r in range(repeats))
    bar = tqdm(total=total, desc="timing", unit="run", disable=not progress)
    for r in range(repeats):
        plan = _schedule(labels, reference, r, interleave)
        done: list[Measurement] = []
        for label, _ in plan:
            if on_round is not None:
                on_round(r, label)
            m = configs[label]()
            done.append(_sum(m) if isinstance(m, list) else m)
            bar.update()
        for (label, partner), m in zip(plan, done):
            runs[label].append(m)
            paired[label].append(done[partner])
        tokens = {label: m.new_tokens for (label, _), m in zip(plan, done)}
        if len({m.new_tokens for m in done}) > 1:
            raise ValueError(f"round {r + 1}: the configurations generated different numbers of tokens {tokens}; "
                             "time them with min_new_tokens = max_new_tokens")
    bar.close()
    rows = []
    for label in labels:
        ms = runs[label]
        if label == reference:
            refs = ms
            ratios = [1.0] * len(ms)
        else:
            refs = paired[label]
            ratios = [m.decode_tokens_per_s / b.decode_tokens_per_s for m, b in zip(ms, refs)]
        sp = spread(ratios)
        verdict = "faster" if sp["min"] > 1.0 else "slower" if sp["max"] < 1.0 else "not resolved"
        bws = [m.bandwidth_gb_s for m in ms if m.bandwidth_gb_s is not None]
        bytes_ = [m.weight_bytes_per_step for m in ms if m.weight_bytes_per_step is not None]
        rows.append({
            "label": label,
            "decode_tokens_per_s": spread([m.decode_tokens_per_s for m in ms]),
            "tokens_per_s": spread([m.tokens_per_s for m in ms]),
            "ttft_s": spread([m.ttft_s for m in ms]),
            "speedup": sp,
            "reference_runs": [b.decode_tokens_per_s for b in refs],
            "verdict": "reference" if label == reference else verdict,
            "new_tokens": ms[0].new_tokens,
            "weight_bytes_per_step": statistics.median(bytes_) if bytes_ else None,
            "bandwidth_gb_s": statistics.median(bws) if bws else None,
        })
    return Comparison(rows=rows, reference=reference, repeats=repeats,
                      stream_triad_gb_s=stream["triad_gb_s"] if stream else None,
                      stream_copy_gb_s=stream["copy_gb_s"] if stream else None,
                      stream_threads=stream["threads"] if stream else None,
                      reference_kind=reference_kind, interleaved=interleave)


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
