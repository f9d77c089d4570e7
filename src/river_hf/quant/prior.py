"""When a kernel measurement cannot be trusted, and what decides then: the prior ranking per CPU.

A busy machine fools a timing: with a 1-minute load of 5 on 2 cores every int4 candidate of every
exit shape measured 19.9-20.1 ms per call (the scheduler's time slice, 100-1000x the quiet figure),
and the fastest by that measurement was 2-5x slower than tinygemm on the quiet machine (issue 38).
:func:`invalid_reason` says why a one-row exit-kernel measurement is **invalid**; any one of:

- **load**: the 1-minute load average was above ``LOADED_LOAD_FACTOR x cores`` when it started
  (:func:`~river_hf.quant.kernel_cache.is_loaded`): the candidates competed for the CPU.
- **all within noise**: the slowest candidate is within :data:`TIE_SPREAD` (2 %) of the fastest.
  The candidates are different kernels (different packing, different instructions); quiet, they
  differ by 5 % to 3x per shape (docs/river.md), so equal times mean the time measured was not
  theirs (a time slice, a page-fault storm). A true tie misjudged costs under 2 %.
- **far above the bandwidth floor**: the fastest is above ``FLOOR_FACTOR x bytes /
  FLOOR_BANDWIDTH + CALL_OVERHEAD_US``, ``bytes`` the packed weight bytes a call reads (``in x out x
  bits / 8``, scales left out: a lower bound). :data:`FLOOR_BANDWIDTH` (100 GB/s) is above the STREAM
  triad of every machine measured so far (20.8-30.7 GB/s on the 2-core Xeons, 40-58 GB/s on the
  2-core EPYC; ``river-hf bench``, docs/river.md), so ``bytes / FLOOR_BANDWIDTH`` is less than any
  call can take; :data:`FLOOR_FACTOR` 50 still admits a kernel streaming 2 GB/s (the slowest seen:
  tinygemm int4 on AVX2 at ~4 GB/s, docs/lossless.md); :data:`CALL_OVERHEAD_US` (1 ms) covers
  the fixed cost of a call on small shapes. A constant, not a STREAM run per build: it must cost
  nothing, and only a gross outlier (a time slice) has to be caught.

The tuner (:class:`~river_hf.quant.autotune.KernelTuner`) measures an invalid shape again up to
``retries`` times after a short pause (not under load: a 1-minute average does not change in a
second), then takes :func:`prior_kernel`: the first candidate in :data:`PRIOR_RANKING` for this
CPU's feature set (:func:`cpu_features`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .kernel_cache import LOADED_LOAD_FACTOR, is_loaded

__all__ = ["TIE_SPREAD", "FLOOR_BANDWIDTH", "FLOOR_FACTOR", "CALL_OVERHEAD_US", "PRIOR_RANKING", "cpu_features", "features_of",
           "weight_bytes", "invalid_reason", "prior_kernel"]

#: candidates whose slowest is within this share of the fastest were not told apart
TIE_SPREAD = 0.02
#: bytes/s no CPU river-hf runs on streams weights faster than (the floor's bandwidth)
FLOOR_BANDWIDTH = 100e9
#: how far above the bandwidth floor a quiet call may still be (a kernel at 2 GB/s passes)
FLOOR_FACTOR = 50
#: µs a call may take on top, whatever its bytes (launch, casts, small shapes)
CALL_OVERHEAD_US = 1000.0

#: The kernel order per CPU feature set when no measurement can decide (the first candidate of a
#: choice found in it wins; kernels not listed come after, in the choice's own order). Sources:
#: AVX-512/AMX (Xeon): ``int4`` measured per shape chose ARK for all but one shape, tinygemm there,
#: ``ark-int4`` 1.04x ``torch-int4`` in the decode step; int8: fbgemm dynamic 254 µs against
#: ``_weight_int8pack_mm``'s 390 for 896x4864 (docs/river.md, "The exit path"). AVX-512 without AMX
#: (Zen 4): tinygemm for every shape, quanto 1.3x, ARK 2.7-3.2x slower (docs/river.md, "On a 2-core
#: AMD EPYC"). AVX2 only (Zen 3): tinygemm among the libraries' kernels (docs/lossless.md, the AVX2 EPYC run). int8 off AMX: no
#: measurement on record; torch's own op, the ``int8`` choice's first candidate. ``river-int4`` (river-hf's
#: own): 3-4x tinygemm per call on every Qwen2.5-Coder-0.5B exit shape on the AVX-512 EPYC (Zen 5, its
#: VNNI build) and 2.2-2.7x on the AVX2 EPYC (Zen 1, its AVX2 build; the tuner's timings in kernels.json
#: and results/epyc-zen1-2core, docs/river.md); on the AMX Xeon not measured, so after ARK.
PRIOR_RANKING: dict[str, tuple[str, ...]] = {
    "AVX-512/AMX": ("ark-int4", "river-int4", "torch-int4", "quanto-int4", "torch-dyn-int8", "torch-int8", "ark-int8", "quanto-int8"),
    "AVX-512": ("river-int4", "torch-int4", "quanto-int4", "ark-int4", "torch-int8", "torch-dyn-int8", "quanto-int8", "ark-int8"),
    "AVX2": ("river-int4", "torch-int4", "quanto-int4", "ark-int4", "torch-int8", "torch-dyn-int8", "quanto-int8", "ark-int8"),
    "baseline": (),
}


@functools.lru_cache(maxsize=1)
def cpu_features() -> str:
    """This CPU's feature set, a key of :data:`PRIOR_RANKING`: ``"AVX-512/AMX"``, ``"AVX-512"``,
    ``"AVX2"`` or ``"baseline"``, from the ``flags`` of ``/proc/cpuinfo`` (``amx_tile``,
    ``avx512f``, ``avx2``), else torch's CPU capability (``torch.backends.cpu.get_cpu_capability``;
    it cannot tell AMX)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    if not flags:
        capability = torch.backends.cpu.get_cpu_capability().upper()
        flags = {"avx512f", "avx2"} if "AVX512" in capability else {"avx2"} if "AVX2" in capability else set()
    return features_of(flags)


