"""`evaluate` metric modules shipped inside river-hf, loaded by file path (works offline).

Each metric lives in ``metrics/<name>/<name>.py`` (the layout ``evaluate.load`` expects of a local
metric); :func:`load` finds it and returns the ``evaluate.EvaluationModule``.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import RiverError

__all__ = ["METRICS", "path", "load"]

METRICS = ("gsm8k_exact_match", "humaneval_pass_at_k")


def path(name: str) -> str:
    """File path of the shipped metric module ``name``. Raises RiverError for an unknown name."""
    if name not in METRICS:
        raise RiverError(f"unknown metric {name!r}; shipped metrics: {', '.join(METRICS)}")
    return str(Path(__file__).resolve().parent / name / f"{name}.py")


def load(name: str):
    """``evaluate.load`` of the shipped metric ``name`` by path (no Hub access needed)."""
    import evaluate

    return evaluate.load(path(name))
