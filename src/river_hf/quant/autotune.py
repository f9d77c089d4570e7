"""Pick the fastest kernel for a Linear's shape by measuring it on this machine: river-hf's one tuner.

Every kernel choice river-hf makes by measurement goes through :class:`KernelTuner`, one cache file
and one timing routine (:func:`alternating_medians`): the weight-only kernels of the exit layers and
exit head (:meth:`KernelTuner.choose`, one-token calls), and the dense fp32 modes of multi-row calls
(:meth:`KernelTuner.choose_mode`: lossless mode's verify kernel, F.linear against prepacked oneDNN;
dLLM-Cache's partial steps, F.linear against ``(W @ x.T).T``), whose entries add the row count.

Kernel rankings change from one CPU to the next (an AVX2-only machine, an AVX-512/AMX one with a
300 MB L3 ...), so no table written on another machine decides. :class:`KernelTuner` times each
candidate kernel on random weights of the Linear's shape, at the decode shape (one token, the
model's dtype at the boundary, casts included), with its weights **streamed from memory**: each
candidate is built as many separate copies as it takes to read twice the last-level cache per
round, and a round calls each copy once, because a decode step reads every weight of the model
once and no Linear finds its weights in cache. Candidates alternate from round to round; the
median over rounds decides.

Choices are cached per machine and shape in ``$RIVER_HF_CACHE/kernels.json`` (default
``~/.cache/river_hf``), keyed by CPU model, torch version, thread count, shape, dtype, bias and the
candidate set, so a second build on the same machine measures nothing. The file::

    {"format": 2, "entries": {KEY: {"machine": ..., "shape": "896x4864", "dtype": "float32",
        "bias": false, "candidates": ["quanto-int4", "torch-int4"],
        "timings_us": {"torch-int4": 195.0, "quanto-int4": 216.0}, "kernel": "torch-int4",
        "measured_at": 1764550000.0, "load_avg_1m": 0.4, "cpus": 2, "river_hf_version": "0.1.0"}}}

``timings_us``: median µs per one-token call (per ``rows``-row call in an entry of a dense mode or of an
exit Linear's prompt-kernel choice, which also has ``"rows": R`` and ``|rows=R`` at the end of its key); ``measured_at``: Unix time; ``load_avg_1m``: the
1-minute load average when the measurement started (None where the OS has none); ``cpus``: the
cores this process may run on. An entry is **not trusted** and is measured again at its next use when:
it does not parse (wrong types, a timing that is not a finite positive number, a kernel this
river-hf does not know, fields that disagree with its key); it was written by another river-hf
version (the kernels may have changed); or it was measured *under load* and the machine is quiet
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from ..files import atomic_write

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: merges run unlocked
    fcntl = None

__all__ = ["KernelTuner", "LinearSpec", "machine_id", "last_level_cache_bytes", "load_average", "usable_cpus",
           "FORMAT_VERSION", "LOADED_LOAD_FACTOR", "is_loaded", "read_cache", "entry_status", "update_cache"]

#: version of the kernels.json layout written here (the module docstring); files without one are format 1
FORMAT_VERSION = 2
#: an entry was measured under load when its 1-minute load average exceeded this many times the cores
LOADED_LOAD_FACTOR = 1.25


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (bytes) from sysfs; 64 MiB when it cannot be read."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 64 << 20


def alternating_medians(runs: dict, rounds: int, calls=1, *, sync=None) -> dict[str, float]:
    """The one timing routine behind every kernel choice of river-hf (the exit kernels of
    :class:`KernelTuner`, lossless mode's verify kernel, dLLM-Cache's partial-step orientation).

    Args:
        runs: ``{name: callable}``; one call of ``runs[name]()`` makes ``calls`` kernel calls.
        rounds: timed rounds; before them one untimed warm-up round (first-call allocations,
            lazy packing). The candidates' order is reversed every other round, so none always
            runs right after the same neighbour.
        calls: kernel calls per run, an int for all or ``{name: int}`` per candidate.
        sync: None, or a callable run before and after each timed run (``torch.cuda.synchronize``).

    Returns:
        ``{name: median µs per kernel call}`` over the timed rounds.
    """
    names = list(runs)
    per_run = calls if isinstance(calls, dict) else dict.fromkeys(names, calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for r in range(rounds + 1):
            for name in (names if r % 2 else names[::-1]):
                if sync is not None:
                    sync()
                start = time.perf_counter()
                runs[name]()
                if sync is not None:
                    sync()
                if r:  # round 0 warms up
                    times[name].append((time.perf_counter() - start) / per_run[name] * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


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
}


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
    # rows > 1: an entry of dense modes (lossless verify, ...) or of weight-only kernels (a prompt-kernel choice), not mixed
    known = DENSE_MODES if rows > 1 and any(k in DENSE_MODES for k in timings) else KERNELS
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
                      ("river_hf_version", isinstance(entry.get("river_hf_version"), str))):
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

    ``"river-hf X"`` when another version wrote it; ``"measured under load ..."`` when it was
    measured under load (:func:`is_loaded`) and ``now_load`` (default: the current load average)
    is not. ``cpus``: default :func:`usable_cpus`.
    """
    from .._version import __version__

    if entry["river_hf_version"] != __version__:
        return f"measured by river-hf {entry['river_hf_version']} (this is {__version__})"
    if is_loaded(entry["load_avg_1m"], entry["cpus"]):
        now_load = load_average() if now_load is None else now_load
        if not is_loaded(now_load, usable_cpus() if cpus is None else cpus):
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
    return entry


