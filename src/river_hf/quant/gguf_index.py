"""The tensors of a GGUF file (name, format, shape and bytes), without parsing its metadata every time.

gguf-py's ``GGUFReader`` parses every metadata field when it opens a file, the tokenizer's vocabulary
and merges (~150k entries each for Qwen2.5) included: most of the 8.6 s River took to read the grids
of Qwen2.5-Coder-0.5B (:mod:`.grid`) at the first call of every process. :func:`gguf_tensors` takes
the tensor table and the architecture from ``GGUFReader`` the first time it sees a file and keeps them
in ``$RIVER_HF_CACHE/gguf-index/``, keyed by the file's real path, size and modification time; a
later read (another process, the same file) maps the file and slices each tensor's bytes from there.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from ..files import cache_dir, write_json

__all__ = ["GGUFTensor", "gguf_tensors"]

_INDEX_VERSION = 1


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: its GGUF name (``blk.0.ffn_up.weight``).
        format: gguf-py's ``GGMLQuantizationType`` name (``Q4_K``, ``F32``, ...).
        shape: its dimensions in GGUF order (the row length first).
        data: its bytes, ``uint8 [n_bytes]``, a read-only view of the mapped file.
    """

    name: str
    format: str
    shape: tuple[int, ...]
    data: np.ndarray


def _index_path(path: str):
    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    return cache_dir() / "gguf-index" / f"{key}.json", st.st_size


def _usable(index, size: int) -> bool:
    """Whether ``index`` (parsed JSON) is a table this version wrote for a file of ``size`` bytes:
    every entry a name, a format, a shape of non-negative integers and a byte range inside the file,
    and at least one entry."""
    if not isinstance(index, dict) or index.get("version") != _INDEX_VERSION or index.get("size") != size:
        return False
    arch, tensors = index.get("architecture"), index.get("tensors")
    if not (arch is None or isinstance(arch, str)) or not isinstance(tensors, list) or not tensors:
        return False
    for entry in tensors:
        if not (isinstance(entry, list) and len(entry) == 5):
            return False
        name, fmt, shape, offset, n_bytes = entry
        ints = [offset, n_bytes, *(shape if isinstance(shape, list) else [None])]
        if not (isinstance(name, str) and isinstance(fmt, str) and isinstance(shape, list)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints)
                and offset + n_bytes <= size):
            return False
    return True


def _read_index(index_path, size: int) -> dict | None:
    """The kept table, or None: none yet, or one that cannot be used (the file is parsed again)."""
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        return None
    return index if _usable(index, size) else None


def gguf_tensors(path: str) -> tuple[str | None, dict[str, GGUFTensor]]:
    """``(architecture, {name: GGUFTensor})`` of the GGUF file at ``path`` (``general.architecture``,
    e.g. ``qwen2``; None where the file has none), from the kept index or, the first time,
    from ``gguf.GGUFReader`` (then kept; a cache that cannot be written only costs the next read).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a GGUF file (gguf-py's error); a broken one raises whatever gguf-py's
            parse meets (``ValueError``, ``IndexError``, ...).
    """
    index_path, size = _index_path(path)
    index = _read_index(index_path, size)
    if index is None:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        field = reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
        index = {"version": _INDEX_VERSION, "size": size, "architecture": arch,
                 "tensors": [[t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset),
                              int(t.n_bytes)] for t in reader.tensors]}
        try:
            write_json(index_path, index)
        except OSError:
            pass
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {name: GGUFTensor(name, fmt, tuple(shape), data[offset:offset + n_bytes])
               for name, fmt, shape, offset, n_bytes in index["tensors"]}
    return index["architecture"], tensors
