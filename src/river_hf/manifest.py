"""The weight manifest of a converted model folder: size and sha256 of each weight file, written
with the folder (:func:`write_manifest`) and checked before the folder is used (:func:`damage`:
sizes only, or also the sha256 with ``full``; folders without a manifest get a structural
safetensors check). :func:`river_hf.models.resolve` and :func:`river_hf.models.verify` use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from .errors import RiverError
from .files import atomic_write

__all__ = ["MANIFEST", "write_manifest", "read_manifest", "damage"]

MANIFEST = "RIVER_HF_MANIFEST.json"
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin")


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: str | os.PathLike) -> Path:
    """Record the size and sha256 of ``folder``'s weight files (``*.safetensors``, their index,
    ``*.bin``) in ``folder/RIVER_HF_MANIFEST.json``, written atomically (temp file, then
    ``os.replace``). Called on every conversion before the folder is renamed into place.

    Returns:
        The manifest's path.

    Raises:
        RiverError: the folder holds no weight file.
    """
    folder = Path(folder)
    files = _weight_files(folder)
    if not files:
        raise RiverError(f"{str(folder)!r} holds no weight file (*.safetensors): the conversion did not save the model")
    entries = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    path = folder / MANIFEST
    atomic_write(path, json.dumps({"version": 1, "files": entries}, indent=1) + "\n")
    return path


def read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        return {name: (int(v["size"]), str(v["sha256"])) for name, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # an unreadable manifest: every file counts as unverified (reported below)


def _safetensors_damage(path: Path) -> str | None:
    """Structural check of one ``.safetensors`` file: its header must parse and the file must be as
    long as the header's largest data offset says (8-byte length + JSON header + data)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, 100 << 20):
                return f"{path.name}: header length {n} does not fit in a {size}-byte file"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"{path.name}: not a readable safetensors file"
    if size != 8 + n + end:
        return f"{path.name} is {size} bytes, its header says {8 + n + end}"
    return None


def damage(folder: Path, *, full: bool = False) -> str | None:
    """What is wrong with ``folder``'s weight files, or None.

    With a manifest: each listed file must exist with the recorded size (one ``stat`` per file),
    and with ``full`` also the recorded sha256. Without one (folders converted before the manifest
    existed, or any other save_pretrained folder): the structural safetensors check. Cheap without
    ``full``: no weight byte is read.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        for p in _weight_files(folder):
            if p.name.endswith(".safetensors") and (problem := _safetensors_damage(p)):
                return problem
        return None
    if not manifest:
        return f"{MANIFEST} is unreadable"
    for name, (size, digest) in manifest.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        got = p.stat().st_size
        if got != size:
            return f"{name} is {got} bytes, {size} when it was converted"
        if full and _sha256(p) != digest:
            return f"{name} has changed since it was converted (sha256 differs)"
    return None