class KernelTuner:
    """Measures candidate kernels per Linear shape and remembers the winner.

    Args:
        cache_file: JSON file of earlier choices (None: ``$RIVER_HF_CACHE/kernels.json``;
            ``False``: keep nothing on disk). Its entries are checked and merged as the module
            docstring says.
        rounds: timed rounds per candidate (median taken); one round calls every copy once.
        stream_bytes: weight bytes one round reads: each candidate is built that many times over
            (separate copies, called in turn) so its weights come from memory, not cache, as in a
            decode step (default: twice the last-level cache, at most 1 GiB).
        max_copies: at most this many copies per candidate.

    Attributes:
        measured: how many shapes were measured (not found in the cache) by this tuner.
        on_measure: None, or a callable ``(shape, dtype name, why)`` run before each shape is
            measured (River's build prints a line with it when its progress bar is on).
        remeasured: ``{key: why}`` for the cached entries this tuner did not trust and measured again.
        invalid: ``{key: why}`` for the entries of the file that were dropped when it was read.
    """

    def __init__(self, cache_file: str | Path | None | bool = None, *, rounds: int = 7, stream_bytes: int | None = None,
                 max_copies: int = 64):
        if cache_file is None:
            from ..files import cache_dir

            cache_file = cache_dir() / "kernels.json"
        self.cache_file = Path(cache_file) if cache_file else None
        self.rounds = rounds
        self.stream_bytes = stream_bytes or min(2 * last_level_cache_bytes(), 1 << 30)
        self.max_copies = max_copies
        self.measured = 0
        self.on_measure = None  # called with (shape, dtype name, why) before a shape is measured
        self.remeasured: dict[str, str] = {}
        self.invalid: dict[str, str] = {}
        self._choices: dict[str, dict] = {}
        if self.cache_file is not None:
            self._choices, self.invalid, _ = read_cache(self.cache_file)

    def _save(self, key: str, entry: dict) -> None:
        if self.cache_file is None:
            return
        try:
            merged = update_cache(self.cache_file, {key: entry})
        except OSError:
            return  # a read-only cache folder only costs a measurement next time
        if merged is not None:
            self._choices.update(merged)  # what other processes measured meanwhile

    def choose(self, candidates, linear: nn.Linear, rows: int = 1) -> tuple:
        """The fastest of ``candidates`` (:class:`~river_hf.quant.kernels.WeightOnlyKernel`) for
        ``linear``'s shape and dtype, in calls of ``rows`` rows (1: a decode step's one token; more:
        a prompt kernel's choice); returns ``(kernel, {kernel name: µs per call})``. A cached entry
        is used when it is valid and trusted (module docstring), else the shape is measured and the
        entry replaced."""
        by_name = {k.name: k for k in candidates}
        timings = self._cached_or_measured(LinearSpec.of(linear), rows, list(by_name),
                                           lambda spec: self.measure(candidates, spec, rows))
        return by_name[min(timings, key=timings.get)], timings

    def choose_mode(self, linear, rows: int, candidates, measure) -> tuple[str, dict[str, float]]:
        """The faster dense fp32 mode (:data:`DENSE_MODES`) for ``rows``-row calls of ``linear``'s
        shape (an ``nn.Linear`` or :class:`LinearSpec`), cached in the same file as the exit kernels
        under a key that adds the row count, trusted by the same rules.

        Args:
            candidates: the mode names ``measure`` times, e.g. ``("torch", "onednn")``.
            measure: ``() -> {name: µs per call}`` (e.g. ``PrepackedLinear.measure`` bound to the
                shape and row count), run only when no trusted entry is cached.

        Returns:
            ``(fastest name, {name: µs per call})``.

        Raises:
            ValueError: ``rows`` < 2, or a candidate that is not a dense mode.
        """
        if rows < 2:
            raise ValueError(f"rows must be >= 2 for a dense mode choice (one-row calls use choose), got {rows}")
        bad = [c for c in candidates if c not in DENSE_MODES]
        if bad:
            raise ValueError(f"not dense modes: {bad}; expected some of {sorted(DENSE_MODES)}")
        timings = self._cached_or_measured(LinearSpec.of(linear), rows, list(candidates), lambda spec: measure())
        return min(timings, key=timings.get), timings

    def _cached_or_measured(self, spec: LinearSpec, rows: int, names: list[str], measure) -> dict[str, float]:
        """The timings of the trusted cached entry for ``(spec, rows, names)``, else of a new
        measurement ``measure(spec)`` (saved: :meth:`_save`)."""
        key = _key(machine_id(spec.device), spec.shape, spec.dtype_name, spec.bias, names, rows)
        entry = self._choices.get(key)
        why = "not cached" if entry is None else _entry_problem(key, entry) or entry_status(entry)
        if why is not None:
            if entry is not None:
                self.remeasured[key] = why
            if self.on_measure is not None:
                self.on_measure(spec.shape if rows == 1 else f"{spec.shape} at {rows} rows", spec.dtype_name, why)
            load, cpus = load_average(), usable_cpus()
            entry = _entry(spec, rows, names, measure(spec), load, cpus)
            self._choices[key] = entry
            self.measured += 1
            self._save(key, entry)
        return dict(entry["timings_us"])

    def measure_again(self, entry: dict, measure_modes) -> dict | None:
        """A new cache entry for a cached one (``river-hf kernels --remeasure``): the same shape,
        dtype, bias, candidates and row count, measured now on this machine; None when one of its
        kernels is not available here any more (its library uninstalled, no oneDNN in this torch).

        ``measure_modes(candidates, in_features, out_features, rows) -> {name: µs}`` times an entry
        of dense modes (:func:`river_hf.quant.dense.measure_modes`; passed in, since ``dense``
        imports this module), raising RuntimeError where one is missing."""
        from .kernels import KERNELS

        dims = tuple(int(n) for n in entry["shape"].split("x"))
        spec = LinearSpec(*dims, entry["bias"], getattr(torch, entry["dtype"]))
        rows = entry.get("rows", 1)
        load, cpus = load_average(), usable_cpus()
        if not all(n in KERNELS for n in entry["candidates"]):  # a dense mode's entry (lossless verify, dLLM-Cache)
            try:
                timings = measure_modes(entry["candidates"], *dims, rows)
            except RuntimeError:
                return None
            return _entry(spec, rows, entry["candidates"], timings, load, cpus)
        candidates = [KERNELS[n] for n in entry["candidates"]]  # exit kernels: one-row, or a prompt-kernel choice
        if not all(k.available(spec.device.type) for k in candidates):
            return None
        return _entry(spec, rows, entry["candidates"], self.measure(candidates, spec, rows), load, cpus)

    def measure(self, candidates, linear, rows: int = 1) -> dict[str, float]:
        """Median µs per call of ``rows`` rows (one token each) of each candidate on ``linear`` (an
        ``nn.Linear`` or :class:`LinearSpec`: only its shape, bias, dtype and device matter),
        weights streamed from memory at one row (a multi-row call is bound by arithmetic: two
        copies), candidates alternating from one round to the next."""
        spec = LinearSpec.of(linear)
        device, dtype = spec.device, spec.dtype
        gen = torch.Generator(device="cpu").manual_seed(0)
        probe = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias, device="meta")
        probe = probe.to_empty(device=device).to(dtype)
        with torch.no_grad():
            probe.weight.copy_(torch.randn(probe.weight.shape, generator=gen).to(dtype) * 0.02)
            if probe.bias is not None:
                probe.bias.zero_()
            built = [(k.name, self._copies(k, probe, 1 if rows == 1 else 2)) for k in candidates]
        del probe
        x = torch.randn(1, rows, spec.in_features, generator=gen).to(device=device, dtype=dtype)
        runs = {name: (lambda copies=copies: [m(x) for m in copies]) for name, copies in built}
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
        return alternating_medians(runs, self.rounds, {name: len(copies) for name, copies in built}, sync=sync)

    def _copies(self, kernel, probe: nn.Linear, at_most: int | None = None) -> list[nn.Module]:
        """Enough separate copies of the kernel's module that one pass over them reads
        ``stream_bytes`` of weights (a decode step reads every weight once: none stays in cache),
        and no more than ``at_most`` (default ``max_copies``)."""
        from .kernels import linear_weight_bytes

        first = kernel.build(probe)
        n = max(1, -(-self.stream_bytes // max(linear_weight_bytes(first), 1)))
        n = min(n, self.max_copies if at_most is None else at_most)
        return [first] + [kernel.build(probe) for _ in range(n - 1)]


def default_tuner() -> KernelTuner | None:
    """The tuner used by ``enable_river``; ``RIVER_HF_AUTOTUNE=0`` turns measurement off (the first
    candidate is then taken)."""
    if os.environ.get("RIVER_HF_AUTOTUNE", "1") == "0":
        return None
    return KernelTuner()
