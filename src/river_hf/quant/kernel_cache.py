"""The kernel tuner's cache file, ``kernels.json``: its keys, entries, checks and locked merges.

Choices are cached per machine and shape in ``$RIVER_HF_CACHE/kernels.json`` (default
``~/.cache/river_hf``), keyed by CPU model, torch version, thread count, shape, dtype, bias and the
candidate set, so a second build on the same machine measures nothing. The file::

    {"format": 2, "entries": {KEY: {"machine": ..., "shape": "896x4864", "dtype": "float32",
        "bias": false, "candidates": ["quanto-int4", "torch-int4"],
        "timings_us": {"torch-int4": 195.0, "quanto-int4": 216.0}, "kernel": "torch-int4",
        "measured_at": 1764550000.0, "load_avg_1m": 0.4, "cpus": 2, "river_hf_version": "0.1.0",
        "builds": {"river-int4": "river_int4_0123456789abcdef"}}}}

``timings_us``: median µs per one-token call (per ``rows``-row call in an entry of a dense mode or of an
exit Linear's prompt-kernel choice, which also has ``"rows": R`` and ``|rows=R`` at the end of its key); ``measured_at``: Unix time; ``load_avg_1m``: the
1-minute load average when the measurement started (None where the OS has none); ``cpus``: the
cores this process may run on; ``builds``: for the candidates compiled from river-hf's own C++ source
(:data:`OWN_BUILDS`), which build was timed (:func:`~river_hf.quant.river_int4.build_id`). An entry whose one-row timings a busy machine made meaningless
(:mod:`.prior`) also has ``"invalid": WHY`` and ``"prior": FEATURE SET``, its ``"kernel"`` being the
prior ranking's: it is never reused as a measurement (the prior decides while the machine stays
loaded; it is measured again once it is quiet). An entry is **not trusted** and is measured again at its next use when:
it does not parse (wrong types, a timing that is not a finite positive number, a kernel this
river-hf does not know, fields that disagree with its key); it was written by another river-hf
version (the kernels may have changed); one of its candidates is river-hf's own kernel and was
timed in another build of its source than the one this process uses (or in no recorded build); or it was measured *under load* and the machine is quiet
now. Under load means ``load_avg_1m > LOADED_LOAD_FACTOR x cpus`` (1.25: more runnable threads than
cores, so the candidates were timed while competing for the CPU); such an entry is used as is
while the machine stays loaded (measuring again then would be just as noisy) and replaced at the
first build that finds ``load_avg_1m`` at or below the threshold. A file of an older format
(no ``"format"``) is measured again entry by entry; a file of a newer format is read by nobody
and left alone (nothing is written over it).

Writes merge: under an exclusive ``fcntl`` lock on ``kernels.json.lock``, the file is read again,
this tuner's new entries are put in, and the result is written to a temporary file renamed into
place, so two processes measuring different shapes keep both entries (without ``fcntl``, on
Windows, the merge runs unlocked). ``river-hf kernels --list`` shows the cache,
``river-hf kernels --remeasure [SHAPE ...]`` drops or re-measures it (:mod:`.cli`).

What a timing depends on is :func:`machine_id` (processor, torch build, threads) and
:class:`LinearSpec` (shape, bias, dtype, device); :mod:`.autotune` measures, this module keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from ..files import atomic_write
from . import river_int4

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: merges run unlocked
    fcntl = None

__all__ = ["LinearSpec", "machine_id", "load_average", "usable_cpus", "FORMAT_VERSION", "LOADED_LOAD_FACTOR",
           "is_loaded", "read_cache", "entry_status", "update_cache", "DENSE_MODES", "OWN_BUILDS"]

#: version of the kernels.json layout written here (the module docstring); files without one are format 1
FORMAT_VERSION = 2
#: an entry was measured under load when its 1-minute load average exceeded this many times the cores
LOADED_LOAD_FACTOR = 1.25


def machine_id(device: torch.device | str = "cpu") -> str:
    """What a kernel timing depends on: processor model, torch build, thread count (or GPU name)."""
    device = torch.device(device)
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        return f"cuda:{torch.cuda.get_device_name(device)}|torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{cpu}|{capability}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def usable_cpus() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def load_average() -> float | None:
    """The 1-minute load average (runnable threads, ``os.getloadavg()[0]``); None where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # pragma: no cover - Windows
        return None


