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

Which kernel won for a shape is cached per machine in ``$RIVER_HF_CACHE/kernels.json``, whose
layout, trust rules and locked merges are :mod:`.kernel_cache` (its names are re-exported here), so
a second build on the same machine measures nothing. A one-row exit-kernel measurement that a busy
machine made meaningless (all candidates within noise, far above the bandwidth floor, or taken
under load: :mod:`.prior`) is measured again up to :attr:`KernelTuner.retries` times, then the
fixed prior ranking for this CPU decides; such an entry is cached flagged ``"invalid"`` (never
reused as a measurement: measured again at the first build on a quiet machine).
``river-hf kernels --list`` shows the cache,
``river-hf kernels --remeasure [SHAPE ...]`` drops or re-measures it (:mod:`.cli`).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from .kernel_cache import (DENSE_MODES, FORMAT_VERSION, LOADED_LOAD_FACTOR, LinearSpec, _entry, _entry_problem,  # noqa: F401
                           _key, entry_status, is_loaded, load_average, machine_id, read_cache, update_cache,
                           usable_cpus)
from .prior import cpu_features, invalid_reason, prior_kernel, weight_bytes

__all__ = ["KernelTuner", "LinearSpec", "machine_id", "last_level_cache_bytes", "load_average", "usable_cpus",
           "FORMAT_VERSION", "LOADED_LOAD_FACTOR", "is_loaded", "read_cache", "entry_status", "update_cache"]


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


