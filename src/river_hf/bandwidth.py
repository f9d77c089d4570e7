"""The machine's memory bandwidth, the figure every achieved GB/s of river-hf is a share of.

:func:`stream_bandwidth` measures STREAM-like copy and triad bandwidth with torch ops, once per
timed run (:func:`river_hf.timing.compare`), at the run's thread count; :func:`stream_line` is the
line that names it under a table. A sustained-bandwidth benchmark, not a hard limit: a decode step
can come near it or pass it. Re-exported by :mod:`river_hf.timing`.
"""

from __future__ import annotations

import time

__all__ = ["stream_bandwidth", "memory_bandwidth_gb_s", "stream_line"]


def stream_bandwidth(nbytes: int | None = None, repeats: int = 5, threads: int | None = None) -> dict:
    """STREAM-like copy and triad bandwidth of this machine (GB/s, 1e9 bytes/s), torch ops.

    Three float32 arrays ``a``, ``b``, ``c`` of ``nbytes`` each (default: twice the last-level cache,
    at least 128 MiB and at most 1 GiB, so the three together are 6x the cache and every pass streams
    from memory; on a GPU 1 GiB); copy is ``c[:] = a`` (2 arrays moved per
    element), triad is ``a[:] = b + s * c`` (3 arrays), counted as STREAM counts them (no
    write-allocate traffic). Each figure is the best of ``repeats`` timed passes after one untimed
    pass (STREAM's rule). It runs at ``threads`` (default: torch's current thread count, i.e. the
    run's), and on the GPU when one is available. A sustained-bandwidth benchmark, not a limit.

    Returns:
        ``{"copy_gb_s", "triad_gb_s", "threads", "array_bytes", "device"}``.
    """
    import torch

    from .quant import last_level_cache_bytes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    nbytes = nbytes or (1 << 30 if device == "cuda" else min(max(128 << 20, 2 * last_level_cache_bytes()), 1 << 30))
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        n = max(nbytes // 4, 1)
        a = torch.full((n,), 1.0, dtype=torch.float32, device=device)
        b = torch.full((n,), 2.0, dtype=torch.float32, device=device)
        c = torch.zeros(n, dtype=torch.float32, device=device)

        def best(op) -> float:
            op()
            times = []
            for _ in range(repeats):
                if device == "cuda":  # pragma: no cover - needs a GPU
                    torch.cuda.synchronize()
                t = time.perf_counter()
                op()
                if device == "cuda":  # pragma: no cover - needs a GPU
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            return min(times)

        copy_s = best(lambda: c.copy_(a))
        triad_s = best(lambda: torch.add(b, c, alpha=3.0, out=a))
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    return {"copy_gb_s": 2 * n * 4 / copy_s / 1e9, "triad_gb_s": 3 * n * 4 / triad_s / 1e9, "threads": used,
            "array_bytes": n * 4, "device": device}


def memory_bandwidth_gb_s(nbytes: int | None = None, repeats: int = 5) -> float:
    """The STREAM triad figure of :func:`stream_bandwidth` (GB/s). Kept under its old name for
    callers that still use it; it used to be a 2-thread read-reduce (``sum()``), which
    underestimated what a decode step can reach. Print it as "STREAM triad GB/s"."""
    return stream_bandwidth(nbytes, repeats)["triad_gb_s"]


def stream_line(triad: float, copy: float | None = None, threads: int | None = None) -> str:
    """The printed line that names the bandwidth figure shares are taken of."""
    return (f"STREAM triad GB/s of this machine: {triad:.1f}" + (f" (copy {copy:.1f})" if copy else "")
            + (f", {threads} threads" if threads else "")
            + "; a sustained-bandwidth benchmark, not a hard limit")
