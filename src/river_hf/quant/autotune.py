"""Pick the fastest weight-only kernel for a Linear's shape by measuring it on this machine.

Kernel rankings change from one CPU to the next (an AVX2-only machine, an AVX-512/AMX one with a
300 MB L3 ...), so no table written on another machine decides. :class:`KernelTuner` times each
candidate kernel on random weights of the Linear's shape, at the decode shape (one token, the
model's dtype at the boundary, casts included), with its weights **streamed from memory**: each
candidate is built as many separate copies as it takes to read twice the last-level cache per
round, and a round calls each copy once, because a decode step reads every weight of the model
once and no Linear finds its weights in cache. Candidates alternate from round to round; the
median over rounds decides.

Choices are cached per machine and shape in ``$RIVER_HF_CACHE/kernels.json`` (default
``~/.cache/river_hf``), keyed by CPU model, torch version, thread count, shape, dtype and the
candidate set, so a second build on the same machine measures nothing. The file is rewritten
atomically (temp file + rename).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

__all__ = ["KernelTuner", "machine_id", "last_level_cache_bytes"]


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


class KernelTuner:
    """Measures candidate kernels per Linear shape and remembers the winner.

    Args:
        cache_file: JSON file of earlier choices (None: ``$RIVER_HF_CACHE/kernels.json``;
            ``False``: keep nothing on disk).
        rounds: timed rounds per candidate (median taken); one round calls every copy once.
        stream_bytes: weight bytes one round reads: each candidate is built that many times over
            (separate copies, called in turn) so its weights come from memory, not cache, as in a
            decode step (default: twice the last-level cache, at most 1 GiB).
        max_copies: at most this many copies per candidate.

    Attributes:
        measured: how many shapes were measured (not found in the cache) by this tuner.
    """

    def __init__(self, cache_file: str | Path | None | bool = None, *, rounds: int = 7, stream_bytes: int | None = None,
                 max_copies: int = 64):
        if cache_file is None:
            from ..models import cache_dir

            cache_file = cache_dir() / "kernels.json"
        self.cache_file = Path(cache_file) if cache_file else None
        self.rounds = rounds
        self.stream_bytes = stream_bytes or min(2 * last_level_cache_bytes(), 1 << 30)
        self.max_copies = max_copies
        self.measured = 0
        self._choices = self._load()

    def _load(self) -> dict:
        if self.cache_file is None or not self.cache_file.is_file():
            return {}
        try:
            data = json.loads(self.cache_file.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}  # a damaged cache is measured again, not trusted

    def _save(self) -> None:
        if self.cache_file is None:
            return
        from ..eval.common import write_json

        try:
            write_json(self.cache_file, self._choices)
        except OSError:
            pass  # a read-only cache folder only costs a measurement next time

    def choose(self, candidates, linear: nn.Linear) -> tuple:
        """The fastest of ``candidates`` (:class:`~river_hf.quant.kernels.WeightOnlyKernel`) for
        ``linear``'s shape and dtype; returns ``(kernel, {kernel name: µs per call})``."""
        by_name = {k.name: k for k in candidates}
        key = "|".join([machine_id(linear.weight.device), f"{linear.in_features}x{linear.out_features}",
                        str(linear.weight.dtype).removeprefix("torch."), f"bias={linear.bias is not None}",
                        ",".join(sorted(by_name))])
        timings = self._choices.get(key)
        if not timings or set(timings) != set(by_name):
            timings = self.measure(candidates, linear)
            self._choices[key] = timings
            self.measured += 1
            self._save()
        best = min(timings, key=timings.get)
        return by_name[best], dict(timings)

    def measure(self, candidates, linear: nn.Linear) -> dict[str, float]:
        """Median µs per one-token call of each candidate, weights streamed from memory, candidates
        alternating from one round to the next."""
        device, dtype = linear.weight.device, linear.weight.dtype
        gen = torch.Generator(device="cpu").manual_seed(0)
        probe = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        probe = probe.to_empty(device=device).to(dtype)
        with torch.no_grad():
            probe.weight.copy_(torch.randn(probe.weight.shape, generator=gen).to(dtype) * 0.02)
            if probe.bias is not None:
                probe.bias.zero_()
            built = [(k.name, self._copies(k, probe)) for k in candidates]
        del probe
        x = torch.randn(1, 1, linear.in_features, generator=gen).to(device=device, dtype=dtype)
        times: dict[str, list[float]] = {name: [] for name, _ in built}
        with torch.no_grad():
            for _, copies in built:  # warm-up: first-call allocations, lazy packing
                copies[0](x)
            for i in range(self.rounds):
                for name, copies in built if i % 2 == 0 else built[::-1]:
                    if device.type == "cuda":  # pragma: no cover - needs a GPU
                        torch.cuda.synchronize(device)
                    t = time.perf_counter()
                    for m in copies:
                        m(x)
                    if device.type == "cuda":  # pragma: no cover - needs a GPU
                        torch.cuda.synchronize(device)
                    times[name].append((time.perf_counter() - t) / len(copies))
        return {name: statistics.median(ts) * 1e6 for name, ts in times.items()}

    def _copies(self, kernel, probe: nn.Linear) -> list[nn.Module]:
        """Enough separate copies of the kernel's module that one pass over them reads
        ``stream_bytes`` of weights (a decode step reads every weight once: none stays in cache)."""
        from .kernels import linear_weight_bytes

        first = kernel.build(probe)
        n = max(1, -(-self.stream_bytes // max(linear_weight_bytes(first), 1)))
        n = min(n, self.max_copies)
        return [first] + [kernel.build(probe) for _ in range(n - 1)]


def default_tuner() -> KernelTuner | None:
    """The tuner used by ``enable_river``; ``RIVER_HF_AUTOTUNE=0`` turns measurement off (the first
    candidate is then taken)."""
    if os.environ.get("RIVER_HF_AUTOTUNE", "1") == "0":
        return None
    return KernelTuner()
