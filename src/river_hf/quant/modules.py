"""The modules a weight-only kernel builds, and what is measured on them.

``Int8WeightOnlyLinear`` / ``Int4WeightOnlyLinear`` (torch's weight-only int8 / int4 ops),
``CastLinear`` (a quanto Linear run in bf16 inside an fp32 model), ``PromptRowsLinear`` (one exit
Linear on a decode and a prompt kernel) and ``CastMemo`` (one input cast shared by the Linears of
an exit layer). Each module is a :class:`~river_hf.quant.registry.KernelModule`: it names the
kernel it runs on (``river_kernel``) and counts the weight bytes one call reads
(``weight_nbytes()``), which is all :func:`kernel_name` and :func:`linear_weight_bytes` (defined in
:mod:`.registry`, re-exported here) ask. ``relative_error`` and ``fast_kernel_fraction`` read built
copies. Which kernel builds which module is :mod:`.kernels` (which re-exports these names).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import RiverError
from .registry import KernelModule, kernel_name, linear_weight_bytes

__all__ = ["CastMemo", "CastLinear", "Int8WeightOnlyLinear", "Int4WeightOnlyLinear", "int4_grid", "PromptRowsLinear", "relative_error",
           "kernel_name", "linear_weight_bytes", "fast_kernel_fraction", "KernelModule"]


class CastMemo:
    """Casts of the last input, shared by the Linears of one exit layer.

    q/k/v projections (and gate/up) receive the same input tensor; the memo casts it to the
    compute dtype once and hands the same cast to its siblings. The tensor's identity *and* its
    version counter must match, so an input modified in place is cast again. Safe when several
    threads run the same layer: the memo is one tuple, read and replaced whole.

    Inside ``torch.inference_mode()`` the input is an inference tensor, which has no version
    counter: the memo then keys on identity alone (as :class:`~river_hf.quant.fused.FusedProjection`
    does). Nothing in a decoder layer modifies the normed input in place between its sibling
    projections.
    """

    __slots__ = ("entry",)

    def __init__(self):
        self.entry = None  # (source tensor, its version, its cast): one attribute, so a thread reads it whole

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        entry = self.entry  # one read: another thread may replace the entry, never half of it
        version = None if x.is_inference() else x._version  # inference tensors have no version counter
        if entry is not None and x is entry[0] and version == entry[1] and entry[2].dtype == dtype:
            return entry[2]
        y = x.to(dtype)
        self.entry = (x, version, y)
        return y


class CastLinear(KernelModule):
    """Runs ``inner`` in ``compute_dtype`` and returns the caller's dtype (W8A16/W4A16 on an fp32 model).
    Named by ``inner``'s kernel, and its weight bytes are ``inner``'s.

    Args:
        inner: the quantized Linear (expects ``compute_dtype`` input).
        compute_dtype: its activation dtype.
        memo: a :class:`CastMemo` shared with sibling Linears (None: cast every call).
    """

    def __init__(self, inner: nn.Module, compute_dtype: torch.dtype, memo: CastMemo | None = None):
        super().__init__()
        self.inner = inner
        self.compute_dtype = compute_dtype
        self.memo = memo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.compute_dtype:
            return self.inner(x)
        xc = self.memo.cast(x, self.compute_dtype) if self.memo is not None else x.to(self.compute_dtype)
        return self.inner(xc).to(x.dtype)

    @property
    def river_kernel(self) -> str:
        return kernel_name(self.inner)

    def weight_nbytes(self) -> int:
        return linear_weight_bytes(self.inner)


class Int8WeightOnlyLinear(KernelModule):
    """``y = x @ (q * s).T + b`` with per-output-channel symmetric int8 weights, on
    ``torch._weight_int8pack_mm``.

    Buffers: ``weight_int8`` int8 ``[out, in]`` (q = round(W / s), |q| <= 127), ``scales``
    ``[out]`` in ``compute_dtype`` (s = max|W_row| / 127), ``bias`` ``[out]`` in the model dtype or None.
    ``forward(x)``: ``x [..., in]`` (any float dtype) -> ``[..., out]`` in x's dtype.
    """

    river_kernel = "torch-int8"

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scales", scales.to(compute_dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.memo: CastMemo | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x if x.dtype == self.compute_dtype else (
            self.memo.cast(x, self.compute_dtype) if self.memo is not None else x.to(self.compute_dtype))
        y = torch._weight_int8pack_mm(xc.reshape(-1, self.in_features), self.weight_int8, self.scales)
        return _to_dtype_plus_bias(y.reshape(*x.shape[:-1], self.out_features), x.dtype, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """``[out, in]`` float32: the weights this module multiplies by."""
        return self.weight_int8.float() * self.scales.float()[:, None]


def _to_dtype_plus_bias(y: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """``y.to(dtype) + bias`` (or ``y.to(dtype)`` without a bias) in one kernel where the add itself
    can cast: a bias already in ``dtype``, which is at least as wide as ``y``'s (bf16 kernel output,
    fp32 model), is added by one mixed-dtype add. Each element is ``bias + float(y)`` either way,
    so the result is the same bit for bit; it saves one cast kernel per biased Linear and step."""
    if bias is None:
        return y.to(dtype)
    if bias.dtype == dtype and torch.promote_types(y.dtype, dtype) == dtype:
        return torch.add(y, bias)
    return y.to(dtype) + bias


def _int4_group_size(in_features: int, largest: int = 128) -> int | None:
    for g in (g for g in (128, 64, 32) if g <= largest):
        if in_features % g == 0:
            return g
    return None


def int4_grid(weight: torch.Tensor, group_size: int = 128):
    """torch-int4's grid of ``weight [out, in]`` (float): groups of ``g`` input channels (the largest of
    128, 64, 32 dividing ``in``, at most ``group_size``), ``q = round((W - min) / scale)`` in [0, 15],
    ``scale = (max - min) / 15`` (at least 1e-8), ``W ~= (q - 8) * scale + zero`` with
    ``zero = min + 8 * scale`` (tinygemm's layout). Returns ``(q int32 [out, in], scale [out, in / g],
    zero [out, in / g], g)``, float32 like ``weight``.

    Raises:
        RiverError: ``in`` is not divisible by 32.
    """
    n, k = weight.shape
    g = _int4_group_size(k, group_size)
    if g is None:
        raise RiverError(f"a 4-bit grid needs in_features divisible by 32, got {k}")
    w = weight.reshape(n, k // g, g)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    q = torch.round((w - lo) / scale).clamp(0, 15).reshape(n, k).to(torch.int32)
    zero = lo + 8.0 * scale
    return q, scale.reshape(n, k // g), zero.reshape(n, k // g), g


class Int4WeightOnlyLinear(KernelModule):
    """``y = x @ W4.T + b`` with asymmetric 4-bit weights per group of ``group_size`` input
    channels, on torch's tinygemm int4 kernel (``torch._weight_int4pack_mm_for_cpu`` on CPU).

    Per group: ``q = round((W - min) / scale)`` in [0, 15], ``scale = (max - min) / 15``; the kernel
    computes ``(q - 8) * scale + zero`` with ``zero = min + 8 * scale`` (tinygemm's layout).
    Buffers: ``weight_packed`` (the kernel's packed uint8 layout), ``scale_zeros`` ``[in / group, out, 2]``
    in ``compute_dtype``, ``bias`` or None. ``forward(x)``: ``x [..., in]`` -> ``[..., out]`` in x's dtype.

    Raises:
        RiverError: the shape cannot be packed (see :meth:`supports`).
    """

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16, group_size: int = 128):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        if _int4_group_size(k, group_size) is None or n % 16:
            raise RiverError(f"torch-int4 needs in_features divisible by 32 and out_features by 16, got {k}x{n}")
        q, scale, zero, g = int4_grid(linear.weight.detach().float(), group_size)
        device = linear.weight.device
        self.in_features, self.out_features, self.group_size = k, n, g
        self.compute_dtype = compute_dtype
        if device.type == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        else:  # pragma: no cover - needs a GPU
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 2)
        sz = torch.stack([scale.t(), zero.t()], dim=-1)
        self.register_buffer("weight_packed", packed)
        self.register_buffer("scale_zeros", sz.to(compute_dtype).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.memo: CastMemo | None = None

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """The packed layout needs ``in_features % 32 == 0`` and ``out_features % 16 == 0``."""
        return _int4_group_size(linear.in_features) is not None and linear.out_features % 16 == 0

    @property
    def river_kernel(self) -> str:
        """``torch-int4-g32`` when the groups are 32 input channels, else ``torch-int4``."""
        return "torch-int4-g32" if self.group_size == 32 else "torch-int4"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x if x.dtype == self.compute_dtype else (
            self.memo.cast(x, self.compute_dtype) if self.memo is not None else x.to(self.compute_dtype))
        x2 = xc.reshape(-1, self.in_features)
        if x2.device.type == "cpu":
            y = torch._weight_int4pack_mm_for_cpu(x2, self.weight_packed, self.group_size, self.scale_zeros)
        else:  # pragma: no cover - needs a GPU
            y = torch._weight_int4pack_mm(x2, self.weight_packed, self.group_size, self.scale_zeros)
        return _to_dtype_plus_bias(y.reshape(*x.shape[:-1], self.out_features), x.dtype, self.bias)


class PromptRowsLinear(KernelModule):
    """One exit Linear on two kernels: ``decode`` for calls of fewer than ``min_rows`` rows (a decode
    step's one token), ``prompt`` for larger ones (a prompt pass through the exit layers).

    A one-row weight product is bound by reading the weights, a prompt's by arithmetic: tinygemm,
    the fastest one-row int4 kernel inside a decode step here, is 2-3.5x slower than onnxruntime's
    ``MatMulNBits`` (int8 dot products) at 185 rows (docs/results/archive/profile-measurements.md). Both copies quantize the same
    weights to the same width and block size (their grids round the zero point differently, and the
    prompt kernel quantizes activations to int8), so a prompt's exit-layer K/V differ from what the
    decode kernel would give by kernel rounding; ``relative_error`` of each is in the kernel report.

    Args:
        decode: the one-row kernel's module (its weight bytes are what a decode step reads).
        prompt: the multi-row kernel's module (a second copy of the weights, in its own layout).
        min_rows: calls with at least this many rows (``x.numel() / in_features``) use ``prompt``.

    ``forward(x)``: ``x [..., in_features]`` -> ``[..., out_features]``, x's dtype. Named by its
    decode kernel, and only the decode copy's bytes count (a decode step does not read ``prompt``).
    """

    def __init__(self, decode: nn.Module, prompt: nn.Module, min_rows: int):
        super().__init__()
        self.decode = decode
        self.prompt = prompt
        self.min_rows = int(min_rows)
        self.in_features = prompt.in_features
        self.out_features = prompt.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() >= self.min_rows * self.in_features:
            return self.prompt(x)
        return self.decode(x)

    @property
    def river_kernel(self) -> str:
        return kernel_name(self.decode)

    def weight_nbytes(self) -> int:
        return linear_weight_bytes(self.decode)

    def extra_repr(self) -> str:
        return f"min_rows={self.min_rows}"


@torch.no_grad()
def relative_error(linear: nn.Linear, copy_: nn.Module, rows: int = 4) -> float:
    """``||copy(x) - linear(x)|| / ||linear(x)||`` for ``x ~ N(0, 1)`` of shape ``[rows, in_features]``
    (fixed seed): how far a kernel's output is from the dense Linear's, on the real weights."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, linear.in_features, generator=gen).to(linear.weight.device, linear.weight.dtype)
    ref = linear(x).float()
    return float((copy_(x).float() - ref).norm() / ref.norm().clamp(min=1e-12))


def fast_kernel_fraction(model: nn.Module) -> float | None:
    """Fraction of the exit layers' quantized Linears that run on a packed kernel (not quanto's
    dequantizing int4 fallback). None when the model has no quantized exit Linears (``copy``).
    The exit layers are the ``exit_layer`` of each River layer (``named_modules`` of a River model
    does not enter them)."""
    exits = [m.exit_layer for m in model.modules() if isinstance(getattr(m, "exit_layer", None), nn.Module)]
    kinds = [kernel_name(m) for e in exits for name, m in e.named_modules()
             if name and not name.endswith(".inner") and kernel_name(m) != "dense"]
    if not kinds:
        return None
    return sum("slow" not in k for k in kinds) / len(kinds)
