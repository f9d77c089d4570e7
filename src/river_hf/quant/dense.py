"""Dense fp32 Linear kernels for multi-row calls on CPU: a faster GEMM orientation, prepacked oneDNN.

The dense members of river-hf's one kernel package (:mod:`river_hf.quant`); which of them a call
site uses is measured by the package's one tuner (:meth:`~river_hf.quant.autotune.KernelTuner.choose_mode`).

A forward over a few tokens (R-Stitch's partial prefill of 2-16 tokens, the verify step of
assisted generation) calls each Linear with an input of ``rows`` = 2..64 tokens. On CPU, torch's
fp32 ``F.linear`` (MKL ``sgemm`` on ``x @ W.T``) runs such shapes 1.5-2.9x slower than computing
the same product as ``(W @ x.T).T``, measured on this project's 2-core AMD EPYC with torch 2.13:
at ``rows`` = 4 a 1536→8960 Linear reads its weights at ~4 GB/s instead of ~15 GB/s, so a 4-token
forward of a 1.5B model costs 2.3-2.7 one-token decode steps instead of about one (see
``benchmarks/small_batch_linear.py`` and docs/stitch.md). One token (``rows`` = 1) is a GEMV and
is already fast; bf16 shows no such gap, and from ~128 rows on the stock path is as fast or faster.

:class:`SmallBatchLinear` is a ``TorchFunctionMode``: inside ``with SmallBatchLinear():`` every
``F.linear`` call whose input is fp32 on CPU with 2..``max_rows`` rows is computed as
``torch.mm(W, x.T).T`` (+ bias); every other call (an ``out=`` argument, CPU autocast on, mixed
dtypes or devices) is passed through untouched. No module is
modified, so the models, their hooks (accelerate offload) and their saved weights are as they were.
The result equals ``F.linear``'s up to fp32 summation order (relative error ~1e-7).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .autotune import alternating_medians, last_level_cache_bytes

__all__ = ["SmallBatchLinear", "PrepackedLinear", "WeightFingerprint", "onednn_available", "linear_mode_hooks"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _linear_args(func, args, kwargs):
    """``(x, weight, bias)`` of an ``F.linear`` call a mode of this package may reroute, else None
    (another function, an ``out=`` argument, or CPU autocast on: those calls pass through)."""
    if func is not F.linear or "out" in kwargs or torch.is_autocast_enabled("cpu"):  # F.linear is torch._C._nn.linear
        return None
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return x, weight, bias


def linear_mode_hooks(linears, pick) -> list:
    """Forward hooks that run each of ``linears`` (``nn.Linear``) inside the ``TorchFunctionMode``
    ``pick()`` returns at its call (None: no mode); returns the handles to remove.

    Why per Linear: a mode entered around a whole decoder layer sends every op of the layer (norms,
    rotary, attention, views: ~70 per Qwen2 layer) through its Python ``__torch_function__``. On the
    2-core AVX2 AMD EPYC, a one-token step of the plain 0.5B model on river-fp32 took 155.6 ms
    (151.6-165.7) with the mode around the whole forward and 149.8 ms (149.6-154.1) with it entered
    around each Linear only (206.3 ms on plain ``F.linear``; ``benchmarks/probes/mode_scope.py``, 5
    alternating rounds). The modes reroute only their own Linears' ``F.linear`` calls, so the two
    scopes compute the same thing. The exit hook runs even when the forward raises; each thread keeps its
    own record of the modes it entered."""
    local = threading.local()

    def enter(module, args):
        mode = pick()
        if mode is not None:
            mode.__enter__()
        local.__dict__.setdefault("entered", []).append(mode)

    def leave(module, args, output=None):
        entered = local.__dict__.get("entered")
        mode = entered.pop() if entered else None
        if mode is not None:
            mode.__exit__(None, None, None)

    return [h for m in linears for h in (m.register_forward_pre_hook(enter),
                                         m.register_forward_hook(leave, always_call=True))]


class SmallBatchLinear(TorchFunctionMode):
    """Compute fp32 CPU ``F.linear`` calls of 2..``max_rows`` rows as ``(W @ x.T).T``.

    Args:
        max_rows: largest number of input rows (tokens × batch) that is rerouted (default 64;
            at 128 rows and above MKL's own orientation is as fast or faster on the measured CPU).

    Inside the mode, a call ``F.linear(x, W, b)`` with ``x: float32 [..., in_features]`` on CPU,
    ``W: float32 [out_features, in_features]`` and ``2 <= x.numel() // in_features <= max_rows``
    returns ``float32 [..., out_features]`` (contiguous), computed as ``torch.mm(W, x2d.T).T + b``.
    Anything else (one row, other dtypes or devices, quantized weights) goes to ``F.linear``.

    Raises:
        ValueError: ``max_rows`` is not an int >= 2.
    """

    DEFAULT_MAX_ROWS = 64

    def __init__(self, max_rows: int = DEFAULT_MAX_ROWS):
        super().__init__()
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 2:
            raise ValueError(f"max_rows must be an int >= 2, got {max_rows!r}")
        self.max_rows = max_rows
        self.calls_rerouted = 0

    def _eligible(self, x, weight, bias) -> bool:
        if not all(t is None or type(t) in _PLAIN for t in (x, weight, bias)):
            return False  # tensor subclasses (quantized weights) keep their own kernels
        if any(t is not None and (t.device.type != "cpu" or t.dtype != torch.float32) for t in (x, weight, bias)):
            return False  # F.linear itself decides (and raises) for mixed devices or dtypes
        if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
            return False
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return 2 <= rows <= self.max_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = _linear_args(func, args, kwargs)
        if call is not None:
            x, weight, bias = call
            if self._eligible(x, weight, bias):
                self.calls_rerouted += 1
                x2d = x.reshape(-1, x.shape[-1])
                out = torch.mm(weight, x2d.t()).t().contiguous()
                if bias is not None:
                    out += bias
                return out.reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)

    @staticmethod
    def measure(in_features: int, out_features: int, rows: int, *, stream_bytes: int | None = None,
                rounds: int = 5) -> dict[str, float]:
        """Median µs per call of ``F.linear`` and of this mode's ``(W @ x.T).T`` on ``rows`` fp32 rows
        of a ``[out_features, in_features]`` weight, weights streamed from memory (copies totalling
        ``stream_bytes``, default twice the last-level cache), the two alternating from round to round.

        Returns:
            ``{"torch": µs, "small-batch": µs}``.
        """
        weights = _streamed_weights(in_features, out_features, stream_bytes)
        x = torch.randn(rows, in_features)
        return alternating_medians({
            "torch": lambda: [F.linear(x, w) for w in weights],
            "small-batch": lambda: [torch.mm(w, x.t()).t().contiguous() for w in weights],
        }, rounds, len(weights))  # fmt: skip


def _streamed_weights(in_features: int, out_features: int, stream_bytes: int | None, max_copies: int = 64):
    """Separate random fp32 weights ``[out, in]`` totalling ``stream_bytes`` (default twice the
    last-level cache; 2..``max_copies`` copies), so that one pass over them reads from memory, as a
    forward pass over a model too big for the cache does."""
    size = in_features * out_features * 4
    copies = min(max_copies, max(2, -(-(stream_bytes or 2 * last_level_cache_bytes()) // size)))
    return [torch.randn(out_features, in_features) for _ in range(copies)]


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's prepacked fp32 linear (``torch.ops.mkldnn``)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and ops is not None
                    and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
    except (AttributeError, RuntimeError):  # pragma: no cover - torch builds without oneDNN
        return False


_SAMPLE = 256  # weight elements compared per packed weight by PrepackedLinear.refresh


class WeightFingerprint:
    """What a derived copy of a weight (a packed or quantized copy) was made from: the tensor
    object, its version counter, storage address, shape and dtype, and the values at
    ``_SAMPLE`` evenly spaced positions.

    :meth:`matches` tells whether the weight still holds those values. The version counter catches
    in-place changes through the tensor (``load_state_dict``, ``copy_``), the storage address
    ``param.data = ...``; an in-place change through ``param.data`` (PEFT's merge does that)
    bypasses the version counter, which the sampled values catch (a merged LoRA delta is dense).
    Costs one gather of ``_SAMPLE`` values.
    """

    __slots__ = ("weight", "version", "ptr", "shape", "dtype", "index", "sample")

    def __init__(self, weight: torch.Tensor):
        w = weight.detach()
        self.weight = weight
        self.version = weight._version
        self.ptr = weight.data_ptr()
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        n = w.numel()
        k = min(n, _SAMPLE)  # evenly spaced, in int64 (a float32 linspace rounds past the end of a 136M-element head)
        self.index = torch.arange(k, dtype=torch.long, device=w.device) * max(n - 1, 0) // max(k - 1, 1)
        self.sample = w.reshape(-1)[self.index].clone()

    def same_tensor(self, weight: torch.Tensor) -> bool:
        """The cheap part (no read of values): same object, version counter and storage."""
        return self.weight is weight and weight._version == self.version and weight.data_ptr() == self.ptr

    def matches(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` still holds the values the fingerprint was taken of (see the class)."""
        return (self.same_tensor(weight) and tuple(weight.shape) == self.shape and weight.dtype == self.dtype
                and torch.equal(weight.detach().reshape(-1)[self.index], self.sample))


class _Packed(WeightFingerprint):
    """One packed weight and the :class:`WeightFingerprint` of what it was packed from."""

    __slots__ = ("packed",)

    def __init__(self, weight: torch.Tensor, rows_hint: int):
        super().__init__(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)

    def fresh(self, weight: torch.Tensor) -> bool:
        return self.matches(weight)


def _packable(linear) -> bool:
    w = getattr(linear, "weight", None)
    return (w is not None and type(w) in _PLAIN and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.dim() == 2)


def _check_rows(min_rows, max_rows) -> None:
    """:class:`PrepackedLinear`'s row bounds, or ValueError."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 2:
        raise ValueError(f"max_rows must be an int >= 2, got {max_rows!r}")
    if type(min_rows) is not int or min_rows not in (1, 2):
        raise ValueError(f"min_rows must be 1 (every call) or 2 (multi-row calls only), got {min_rows!r}")


class PrepackedLinear(TorchFunctionMode):
    """Compute fp32 CPU ``F.linear`` calls of 2..``max_rows`` rows with oneDNN on weights packed
    once, ahead of time, in its own blocked layout.

    Why: a verify forward of speculative decoding runs every backbone Linear on k+1 = 2..16 tokens.
    torch's ``F.linear`` (MKL sgemm) repacks the weight on every such call, so it streams weights
    at about half the speed of a one-token GEMV (measured on a 2-core Xeon with AMX, torch 2.13,
    896→4864: 26 GB/s at 1 row, 13.4 at 4, 8.7 at 8); oneDNN on a prepacked copy reads them at
    21 GB/s at 4 rows, 15 at 8 (``benchmarks/verify_linear.py``) (:meth:`measure` times both on the
    machine at hand, and River's lossless mode uses this mode only where it measured faster and the
    copy fits in memory). The cost is a second copy of the packed weights in memory (as many bytes
    as the fp32 weights, :attr:`packed_bytes`).

    The packed copies follow the weights: a call reroutes only when the weight is still the tensor
    it was packed from with the same version counter and storage (else it goes to ``F.linear``,
    exact), and :meth:`refresh` (River runs it at the start of every lossless call) repacks every
    weight whose tensor, version, storage, shape or sampled values changed since it was packed
    (``load_state_dict``, ``param.data = ...``, a PEFT merge through ``weight.data``), and packs
    Linears whose weight was replaced by a new Parameter.

    Args:
        linears: the ``nn.Linear`` modules whose weights are packed (fp32, on CPU; others skipped).
        max_rows: largest number of input rows (tokens × batch) that is rerouted (default 64).
        rows_hint: the row count oneDNN tunes the packed layout for (default 8).
        min_rows: smallest number of rows that is rerouted: 2 (the default: a verify pass's rows;
            one-row calls stay on ``F.linear``) or 1 (every call up to ``max_rows``: on the 2-core
            AMD EPYC (Zen 4) machine MKL's one-row fp32 product read 896x4864 weights at 9.4 GB/s and
            prepacked oneDNN at 15.0, a 896x151936 LM head at 11.5 and 19.8 GB/s; on the AMX Xeon the
            one-row MKL product was a little faster, 26.1 against 25.2 GB/s: docs/results/verify_linear*.txt;
            :meth:`measure` tells on the machine at hand).

    Inside the mode, ``F.linear(x, W, b)`` with ``x: float32 [..., in]`` on CPU, ``W`` one of the
    packed weights and ``min_rows <= rows <= max_rows`` returns ``float32 [..., out]`` computed by
    ``torch.ops.mkldnn._linear_pointwise``; every other call goes to ``F.linear`` untouched. The
    result equals ``F.linear``'s up to fp32 summation order (relative error ~1e-6), as any batched
    verify does against one-token decoding. No module is modified.

    Raises:
        RuntimeError: this torch has no oneDNN (:func:`onednn_available` is False).
        ValueError: ``max_rows`` is not an int >= 2, or ``min_rows`` is not 1 or 2.
    """

    def __init__(self, linears, max_rows: int = 64, rows_hint: int = 8, min_rows: int = 2):
        super().__init__()
        if not onednn_available():
            raise RuntimeError("this torch build has no oneDNN (torch.ops.mkldnn); use F.linear (verify_kernel='torch')")
        _check_rows(min_rows, max_rows)
        self.max_rows = max_rows
        self.min_rows = min_rows
        self.rows_hint = rows_hint
        self._linears = [m for m in linears if _packable(m)]
        self._packed: dict[int, _Packed] = {}
        self.calls_rerouted = 0
        self.repacked = 0
        self.refresh()
        self.repacked = 0  # the first pack is not a repack

    def refresh(self) -> int:
        """Repack every weight that changed since it was packed (see the class docstring) and
        drop copies of weights no longer in the Linears; returns how many weights were (re)packed.
        Costs a read of ``_SAMPLE`` values per weight when nothing changed."""
        packed: dict[int, _Packed] = {}
        count = 0
        with torch.no_grad():
            for linear in self._linears:
                if not _packable(linear):
                    continue
                w = linear.weight
                entry = self._packed.get(id(w))
                if entry is None or not entry.fresh(w):
                    entry = _Packed(w, self.rows_hint)
                    count += 1
                packed[id(w)] = entry
        self._packed = packed
        self.repacked += count
        return count

    def with_rows(self, *, min_rows: int | None = None, max_rows: int | None = None) -> "PrepackedLinear":
        """Another mode over these same packed copies (no memory added, nothing repacked) that
        reroutes calls of ``min_rows..max_rows`` rows (each defaults to this mode's).

        For example, River's lossless verify mode (``min_rows=2``, a verify pass's rows) viewed with
        ``min_rows=1, max_rows=4096`` runs the plain model's decode steps and prompt passes on the
        copy lossless mode already holds, where a second :class:`PrepackedLinear` would double the
        memory (6 GB more on a 1.5B fp32 model). The view keeps the copies as they are now: it
        does not :meth:`refresh`; a weight changed afterwards goes to ``F.linear`` (exact), as in
        this mode until its own refresh.

        Raises:
            ValueError: the bounds are invalid (as for the constructor).
        """
        min_rows = self.min_rows if min_rows is None else min_rows
        max_rows = self.max_rows if max_rows is None else max_rows
        _check_rows(min_rows, max_rows)
        view = PrepackedLinear.__new__(PrepackedLinear)
        TorchFunctionMode.__init__(view)
        view.min_rows, view.max_rows, view.rows_hint = min_rows, max_rows, self.rows_hint
        view._linears, view._packed = list(self._linears), dict(self._packed)
        view.calls_rerouted = view.repacked = 0
        return view

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copies (the memory this mode adds)."""
        return sum(e.packed.numel() * e.packed.element_size() for e in self._packed.values())

    def __len__(self) -> int:
        return len(self._packed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = _linear_args(func, args, kwargs)
        if call is not None:
            x, weight, bias = call
            entry = self._packed.get(id(weight))
            if (entry is not None and entry.same_tensor(weight) and type(x) in _PLAIN and x.dtype == torch.float32
                    and x.device.type == "cpu" and (bias is None or (bias.dtype == torch.float32 and type(bias) in _PLAIN))):
                rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
                if self.min_rows <= rows <= self.max_rows:
                    self.calls_rerouted += 1
                    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), entry.packed, bias, "none", [], "")
        return func(*args, **kwargs)

    @staticmethod
    def measure(in_features: int, out_features: int, rows: int, *, stream_bytes: int | None = None,
                rounds: int = 5) -> dict[str, float]:
        """Median µs per call of ``F.linear`` and of the prepacked oneDNN linear on ``rows`` fp32
        rows, weights streamed from memory (copies totalling ``stream_bytes``, default twice the
        last-level cache), the two alternating from round to round.

        Returns:
            ``{"torch": µs, "onednn": µs}``.

        Raises:
            RuntimeError: no oneDNN in this torch.
        """
        if not onednn_available():
            raise RuntimeError("this torch build has no oneDNN (torch.ops.mkldnn)")
        weights = _streamed_weights(in_features, out_features, stream_bytes)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in weights]
        x = torch.randn(rows, in_features)
        return alternating_medians({
            "torch": lambda: [F.linear(x, w) for w in weights],
            "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed],
        }, rounds, len(weights))  # fmt: skip