def features_of(flags) -> str:
    """The :data:`PRIOR_RANKING` key of a CPU with these ``/proc/cpuinfo`` flags."""
    flags = set(flags)
    if "avx512f" in flags:
        return "AVX-512/AMX" if "amx_tile" in flags else "AVX-512"
    return "AVX2" if "avx2" in flags else "baseline"


def weight_bytes(in_features: int, out_features: int, bits: int) -> int:
    """Packed weight bytes one call reads, scales and zero points left out (a lower bound)."""
    return in_features * out_features * bits // 8


def invalid_reason(timings: dict[str, float], nbytes: int, load: float | None, cpus: int) -> str | None:
    """Why a one-row measurement is invalid (module docstring), None when it is not.

    Args:
        timings: ``{kernel name: µs per call}`` of two or more candidates.
        nbytes: the fewest weight bytes a candidate reads (:func:`weight_bytes`).
        load: the 1-minute load average when the measurement started (None: unknown).
        cpus: the cores the process may run on.

    Returns:
        e.g. ``"all candidates within 0.8 %; the fastest, 20000 µs, 20x the bandwidth-floor limit of
        1022 µs; load 5.0 on 2 cores (over 1.25 per core)"``, or None.
    """
    reasons = []
    fastest, slowest = min(timings.values()), max(timings.values())
    if len(timings) > 1 and slowest <= fastest * (1 + TIE_SPREAD):
        reasons.append(f"all candidates within {(slowest / fastest - 1) * 100:.1f} %")
    limit = FLOOR_FACTOR * nbytes / FLOOR_BANDWIDTH * 1e6 + CALL_OVERHEAD_US
    if fastest > limit:
        reasons.append(f"the fastest, {fastest:.0f} µs, {fastest / limit:.0f}x the bandwidth-floor limit of {limit:.0f} µs")
    if is_loaded(load, cpus):
        reasons.append(f"load {load:.1f} on {cpus} cores (over {LOADED_LOAD_FACTOR} per core)")
    return "; ".join(reasons) or None


def prior_kernel(names, features: str | None = None) -> str:
    """The kernel of ``names`` (candidate names, in the choice's order) that :data:`PRIOR_RANKING`
    puts first for ``features`` (default :func:`cpu_features`); the first of ``names`` when the
    ranking names none of them."""
    names = list(names)
    ranking = PRIOR_RANKING.get(features or cpu_features(), ())
    return next((n for n in ranking if n in names), names[0])
