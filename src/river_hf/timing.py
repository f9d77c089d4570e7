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
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

from transformers.generation.streamers import BaseStreamer

__all__ = ["TokenTimer", "Measurement", "stream_bandwidth", "memory_bandwidth_gb_s", "compare", "Comparison",
           "measure_generate", "markdown_rows", "bandwidth_cell", "bar_figure"]


def stream_bandwidth(nbytes: int | None = None, repeats: int = 5, threads: int | None = None) -> dict:
    """STREAM-like copy and triad bandwidth of this machine (GB/s, 1e9 bytes/s), torch ops.

    Three float32 arrays ``a``, ``b``, ``c`` of ``nbytes`` each (default: twice the last-level cache,
    at least 128 MiB and at most 1 GiB, so the three together are 6x the cache and every pass streams
    from memory; on a GPU 1 GiB); copy is ``c[:] = a`` (2 arrays moved per
    element), triad is ``a[:] = b + s * c`` (3 arrays), counted as STREAM counts them (no
    write-allocate traffic). Each figure is the best of ``repeats`` timed passes after one untimed
    pass (STREAM's rule). It runs at ``threads`` (default: torch's current thread count, i.e. the
    run's), and on the GPU when one is available. A sustained-bandwidth benchmark, not a limit.

    Returns:
        ``{"copy_gb_s", "triad_gb_s", "threads", "array_bytes", "device"}``.
    """
    import torch

    from .quant import last_level_cache_bytes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    nbytes = nbytes or (1 << 30 if device == "cuda" else min(max(128 << 20, 2 * last_level_cache_bytes()), 1 << 30))
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        n = max(nbytes // 4, 1)
        a = torch.full((n,), 1.0, dtype=torch.float32, device=device)
        b = torch.full((n,), 2.0, dtype=torch.float32, device=device)
        c = torch.zeros(n, dtype=torch.float32, device=device)

        def best(op) -> float:
            op()
            times = []
            for _ in range(repeats):
                if device == "cuda":  # pragma: no cover - needs a GPU
                    torch.cuda.synchronize()
                t = time.perf_counter()
                op()
                if device == "cuda":  # pragma: no cover - needs a GPU
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            return min(times)

        copy_s = best(lambda: c.copy_(a))
        triad_s = best(lambda: torch.add(b, c, alpha=3.0, out=a))
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    return {"copy_gb_s": 2 * n * 4 / copy_s / 1e9, "triad_gb_s": 3 * n * 4 / triad_s / 1e9, "threads": used,
            "array_bytes": n * 4, "device": device}


def memory_bandwidth_gb_s(nbytes: int | None = None, repeats: int = 5) -> float:
    """The STREAM triad figure of :func:`stream_bandwidth` (GB/s). Kept under its old name for
    callers that still use it; it used to be a 2-thread read-reduce (``sum()``), which
    underestimated what a decode step can reach. Print it as "STREAM triad GB/s"."""
    return stream_bandwidth(nbytes, repeats)["triad_gb_s"]


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

    def measurement(self, weight_bytes_per_step: float | None = None, returned_tokens: int | None = None) -> Measurement:
        """What was recorded, as a :class:`Measurement`.

        Args:
            weight_bytes_per_step: mean weight bytes read per decode step, when known.
            returned_tokens: the new tokens ``generate`` actually returned. A stop string (or a
                stopping criterion inside an assisted-decoding round) can cut the output after
                the streamer was already given more tokens; only the first ``returned_tokens``
                streamed tokens are then counted, and the run ends when the last of them arrived.
                None: every streamed token counts.

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
    """Run ``model.generate(**inputs, **generate_kwargs)`` under a :class:`TokenTimer` (batch 1).

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
    """New tokens of a batch-1 ``generate`` output (a tensor or a ``GenerateOutput``), or None."""
    import torch

    seq = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if not isinstance(seq, torch.Tensor) or seq.dim() != 2 or seq.shape[0] != 1:
        return None
    prompt = inputs.get("input_ids", inputs.get("inputs"))
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 2:
        return int(seq.shape[1] - prompt.shape[1])
    return int(seq.shape[1]) if inputs.get("inputs_embeds") is not None else None


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


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


def stream_line(triad: float, copy: float | None = None, threads: int | None = None) -> str:
    """The printed line that names the bandwidth figure shares are taken of."""
    return (f"STREAM triad GB/s of this machine: {triad:.1f}" + (f" (copy {copy:.1f})" if copy else "")
            + (f", {threads} threads" if threads else "")
            + "; a sustained-bandwidth benchmark, not a hard limit")


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


def markdown_rows(comparison: dict, extra: dict[str, Callable[[dict], str]] | None = None) -> list[str]:
    """A :meth:`Comparison.to_dict` as Markdown table lines (header, rule, one line per configuration).

    Columns: method, end-to-end tokens/s and its ratio to the reference's median, decode tokens/s
    (median, min-max), the per-pair decode speedup (median, min-max) and its verdict, then one column per
    ``extra`` entry (header -> ``cell(row) -> str``, in order; ``row`` is the configuration's row dict).
    Used by the benchmark scripts, so their tables share one layout.

    Raises:
        KeyError: ``comparison`` has no row for its reference label.
    """
    extra = extra or {}
    ref = next(r for r in comparison["rows"] if r["label"] == comparison["reference"])
    head = ["method", "end-to-end tok/s", "× plain e2e", "decode tok/s (min-max)", "× plain decode (min-max)",
            "verdict", *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in comparison["rows"]:
        e2e, d, sp = r["tokens_per_s"], r["decode_tokens_per_s"], r["speedup"]
        ratio = ("reference" if r["label"] == comparison["reference"]
                 else f"{sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f})")
        cells = [r["label"], f"{e2e['median']:.2f}", f"{e2e['median'] / ref['tokens_per_s']['median']:.2f}",
                 f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f})", ratio, r["verdict"],
                 *(cell(r) for cell in extra.values())]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def bandwidth_cell(row: dict, triad: float | None) -> str:
    """``"12.0 (39 %)"``: a row's achieved GB/s and its share of the STREAM triad ("" when unknown)."""
    bw = row["bandwidth_gb_s"]
    return "" if bw is None else f"{bw:.1f}" + (f" ({100 * bw / triad:.0f} %)" if triad else "")


