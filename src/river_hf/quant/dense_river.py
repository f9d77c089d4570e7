"""``river-fp32``: river-hf's own product of a few fp32 rows with a dense fp32 weight, on the weight as
``nn.Linear`` stores it (no copy).

Why: a decode step multiplies one row (a verify pass a few) by every weight of the model, so it
should read the weights at the memory's rate. torch's ``F.linear`` (MKL) does not always: on a
2-core AVX2 AMD EPYC (torch 2.13) the tuner's own timing of an 896x4864 product with streamed
weights (``RiverFp32Linear.measure``) gave 6482 µs at 16 rows for ``F.linear``, 2993 for prepacked
oneDNN and 2245 for this kernel (at 32 rows 9081, 4741 and 4222); the tuner measures the machine at
hand. The
kernel (``dense_mm`` in ``csrc/river_int4.cpp``, built with river-int4, so AVX2 + FMA) keeps one
8-lane fp32 accumulator per row and output over the input channels, sums its lanes in a fixed
order and reads each block of weight rows once for all the call's rows (blocks of 3 weight rows
times 4 rows in registers, the next block fetched while one computes): a row's result does not
depend on the other rows of the call or on the thread count. Against ``F.linear`` it differs only
by fp32 summation order (relative error ~1e-6).

:class:`RiverFp32Linear` is a ``TorchFunctionMode``, like :class:`~river_hf.quant.dense.PrepackedLinear`,
whose interface it shares (``min_rows``, ``max_rows``, :meth:`~RiverFp32Linear.refresh`,
:meth:`~RiverFp32Linear.with_rows`, ``packed_bytes``): River's backbone layers and lossless
verify passes run in it where the tuner measured it fastest (``river/verify_kernel.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import river_int4
from .autotune import alternating_medians
from .dense import _PLAIN, PrepackedLinear, SmallBatchLinear, _check_rows, _linear_args, _streamed_weights, onednn_available

__all__ = ["RiverFp32Linear", "river_fp32_works", "measure_modes", "MAX_ROWS"]

#: most rows the kernel is offered: a default lossless verify (``max_draft_tokens`` 15 + 1). It turns
#: compute-bound long before (16 rows of 896x4864 ran at ~3/4 of the FLOP rate prepacked oneDNN reached at
#: 128 rows on the CPU above); wide calls (prompts, batched verifies) go to a kernel measured at their rows
MAX_ROWS = 16


def river_fp32_works() -> bool:
    """Whether the kernel can run here (river-int4's extension builds and checks:
    :func:`~river_hf.quant.river_int4.works`; False with ``RIVER_HF_NO_EXTENSIONS=1``)."""
    return river_int4.works()


def _eligible_weight(w) -> bool:
    return (w is not None and type(w) in _PLAIN and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.dim() == 2 and w.is_contiguous())


class RiverFp32Linear(TorchFunctionMode):
    """Compute fp32 CPU ``F.linear`` calls of ``min_rows..max_rows`` rows on the weights of
    ``linears`` with river-hf's ``dense_mm`` (module docstring); every other call goes to
    ``fallback`` (another mode of this interface, e.g. a :class:`~river_hf.quant.dense.PrepackedLinear`
    for prompt passes) or, without one, to ``F.linear`` untouched.

    Inside the mode, ``F.linear(x, W, b)`` with ``x: float32 [..., in]`` on CPU, ``W`` the current
    weight of one of ``linears`` (fp32, CPU, contiguous ``[out, in]``) and ``b`` None or float32
    ``[out]`` returns ``float32 [..., out]``. The weights are read where they are, so a changed
    weight is used as it is now; :meth:`refresh` picks up Linears whose weight was replaced by a new
    Parameter (River runs it at the start of every call, as for the packed copy). No memory is added.

    Args:
        linears: the ``nn.Linear`` modules whose calls may be rerouted (others' weights never are).
        min_rows: 1 (every call from one row) or 2 (multi-row calls only).
        max_rows: most rows rerouted (default :data:`MAX_ROWS`); may be 1 when ``min_rows`` is 1.
        fallback: the mode that takes the calls this one does not, or None.

    Raises:
        RuntimeError: the kernel cannot run here (:func:`river_fp32_works` is False).
        ValueError: ``min_rows`` is not 1 or 2, or ``max_rows`` is not an int >= ``min_rows``.
    """

    def __init__(self, linears, min_rows: int = 1, max_rows: int = MAX_ROWS, fallback=None):
        super().__init__()
        if not river_fp32_works():
            raise RuntimeError(f"river-fp32 cannot run here: {river_int4.unavailable_reason()}")
        _check_rows(min_rows, max(2, max_rows))
        if max_rows < min_rows:
            raise ValueError(f"max_rows must be >= min_rows ({min_rows}), got {max_rows!r}")
        self.min_rows, self.max_rows, self.fallback = min_rows, max_rows, fallback
        self._linears = list(linears)
        self._ext = river_int4.extension()
        self.calls_rerouted = 0
        self.refresh()

    def refresh(self) -> int:
        """Take the Linears' current weights (a replaced Parameter included) and refresh the
        fallback; returns what the fallback's refresh returned (weights repacked), else 0."""
        self._weights = {id(m.weight): m.weight for m in self._linears if _eligible_weight(getattr(m, "weight", None))}
        refresh = getattr(self.fallback, "refresh", None)
        return refresh() if refresh is not None else 0

    def with_rows(self, *, min_rows: int | None = None, max_rows: int | None = None) -> "RiverFp32Linear":
        """The same mode (same Linears and fallback) for ``min_rows..max_rows`` rows (each defaults
        to this mode's). Raises ValueError as the constructor."""
        view = RiverFp32Linear.__new__(RiverFp32Linear)
        TorchFunctionMode.__init__(view)
        view.min_rows = self.min_rows if min_rows is None else min_rows
        view.max_rows = self.max_rows if max_rows is None else max_rows
        _check_rows(view.min_rows, max(2, view.max_rows))
        if view.max_rows < view.min_rows:
            raise ValueError(f"max_rows must be >= min_rows ({view.min_rows}), got {view.max_rows!r}")
        view.fallback, view._linears, view._weights, view._ext = self.fallback, self._linears, self._weights, self._ext
        view.calls_rerouted = 0
        return view

    @property
    def packed_bytes(self) -> int:
        """Bytes of memory the mode adds: none of its own; the fallback's packed copy, if any."""
        return getattr(self.fallback, "packed_bytes", 0)

    def __len__(self) -> int:
        return len(self._weights)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = _linear_args(func, args, kwargs)
        if call is not None:
            x, weight, bias = call
            if (self._weights.get(id(weight)) is weight and _eligible_weight(weight) and type(x) in _PLAIN
                    and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() and x.shape[-1] == weight.shape[1]
                    and (bias is None or (type(bias) in _PLAIN and bias.dtype == torch.float32 and bias.dim() == 1))):
                rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
                if self.min_rows <= rows <= self.max_rows:
                    self.calls_rerouted += 1
                    return self._ext.dense_mm(x, weight, bias)
        if self.fallback is not None:
            return self.fallback.__torch_function__(func, types, args, kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def measure(in_features: int, out_features: int, rows: int, *, stream_bytes: int | None = None,
                rounds: int = 5, grid: bool = False) -> dict[str, float]:
        """Median µs per call of ``F.linear``, of the prepacked oneDNN linear (where this torch has
        oneDNN) and of ``river-fp32`` on ``rows`` fp32 rows of a ``[out_features, in_features]``
        weight, weights streamed from memory (copies totalling ``stream_bytes``, default twice the
        last-level cache), alternating from round to round. With ``grid``, also ``river-grid``
        (:mod:`~river_hf.quant.grid`) on the same weights held as a Q4_K-like grid (int8 values,
        fp32 scale and offset per 32 input channels; as many copies).

        Returns:
            ``{"torch": µs, "onednn": µs, "river-fp32": µs}`` (no ``onednn`` without oneDNN), with
            ``"river-grid"`` when ``grid``.

        Raises:
            RuntimeError: the kernel cannot run here.
        """
        if not river_fp32_works():
            raise RuntimeError(f"river-fp32 cannot run here: {river_int4.unavailable_reason()}")
        ext = river_int4.extension()
        weights = _streamed_weights(in_features, out_features, stream_bytes)
        x = torch.randn(rows, in_features)
        runs = {"torch": lambda: [F.linear(x, w) for w in weights],
                "river-fp32": lambda: [ext.dense_mm(x, w, None) for w in weights]}
        if grid:
            from .grid import GridWeight

            group = 32 if in_features % 32 == 0 else 16
            grids = [GridWeight(torch.randint(0, 16, (out_features, in_features), dtype=torch.int8),
                                torch.rand(out_features, in_features // group) * 1e-2,
                                torch.rand(out_features, in_features // group) * 1e-2) for _ in weights]
            runs["river-grid"] = lambda: [g.mm(x) for g in grids]
        if onednn_available():
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
            runs["onednn"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]
        return alternating_medians(runs, rounds, len(weights))


def measure_modes(candidates, in_features: int, out_features: int, rows: int, **kwargs) -> dict[str, float]:
    """Time the dense modes ``candidates`` names on ``rows`` fp32 rows of an ``in_features x
    out_features`` Linear: ``{"torch", "onednn"}`` by :meth:`PrepackedLinear.measure`, with ``river-fp32``
    by :meth:`~river_hf.quant.dense_river.RiverFp32Linear.measure`, ``{"torch",
    "small-batch"}`` by :meth:`SmallBatchLinear.measure` (``kwargs`` go to it). Used to measure a cached
    entry of :meth:`~river_hf.quant.autotune.KernelTuner.choose_mode` again (``river-hf kernels
    --remeasure``).

    Returns:
        ``{name: median µs per call}``.

    Raises:
        ValueError: another set of names.
        RuntimeError: ``onednn`` named and no oneDNN in this torch; ``river-fp32`` named and its kernel
            cannot run here.
    """
    names = set(candidates)
    if "river-fp32" in names and names <= {"torch", "onednn", "river-fp32", "river-grid"}:
        timings = RiverFp32Linear.measure(in_features, out_features, rows, grid="river-grid" in names, **kwargs)
        if not names <= set(timings):
            raise RuntimeError("this torch build has no oneDNN (torch.ops.mkldnn)")
        return {k: timings[k] for k in names}
    if names == {"torch", "onednn"}:
        return PrepackedLinear.measure(in_features, out_features, rows, **kwargs)
    if names == {"torch", "small-batch"}:
        return SmallBatchLinear.measure(in_features, out_features, rows, **kwargs)
    raise ValueError(f"no measurement times the dense modes {sorted(names)}")
