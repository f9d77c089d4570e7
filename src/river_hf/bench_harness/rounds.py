"""Rounds in alternating order and their verdicts, for the benchmarks that time with their own
loop (``benchmarks/stitch_bench.py`` compares latency to a finished answer, not speed at equal
token counts, so it cannot use ``river_hf.timing.compare``); the order and the verdict rule are
``river_hf.timing``'s."""

from __future__ import annotations

__all__ = ["time_rounds", "verdict", "range_verdict"]


def time_rounds(run, labels: list[str], repeats: int) -> dict[str, list]:
    """``repeats`` rounds of ``run(label)`` for every label, in forward order on even rounds and
    reversed on odd ones (river_hf.timing's order); returns label -> the results, one per round."""
    out: dict[str, list] = {label: [] for label in labels}
    for r in range(repeats):
        for label in labels if r % 2 == 0 else labels[::-1]:
            out[label].append(run(label))
    return out


def verdict(spread: dict) -> str:
    """A speedup's verdict from its spread (``river_hf.timing.spread``: ``min``, ``max``):
    ``"faster"`` when all of it is above 1, ``"slower"`` when all below, else ``"not resolved"``."""
    return "faster" if spread["min"] > 1.0 else "slower" if spread["max"] < 1.0 else "not resolved"


def range_verdict(lo: float, hi: float, threshold: float) -> str:
    """``"yes"`` when the whole range ``lo..hi`` is >= ``threshold``, ``"no"`` when all of it is
    below, else ``"not resolved"``."""
    return "yes" if lo >= threshold else "no" if hi < threshold else "not resolved"