def is_loaded(load: float | None, cpus: int) -> bool:
    """``load > LOADED_LOAD_FACTOR x cpus`` (False when the load is unknown)."""
    return load is not None and load > LOADED_LOAD_FACTOR * cpus


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """What a kernel timing depends on of a Linear: its shape, bias, dtype and device."""

    in_features: int
    out_features: int
    bias: bool
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")

    @classmethod
    def of(cls, linear) -> LinearSpec:
        """The spec of an ``nn.Linear`` (or a spec, returned as is)."""
        if isinstance(linear, LinearSpec):
            return linear
        return cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype,
                   linear.weight.device)

    @property
    def shape(self) -> str:
        return f"{self.in_features}x{self.out_features}"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


#: The dense fp32 modes a multi-row choice times (:mod:`.dense`), by the names their ``measure`` returns:
#: lossless mode's verify kernel (``torch`` against ``onednn``) and dLLM-Cache's partial steps (``torch``
#: against ``small-batch``). Their entries carry the row count they were measured at.
DENSE_MODES = {
    "torch": "F.linear (MKL sgemm on x @ W.T)",
    "onednn": "oneDNN linear on weights packed once (PrepackedLinear)",
    "small-batch": "(W @ x.T).T (SmallBatchLinear)",
    "river-fp32": "river-hf's own few-row fp32 product on the weight as stored (RiverFp32Linear)",
    "river-grid": "river-hf's own product on a weight's exact GGUF grid (GridLinear)",
}


#: the candidates compiled from river-hf's own C++ source (``csrc/river_int4.cpp``): an exit kernel and a
#: dense mode; their timings hold only for the build they were taken in
OWN_BUILDS = ("river-int4", "river-fp32", "river-grid")


def _builds(names) -> dict[str, str]:
    """``{name: build id}`` for those of ``names`` in :data:`OWN_BUILDS`, as this process builds them
    (none where this CPU cannot build them)."""
    build = river_int4.build_id()
    return {n: build for n in sorted(names) if n in OWN_BUILDS and build is not None}


def _key(machine: str, shape: str, dtype: str, bias: bool, candidates, rows: int = 1) -> str:
    parts = [machine, shape, dtype, f"bias={bias}", ",".join(sorted(candidates))]
    return "|".join(parts if rows == 1 else parts + [f"rows={rows}"])  # one-row keys as before (format 2)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _entry_problem(key: str, entry) -> str | None:
    """Why a cache entry cannot be trusted as data (None: it is well formed)."""
    from .kernels import KERNELS

    if not isinstance(entry, dict):
        return "not an object"
    timings = entry.get("timings_us")
    if not isinstance(timings, dict) or not timings:
        return "no timings"
    rows = entry.get("rows", 1)
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        return "field 'rows' is not a positive integer"
    # an entry of dense modes (lossless verify, route mode's backbone at one row, ...) or of weight-only kernels
    # (an exit Linear's one-row choice, a prompt-kernel choice), not mixed
    known = DENSE_MODES if any(k in DENSE_MODES for k in timings) else KERNELS
    unknown = sorted(str(k) for k in timings if k not in known)
    if unknown:
        return f"unknown kernel(s) {', '.join(unknown)}"
    bad = sorted(k for k, v in timings.items() if not (_number(v) and v > 0))
    if bad:
        return f"timing of {', '.join(bad)} is not a finite positive number"
    for field, ok in (("machine", isinstance(entry.get("machine"), str)),
                      ("shape", isinstance(entry.get("shape"), str)),
                      ("dtype", isinstance(getattr(torch, str(entry.get("dtype")), None), torch.dtype)),
                      ("bias", isinstance(entry.get("bias"), bool)),
                      ("candidates", isinstance(entry.get("candidates"), list)),
                      ("measured_at", _number(entry.get("measured_at"))),
                      ("load_avg_1m", entry.get("load_avg_1m") is None or _number(entry.get("load_avg_1m"))),
                      ("cpus", isinstance(entry.get("cpus"), int) and not isinstance(entry.get("cpus"), bool)
                       and entry.get("cpus") >= 1),
                      ("river_hf_version", isinstance(entry.get("river_hf_version"), str)),
                      ("invalid", isinstance(entry.get("invalid", ""), str)),
                      ("prior", isinstance(entry.get("prior", ""), str)),
                      ("builds", isinstance(entry.get("builds", {}), dict)
                       and all(isinstance(v, str) for v in entry.get("builds", {}).values()))):
        if not ok:
            return f"field {field!r} missing or of the wrong type"
    if set(entry["candidates"]) != set(timings):
        return "timings do not cover the candidates"
    if key != _key(entry["machine"], entry["shape"], entry["dtype"], entry["bias"], entry["candidates"], rows):
        return "fields disagree with the key"
    return None


