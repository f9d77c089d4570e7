"""How a comparison is shown: Markdown table rows, a bandwidth cell, a bar figure.

They read :meth:`river_hf.timing.Comparison.to_dict` rows (plain dicts), so the benchmark scripts
share one table layout and one figure style. Re-exported by :mod:`river_hf.timing`.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["markdown_rows", "bandwidth_cell", "bar_figure"]


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
