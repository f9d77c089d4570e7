"""Writing files safely, where river-hf keeps its cache, and whether a file is a GGUF: the bottom of the package.

Imports nothing of river-hf, so every module (``models``, ``quant``, ``eval``, the benchmarks)
can use it without an import cycle.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "write_json", "save_figure", "cache_dir", "share_like_umask", "gguf_file_problem",
           "GGUF_MAGIC"]

#: the first four bytes of every GGUF file (gguf-py's ``GGUF_MAGIC``, 0x46554747 little-endian)
GGUF_MAGIC = b"GGUF"


def gguf_file_problem(path: str) -> str | None:
    """Why ``path`` (``~`` expanded) cannot be a GGUF file, or None when it begins as one does:
    ``an empty path``, ``no such file``, ``a directory``, ``cannot be read (...)`` or ``not a GGUF
    file (...)``. Reads four bytes; the rest of the file is gguf-py's to judge."""
    if not path:
        return "an empty path"
    p = Path(path).expanduser()
    if p.is_dir():
        return "a directory, not a GGUF file"
    if not p.is_file():
        return "no such file"
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if head != GGUF_MAGIC:
        return "not a GGUF file (it does not begin with GGUF's magic bytes)"
    return None


def cache_dir() -> Path:
    """The cache root: ``$RIVER_HF_CACHE`` or ``~/.cache/river_hf``."""
    return Path(os.environ.get("RIVER_HF_CACHE", Path.home() / ".cache" / "river_hf")).expanduser()


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


def share_like_umask(folder: str | os.PathLike) -> None:
    """Give ``folder`` (made by ``tempfile.mkdtemp``, mode 0700) and its files the modes of an
    ordinary ``mkdir`` / ``open`` under the current umask, so a saved or converted model is as
    readable as any other file the user writes."""
    folder = Path(folder)
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def write_json(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` with :func:`atomic_write`."""
    atomic_write(path, json.dumps(obj, indent=2) + "\n")


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
