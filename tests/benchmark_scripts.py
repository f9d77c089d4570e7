"""Run a script of benchmarks/ (they are scripts, not a package) through its ``main(argv)``, for the
tests that run them end to end. What the scripts share lives in ``river_hf.bench_harness``, which
the tests import directly; a test reaches a script only through ``main``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` (``name`` may be ``probes/<probe>``) imported as a module of its own."""
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
