"""What every compare-timed benchmark writes: its command line, the protocol sentence, and the
JSON + Markdown + PNG triple next to ``--out``."""

from __future__ import annotations

import os
import sys

from ..files import atomic_write, save_figure, write_json

__all__ = ["command_line", "compare_protocol", "write_report"]


def command_line(argv: list[str] | None) -> str:
    """``python <script> <args>``: the command that reproduces this run (``argv`` as ``main`` got
    it; None: ``sys.argv[1:]``)."""
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:]))


def compare_protocol(repeats: int, new_tokens: int, interleaved: bool = True) -> str:
    """The sentence a report gives for ``river_hf.timing.compare``'s protocol at ``repeats`` rounds,
    every prompt exactly ``new_tokens`` new tokens; ``interleaved``: the reference ran next to each
    method (``compare(interleave=True)``), else once a round."""
    order = ("with the reference next to each method (R A R B ..., reversed every other round); speedups per "
             "neighbouring pair" if interleaved else
             "each running every method once, the reference included, in an order reversed every other round; "
             "speedups against the round's reference run")
    return (f"river_hf.timing.compare: one untimed warm-up of every method, then {repeats} round(s) {order}, "
            f"median (min-max); every prompt exactly {new_tokens} new tokens")


def write_report(out: str, report: dict, markdown: str, figure) -> None:
    """``report`` as JSON at ``out``, ``markdown`` at ``<out without extension>.md`` and the
    matplotlib ``figure`` at ``.png`` (each written atomically)."""
    write_json(out, report)
    base = os.path.splitext(out)[0]
    atomic_write(base + ".md", markdown)
    save_figure(figure, base + ".png")