def read_cache(path: str | Path) -> tuple[dict, dict, int | None]:
    """Read a kernels.json: ``(valid entries, {key: why invalid}, format)``.

    The format is None when the file is missing or not a JSON object (its content is then
    ignored: measured again), 1 for the old layout (no ``"format"``; all its entries are invalid:
    they lack the load and version fields), or the file's ``"format"`` number. A newer format than
    :data:`FORMAT_VERSION` gives no entries (this river-hf does not read it).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}, {}, None
    if not isinstance(data, dict):
        return {}, {}, None
    fmt = data.get("format", 1)
    if not isinstance(fmt, int) or isinstance(fmt, bool):
        return {}, {}, None
    if fmt > FORMAT_VERSION:
        return {}, {}, fmt
    raw = data if fmt == 1 else data.get("entries")
    if not isinstance(raw, dict):
        return {}, {}, fmt
    valid, invalid = {}, {}
    for key, entry in raw.items():
        why = "written by river-hf before the cache had a format version" if fmt == 1 else _entry_problem(key, entry)
        if why is None:
            valid[key] = entry
        else:
            invalid[key] = why
    return valid, invalid, fmt


def entry_status(entry: dict, now_load: float | None = None, cpus: int | None = None) -> str | None:
    """Why a valid entry should be measured again now (None: use it).

    ``"river-hf X"`` when another version wrote it; ``"... rebuilt ..."`` when a candidate of
    :data:`OWN_BUILDS` was timed in another build than this process's (or in none recorded, as
    before builds were recorded); ``"measured under load ..."`` when it was
    measured under load (:func:`is_loaded`), or ``"its timings were invalid ..."`` when it is
    flagged ``"invalid"`` (:mod:`.prior`), and ``now_load`` (default: the current load average)
    is not loaded. ``cpus``: default :func:`usable_cpus`.
    """
    from .._version import __version__

    if entry["river_hf_version"] != __version__:
        return f"measured by river-hf {entry['river_hf_version']} (this is {__version__})"
    then = entry.get("builds", {})
    changed = [n for n, build in _builds(entry["candidates"]).items() if then.get(n) != build]
    if changed:
        names = " and ".join(changed)
        if changed[0] not in then:
            return f"{names} timed before river-hf recorded which build of its kernel was timed"
        return (f"{names} timed in another build of river-hf's kernel (its source, compiler flags or torch changed: "
                f"{then[changed[0]]} -> {river_int4.build_id()})")
    if is_loaded(entry["load_avg_1m"], entry["cpus"]) or "invalid" in entry:
        now_load = load_average() if now_load is None else now_load
        if not is_loaded(now_load, usable_cpus() if cpus is None else cpus):
            if not is_loaded(entry["load_avg_1m"], entry["cpus"]):
                return f"its timings were invalid ({entry['invalid']}), the machine is quiet now"
            return (f"measured under load (1-min load average {entry['load_avg_1m']:.2f} on {entry['cpus']} "
                    f"cores), the machine is quiet now")
    return None


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive ``fcntl.flock`` on ``path`` + ``.lock`` for the block (none without fcntl)."""
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def update_cache(path: str | Path, updates: dict | None = None, remove=None) -> dict | None:
    """Merge into the kernels.json at ``path``, under its lock: read it again, drop its invalid
    entries and the keys ``remove`` names (an iterable of keys, or a callable ``(key, entry) ->
    bool``), put ``updates`` (``{key: entry}``) in, and write it to a temporary file renamed into
    place. Returns the entries now in the file, or None when the file has a newer format (it is
    then left as it is).

    Raises:
        OSError: the folder cannot be created or written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        entries, _, fmt = read_cache(path)
        if fmt is not None and fmt > FORMAT_VERSION:
            return None
        if callable(remove):
            entries = {k: v for k, v in entries.items() if not remove(k, v)}
        else:
            for key in remove or ():
                entries.pop(key, None)
        entries.update(updates or {})
        # a temp file renamed into place, with the mode other cache files get under the umask
        atomic_write(path, json.dumps({"format": FORMAT_VERSION, "entries": entries}, indent=2) + "\n")
    return entries


def _entry(spec: LinearSpec, rows: int, names, timings: dict, load: float | None, cpus: int) -> dict:
    """A cache entry (module docstring) for ``timings`` of ``names`` on ``spec`` at ``rows`` rows."""
    from .._version import __version__

    entry = {"machine": machine_id(spec.device), "shape": spec.shape, "dtype": spec.dtype_name, "bias": spec.bias,
             "candidates": sorted(names), "timings_us": dict(timings), "kernel": min(timings, key=timings.get),
             "measured_at": time.time(), "load_avg_1m": load, "cpus": cpus, "river_hf_version": __version__}
    if rows != 1:
        entry["rows"] = rows
    builds = _builds(names)
    if builds:
        entry["builds"] = builds
    return entry