def bar_figure(rows: list[dict], title: str, *, metric: str = "speedup", ylabel: str | None = None,
               color: Callable[[str], str] | None = None, tick: Callable[[str], str] | None = None,
               figsize: tuple[float, float] = (8, 3.8), unit_line: bool | None = None):
    """A matplotlib bar chart of one metric per configuration, median with min-max error bars.

    Args:
        rows: :meth:`Comparison.to_dict` rows.
        title: the figure title.
        metric: ``"speedup"`` (decode speedup over the reference, per pair) or any row key holding a
            ``{"median", "min", "max"}`` dict (e.g. ``"decode_tokens_per_s"``).
        ylabel: the y label (default: the decode speedup's).
        color: label -> matplotlib colour (default: grey for the reference kinds, blue otherwise).
        tick: label -> tick text (default: the label).
        unit_line: draw y = 1 (default: when ``metric`` is ``"speedup"``).

    Returns:
        the ``matplotlib.figure.Figure`` (save it with :func:`river_hf.files.save_figure`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["label"] for r in rows]
    med = [r[metric]["median"] for r in rows]
    lo = [m - r[metric]["min"] for m, r in zip(med, rows)]
    hi = [r[metric]["max"] - m for m, r in zip(med, rows)]
    color = color or (lambda n: "#888" if n.startswith("unmodified") else "#1f77b4")
    fig, ax = plt.subplots(figsize=figsize)
    ax.bar(names, med, yerr=[lo, hi], capsize=4, color=[color(n) for n in names])
    ax.set_xticks(range(len(names)), [tick(n) if tick else n for n in names], fontsize=8, rotation=0 if tick else 20)
    if unit_line if unit_line is not None else metric == "speedup":
        ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel(ylabel or "decode speedup vs plain fp32\n(median, min-max over rounds)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