def _validity_check(spec: LinearSpec, candidates, rows: int):
    """``(timings, load, cpus) -> why invalid | None`` for a choice among weight-only ``candidates``
    (:func:`~river_hf.quant.prior.invalid_reason`); None at ``rows`` > 1 (a prompt-kernel choice is
    bound by arithmetic, not by bytes: no floor applies, and it keeps the load rule of the cache)."""
    if rows != 1:
        return None
    nbytes = min(weight_bytes(spec.in_features, spec.out_features, k.bits) for k in candidates)
    return lambda timings, load, cpus: invalid_reason(timings, nbytes, load, cpus)


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
        on_invalid: None, or a callable ``(shape, why, feature set, kernel)`` run when a one-row
            choice's timings are invalid (:mod:`.prior`) and the prior ranking decides instead.
        last_prior: after :meth:`choose`, ``"<feature set>: <why>"`` when the prior ranking decided
            that choice, else None (:class:`~river_hf.quant.choice.KernelPlan` records it).
        retries, retry_pause_s: an invalid measurement is taken again at most ``retries`` times,
            ``retry_pause_s`` seconds apart (not under load: a 1-minute load average does not
            change in a second), before the prior ranking decides.
    """

    retries = 2
    retry_pause_s = 0.5

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
        self.on_invalid = None
        self.last_prior: str | None = None
        self._measured_here: set[str] = set()
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
        entry replaced. Where one-row timings are invalid (:mod:`.prior`), the kernel is the prior
        ranking's (:func:`~river_hf.quant.prior.prior_kernel`), not the fastest of the timings
        returned, and :attr:`last_prior` says so."""
        by_name = {k.name: k for k in candidates}
        spec = LinearSpec.of(linear)
        entry = self._cached_or_measured(spec, rows, list(by_name), lambda s: self.measure(candidates, s, rows),
                                         _validity_check(spec, candidates, rows))
        timings = dict(entry["timings_us"])
        self.last_prior = None
        why = entry.get("invalid")
        if why is None:
            return by_name[min(timings, key=timings.get)], timings
        features = cpu_features()
        kernel = by_name[prior_kernel(by_name, features)]
        self.last_prior = f"{features}: {why}"
        if self.on_invalid is not None:
            self.on_invalid(spec.shape, why, features, kernel.name)
        return kernel, timings

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
            ValueError: ``rows`` < 1, or a candidate that is not a dense mode.
        """
        if rows < 1:
            raise ValueError(f"rows must be >= 1 for a dense mode choice, got {rows}")
        bad = [c for c in candidates if c not in DENSE_MODES]
        if bad:
            raise ValueError(f"not dense modes: {bad}; expected some of {sorted(DENSE_MODES)}")
        timings = self._cached_or_measured(LinearSpec.of(linear), rows, list(candidates), lambda spec: measure())["timings_us"]
        return min(timings, key=timings.get), dict(timings)

    def _cached_or_measured(self, spec: LinearSpec, rows: int, names: list[str], measure, check=None) -> dict:
        """The trusted cached entry for ``(spec, rows, names)``, else a new one of ``measure(spec)``
        (saved: :meth:`_save`). ``check``: None, or ``(timings, load, cpus) -> why invalid | None``
        (:func:`~river_hf.quant.prior.invalid_reason`); an entry it finds invalid has ``"invalid"``
        set, is measured again when the machine is quiet now (:meth:`_measure_checked`) and used as
        is while it is loaded."""
        key = _key(machine_id(spec.device), spec.shape, spec.dtype_name, spec.bias, names, rows)
        entry = self._choices.get(key)
        if key in self._measured_here:  # measured (and retried) by this tuner already: as it came out
            return entry
        load, cpus = load_average(), usable_cpus()  # now: the trust rule's "quiet now", and a new entry's
        why = "not cached" if entry is None else _entry_problem(key, entry) or entry_status(entry, load, cpus)
        if why is None and check is not None and "invalid" not in entry:  # an entry cached before these rules
            bad = check(entry["timings_us"], entry["load_avg_1m"], entry["cpus"])
            if bad is not None:
                entry = dict(entry, invalid=bad)
                if not is_loaded(load, cpus):
                    why = f"its timings look invalid ({bad}), the machine is quiet now"
        if why is not None:
            if entry is not None:
                self.remeasured[key] = why
            if self.on_measure is not None:
                self.on_measure(spec.shape if rows == 1 else f"{spec.shape} at {rows} rows", spec.dtype_name, why)
            entry = self._measure_checked(spec, rows, names, measure, check)
            self._choices[key] = entry
            self._measured_here.add(key)
            self.measured += 1
            self._save(key, entry)
        return entry

    def _measure_checked(self, spec: LinearSpec, rows: int, names: list[str], measure, check) -> dict:
        """A new entry of ``measure(spec)``, taken again up to :attr:`retries` times while ``check``
        finds it invalid (not when the machine is loaded); flagged ``"invalid"`` (with the kernel
        and the ``"prior"`` feature set of the prior ranking) when the last one still is."""
        for attempt in range(self.retries + 1):
            load, cpus = load_average(), usable_cpus()
            timings = measure(spec)
            bad = None if check is None else check(timings, load, cpus)
            if bad is None or is_loaded(load, cpus) or attempt == self.retries:
                break
            time.sleep(self.retry_pause_s)
        entry = _entry(spec, rows, names, timings, load, cpus)
        if bad is not None:
            features = cpu_features()
            entry.update(invalid=bad, kernel=prior_kernel(names, features), prior=features)
        return entry

    def quiet_now(self) -> bool:
        """Whether the machine is not loaded now (:func:`is_loaded` of the 1-minute load average):
        when a measurement can be trusted, so a saved choice made without one is measured again."""
        return not is_loaded(load_average(), usable_cpus())

    def measure_again(self, entry: dict, measure_modes) -> dict | None:
        """A new cache entry for a cached one (``river-hf kernels --remeasure``): the same shape,
        dtype, bias, candidates and row count, measured now on this machine; None when one of its
        kernels is not available here any more (its library uninstalled, no oneDNN in this torch).

        ``measure_modes(candidates, in_features, out_features, rows) -> {name: µs}`` times an entry
        of dense modes (:func:`river_hf.quant.dense_river.measure_modes`; passed in, since ``dense_river``
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
        return self._measure_checked(spec, rows, entry["candidates"], lambda s: self.measure(candidates, s, rows),
                                     _validity_check(spec, candidates, rows))

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
