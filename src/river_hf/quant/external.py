"""Weight-only Linears on other well-kept libraries' CPU kernels, beside torch's own.

Three modules, each built from a dense ``nn.Linear`` (``weight: [out_features, in_features]``)
and called like it: ``x: [..., in_features]`` in any float dtype gives ``[..., out_features]`` in
x's dtype. The activations cross the boundary as float32 (cast once per exit layer through a
shared :class:`~river_hf.quant.modules.CastMemo` when the model is not fp32); what the kernel does
inside (int8 dot products on quantized activations) is the library's.

- :class:`OrtMatMulNBitsLinear`: onnxruntime's ``MatMulNBits`` contrib operator (domain
  ``com.microsoft``, MLAS kernels), one single-node ONNX graph per Linear with the quantized
  weights as initializers (prepacked by onnxruntime when the session is created), 4-bit
  asymmetric or 8-bit symmetric weights per block of 32/64/128 input channels,
  ``accuracy_level`` 4 (activations quantized to int8 per block, int8 dot products).
  The graph is written by :func:`matmul_nbits_model` (the ONNX protobuf encoding of the few
  messages needed), so the ``onnx`` package is not required, only ``onnxruntime``.
- :class:`DynamicInt8Linear`: torch's ``quantized::linear_dynamic`` on weights prepacked by
  ``quantized::linear_prepack`` (fbgemm): per-output-channel symmetric int8 weights, activations
  quantized per tensor to uint8 at each call (7-bit on a CPU without AVX-512 VNNI, where fbgemm's
  u8 x s8 pair sums could saturate).
- :class:`ArkWoqLinear`: Intel's ARK ``woqgemm`` (auto-round-lib's ``auto_round_kernel``, BesTLA
  kernels): 4-bit asymmetric weights per group of 128/64/32, or 8-bit symmetric per output
  channel, int8 compute.

Each module is a :class:`~river_hf.quant.registry.KernelModule` (``river_kernel``: the registry name it
was built as; ``weight_nbytes()``: the bytes one call reads, weights in the library's own layout).
Each library is imported only when one of its modules is built (or its availability asked:
:func:`ort_works`, :func:`ark_works`, :func:`dynamic_int8_works`), never at import of this module.

Thread pools: onnxruntime runs its own pool beside torch's OpenMP pool, on the same cores. Every
session gets ``intra_op_num_threads = torch.get_num_threads()`` (the calling thread plus that
many minus one workers), ``inter_op_num_threads = 1``, sequential execution, all graph
optimizations, and **spinning off** (``session.intra_op.allow_spinning = "0"``): one session per
Linear means a few hundred sessions in a model, and spinning workers of idle sessions would take
the cores from torch's threads between the products (docs/results/archive/river-measurements.md has the measurement).
``RIVER_HF_ORT_SPINNING=1`` in the environment turns spinning on for sessions created afterwards
(for measuring it). onnxruntime's one process-wide pool (``set_global_thread_pool_sizes``,
``use_per_session_threads = False``) is not used: its workers spin, and measured on the 2-core
AVX-512 machine (``benchmarks/ort_pools.py``: Qwen2.5-0.5B shapes, 24 layers x 7 products + head
with an SDPA call per layer between them, random weights) one step took 125 ms against 36 ms with
per-session pools and 23 ms on torch's tinygemm: every OpenMP parallel region of torch then waits
for a core the spinning worker holds. Without torch work between the products the shared pool
was the fastest (20.1 ms).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
import warnings

import torch
from torch import nn

from ..errors import RiverError
from .modules import CastMemo
from .registry import KernelModule

__all__ = ["OrtMatMulNBitsLinear", "DynamicInt8Linear", "ArkWoqLinear", "matmul_nbits_model", "ort_works",
           "ark_works", "dynamic_int8_works", "block_size_for", "ORT_SPINNING_ENV"]

#: environment variable: "1" lets onnxruntime's pool threads spin between calls (default: off)
ORT_SPINNING_ENV = "RIVER_HF_ORT_SPINNING"


def block_size_for(in_features: int, largest: int = 128) -> int | None:
    """The largest block (group) size of 128, 64, 32 not above ``largest`` that divides
    ``in_features``; None when none does."""
    for g in (128, 64, 32):
        if g <= largest and in_features % g == 0:
            return g
    return None


def _cast_input(module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous float32 ``[rows, in_features]`` tensor without autograd history (the
    kernels read raw memory), cast through the module's memo when it has one."""
    if x.dtype is not torch.float32:
        x = module.memo.cast(x, torch.float32) if module.memo is not None else x.float()
    x = x.detach().reshape(-1, module.in_features)
    return x if x.is_contiguous() else x.contiguous()


def _asymmetric_int4(w: torch.Tensor, g: int):
    """Groups of ``g`` input channels of ``w [n, k]`` on an asymmetric 4-bit grid with integer zero
    points: ``w ≈ (q - zp) * s`` with ``q, zp`` in [0, 15], ``s = (max - min) / 15`` over the group
    (the range widened to contain 0, so that ``zp = round(-min / s)`` fits). Returns ``q [n, k]``
    uint8, ``s [n, k / g]`` float32, ``zp [n, k / g]`` uint8."""
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15.0).clamp(min=1e-10)
    zp = torch.round(-lo / s).clamp(0, 15)
    q = torch.clamp(torch.round(wg / s[..., None]) + zp[..., None], 0, 15)
    return q.reshape(n, k).to(torch.uint8), s.float(), zp.to(torch.uint8)


def _symmetric_int8(w: torch.Tensor, g: int):
    """Groups of ``g`` input channels of ``w [n, k]`` on a symmetric int8 grid: ``w ≈ q * s``,
    ``|q| <= 127``, ``s = max|w| / 127`` over the group. Returns ``q [n, k]`` int8, ``s [n, k / g]``."""
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    s = (wg.abs().amax(-1) / 127.0).clamp(min=1e-12)
    q = torch.round(wg / s[..., None]).clamp(-127, 127)
    return q.reshape(n, k).to(torch.int8), s.float()


# --- onnxruntime MatMulNBits -------------------------------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _int(field: int, value: int) -> bytes:  # a varint field (wire type 0)
    return _varint(field << 3) + _varint(value)


def _len(field: int, payload: bytes | str) -> bytes:  # a length-delimited field (wire type 2)
    if isinstance(payload, str):
        payload = payload.encode()
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


#: ONNX TensorProto.DataType codes used here
_FLOAT, _UINT8 = 1, 2


def _tensor(name: str, dims, data_type: int, raw: bytes) -> bytes:
    # TensorProto: dims = 1, data_type = 2, name = 8, raw_data = 9
    return b"".join(_int(1, d) for d in dims) + _int(2, data_type) + _len(8, name) + _len(9, raw)


def _value_info(name: str, elem_type: int, dims) -> bytes:
    # ValueInfoProto{name = 1, type = 2: TypeProto{tensor_type = 1: {elem_type = 1, shape = 2:
    # TensorShapeProto{dim = 1: Dimension{dim_value = 1 | dim_param = 2}}}}}
    shape = b"".join(_len(1, _len(2, d) if isinstance(d, str) else _int(1, d)) for d in dims)
    return _len(1, name) + _len(2, _len(1, _int(1, elem_type) + _len(2, shape)))


def matmul_nbits_model(k: int, n: int, bits: int, block_size: int, accuracy_level: int, b: bytes, scales: bytes,
                       zero_points: bytes | None = None) -> bytes:
    """The serialized ONNX model (IR 10, opsets ai.onnx 21 and com.microsoft 1) of one
    ``MatMulNBits`` node: input ``A`` float32 ``[M, k]``, output ``Y`` float32 ``[M, n]``.

    Args:
        k, n: in and out features.
        bits: 4 or 8.
        block_size: input channels per quantization block (a power of two >= 16; ``k`` a multiple here).
        accuracy_level: 0-4 (4: int8 activations and dot products).
        b: the quantized weights as uint8 ``[n, k / block_size, block_size * bits / 8]`` bytes
            (4-bit: two values a byte, the first in the low nibble).
        scales: float32 ``[n * k / block_size]`` bytes.
        zero_points: uint8 bytes (4-bit: ``[n * ceil(blocks / 2)]``, two a byte; 8-bit:
            ``[n * blocks]``), or None for the operator's default ``2 ** (bits - 1)``.

    The encoding is ONNX's protobuf schema (onnx.proto3) written out for these messages only.
    """
    blocks = k // block_size
    inits = [_tensor("B", [n, blocks, block_size * bits // 8], _UINT8, b), _tensor("scales", [n * blocks], _FLOAT, scales)]
    inputs = ["A", "B", "scales"]
    if zero_points is not None:
        inits.append(_tensor("zero_points", [len(zero_points)], _UINT8, zero_points))
        inputs.append("zero_points")
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block_size, "accuracy_level": accuracy_level}
    # NodeProto: input = 1, output = 2, name = 3, op_type = 4, attribute = 5, domain = 7;
    # AttributeProto: name = 1, i = 3, type = 20 (INT = 2)
    node = (b"".join(_len(1, i) for i in inputs) + _len(2, "Y") + _len(3, "matmul_nbits") + _len(4, "MatMulNBits")
            + b"".join(_len(5, _len(1, key) + _int(3, value) + _int(20, 2)) for key, value in attrs.items())
            + _len(7, "com.microsoft"))
    # GraphProto: node = 1, name = 2, initializer = 5, input = 11, output = 12
    graph = (_len(1, node) + _len(2, "river_hf_linear") + b"".join(_len(5, t) for t in inits)
             + _len(11, _value_info("A", _FLOAT, ["M", k])) + _len(12, _value_info("Y", _FLOAT, ["M", n])))
    # ModelProto: ir_version = 1, producer_name = 2, graph = 7, opset_import = 8 (domain = 1, version = 2)
    return (_int(1, 10) + _len(2, "river-hf") + _len(7, graph)
            + _len(8, _len(1, "") + _int(2, 21)) + _len(8, _len(1, "com.microsoft") + _int(2, 1)))


def _ort_session(model: bytes):
    """An onnxruntime CPU session for ``model`` with the thread settings of the module docstring."""
    ort = importlib.import_module("onnxruntime")
    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, torch.get_num_threads())
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning",
                                "1" if os.environ.get(ORT_SPINNING_ENV, "0") == "1" else "0")
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # errors only
    return ort.InferenceSession(model, sess_options=so, providers=["CPUExecutionProvider"])


class OrtMatMulNBitsLinear(KernelModule):
    """``y = x @ Wq.T + b`` on onnxruntime's ``MatMulNBits`` (module docstring).

    Grids: 4-bit: :func:`_asymmetric_int4` per block (``(q - zp) * s``, integer zero points);
    8-bit: symmetric per block, ``q * s`` with ``|q| <= 127`` (stored as ``q + 128``, the
    operator's default zero point). Scales float32. The weights live in the onnxruntime session
    (prepacked there); the module keeps only the bias (model dtype) as a buffer.

    Args:
        linear: the dense Linear (not modified).
        bits: 4 or 8.
        group_size: the largest block size (128, 64 or 32; the largest of those dividing
            ``in_features`` is used).
        accuracy_level: MatMulNBits' ``accuracy_level`` (4: int8 compute).
        kernel: the registry name this module reports (:func:`~river_hf.quant.modules.kernel_name`).

    ``forward(x)``: ``x [..., in]`` any float dtype -> ``[..., out]`` in x's dtype.

    Raises:
        RiverError: ``in_features`` is not a multiple of 32, or ``bits`` is not 4 or 8.
        ModuleNotFoundError: onnxruntime is not installed.
    """

    def __init__(self, linear: nn.Linear, bits: int = 4, group_size: int = 128, accuracy_level: int = 4,
                 kernel: str = "ort-int4"):
        super().__init__()
        import numpy as np

        n, k = linear.out_features, linear.in_features
        g = block_size_for(k, group_size)
        if g is None or bits not in (4, 8):
            raise RiverError(f"{kernel} needs in_features divisible by 32 and 4 or 8 bits, got {k}x{n}, {bits} bits")
        w = linear.weight.detach().float().cpu()
        blocks = k // g
        if bits == 4:
            q, s, zp = _asymmetric_int4(w, g)
            qn = q.numpy()
            b = (qn[:, 0::2] | (qn[:, 1::2] << 4)).astype(np.uint8)
            z = zp.numpy()
            if blocks % 2:
                z = np.concatenate([z, np.full((n, 1), 8, np.uint8)], axis=1)
            zero_points = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8).tobytes()
            self.weight_bytes = b.nbytes + len(zero_points) + s.numel() * 4
        else:
            q, s = _symmetric_int8(w, g)
            b = (q.numpy().astype(np.int16) + 128).astype(np.uint8)
            zero_points = None
            self.weight_bytes = b.nbytes + s.numel() * 4
        model = matmul_nbits_model(k, n, bits, g, accuracy_level, b.tobytes(), s.numpy().astype(np.float32).tobytes(),
                                   zero_points)
        del b, q
        self.session = _ort_session(model)
        self._outputs = ("Y",)
        self.in_features, self.out_features, self.bits, self.group_size = k, n, bits, g
        self.accuracy_level = accuracy_level
        self.river_kernel = kernel
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.memo: CastMemo | None = None

    def weight_nbytes(self) -> int:
        """Bytes of packed weights, scales and zero points one call reads (and the bias)."""
        return self.weight_bytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _cast_input(self, x)
        if x2.shape[0] == 0:
            y = x2.new_zeros(0, self.out_features)
        else:  # zero-copy both ways: numpy views of torch memory in, a numpy array wrapped out
            y = torch.from_numpy(self.session.run(self._outputs, {"A": x2.numpy()})[0])
        if self.bias is not None:
            y += self.bias  # y is this call's own fresh array
        y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype is torch.float32 else y.to(x.dtype)

    def __deepcopy__(self, memo):
        """A copy sharing the (read-only, thread-safe) onnxruntime session; everything else copied."""
        memo[id(self.session)] = self.session
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new


@functools.lru_cache(maxsize=None)
def ort_works() -> bool:
    """Whether onnxruntime is importable and its ``MatMulNBits`` (4- and 8-bit, accuracy level 4)
    runs and computes a small product correctly on this CPU (checked once per process)."""
    try:
        importlib.import_module("onnxruntime")
    except Exception:  # noqa: BLE001 - not installed, or a broken install: not available either way
        return False
    return _smoke(lambda lin, bits: OrtMatMulNBitsLinear(lin, bits=bits, kernel=f"ort-int{bits}"))


def _smoke(build) -> bool:
    """Build a 64x32 Linear with ``build(linear, bits)`` for 4 and 8 bits and check its product."""
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, 64, generator=gen))
    x = torch.randn(2, 64, generator=gen)
    try:
        with torch.no_grad():
            ref = linear(x)
            for bits, bound in ((4, 0.3), (8, 0.05)):
                y = build(linear, bits)(x)
                if not bool(((y - ref).norm() / ref.norm()) < bound):
                    return False
    except Exception:  # noqa: BLE001 - any failure means the kernel cannot be used here
        return False
    return True


# --- torch quantized::linear_dynamic (fbgemm) --------------------------------------------------------

@contextlib.contextmanager
def _quantized_engine(name: str):
    """``torch.backends.quantized.engine = name`` within the block (it is process-wide state)."""
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


def _has_vnni() -> bool:
    probe = getattr(getattr(torch._C, "_cpu", None), "_is_avx512_vnni_supported", None)
    return bool(probe()) if probe is not None else False


class DynamicInt8Linear(KernelModule):
    """``y = x @ Wq.T + b`` on torch's ``quantized::linear_dynamic`` (fbgemm), fp32 activations.

    Weights per output channel, symmetric int8 (``s = max|W_row| / 127``, the grid of
    ``torch-int8``), prepacked with the bias (float32) by ``quantized::linear_prepack`` under the
    fbgemm engine. Each call quantizes the activations per tensor to uint8 (fbgemm's dynamic
    quantization; 7-bit where the CPU lacks AVX-512 VNNI). ``forward(x)``: ``x [..., in]`` any float
    dtype -> ``[..., out]`` in x's dtype.

    Raises:
        RuntimeError: this torch has no fbgemm engine (see :func:`dynamic_int8_works`).
    """

    river_kernel = "torch-dyn-int8"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        w = linear.weight.detach().float().cpu()
        s = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu().clone()
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensor creation deprecated
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, s.double(), torch.zeros(n, dtype=torch.int64), 0, torch.qint8)
            with _quantized_engine("fbgemm"):
                self.packed = torch.ops.quantized.linear_prepack(qw, bias)
        self.in_features, self.out_features = k, n
        self.reduce_range = not _has_vnni()
        self.weight_bytes = n * k + 8 * n + (0 if bias is None else 4 * n)  # int8 weights, scale + column offset per row
        self.memo: CastMemo | None = None

    def weight_nbytes(self) -> int:
        """Bytes of int8 weights, per-row scales and column offsets (and the float32 bias) one call reads."""
        return self.weight_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(_cast_input(self, x), self.packed, self.reduce_range)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


@functools.lru_cache(maxsize=None)
def dynamic_int8_works() -> bool:
    """Whether this torch has the fbgemm quantized engine and ``quantized::linear_dynamic``
    computes a small product correctly (checked once per process)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    return _smoke(lambda lin, bits: DynamicInt8Linear(lin) if bits == 8 else lin)


# --- ARK woqgemm (auto-round-lib) --------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _ark():
    """The ``auto_round_kernel`` module (imported once; ModuleNotFoundError without auto-round-lib)."""
    return importlib.import_module("auto_round_kernel")


class ArkWoqLinear(KernelModule):
    """``y = x @ Wq.T + b`` on ARK's ``woqgemm`` (auto-round-lib ``auto_round_kernel``), fp32
    activations, int8 compute.

    Grids: 4-bit asymmetric per group (:func:`_asymmetric_int4`, given to ARK as signed ``q - 8``,
    ``zp - 8``); 8-bit symmetric per output channel. Buffers: ``blob`` (ARK's packed weights,
    int8), ``bias`` float32 or None (added by the kernel).

    Args:
        linear: the dense Linear (not modified).
        bits: 4 or 8.
        group_size: 4-bit: the largest group (128, 64 or 32 dividing ``in_features``).
        kernel: the registry name this module reports.

    ``forward(x)``: ``x [..., in]`` any float dtype -> ``[..., out]`` in x's dtype.

    Raises:
        RiverError: 4-bit and ``in_features`` not a multiple of 32.
        ModuleNotFoundError: auto-round-lib is not installed.
    """

    def __init__(self, linear: nn.Linear, bits: int = 4, group_size: int = 128, kernel: str = "ark-int4"):
        super().__init__()
        ark = _ark()
        n, k = linear.out_features, linear.in_features
        w = linear.weight.detach().float().cpu()
        if bits == 4:
            g = block_size_for(k, group_size)
            if g is None:
                raise RiverError(f"{kernel} needs in_features divisible by 32, got {k}x{n}")
            q, s, zp = _asymmetric_int4(w, g)
            qs, zs = (q.to(torch.int16) - 8).to(torch.int8), (zp.to(torch.int16) - 8).to(torch.int8)
            blob = ark.repack_quantized_weight(qs.t().contiguous(), s.t().contiguous(), zs.t().contiguous(), g,
                                               "int8", "int4", "fp32", True)
            self.asym = True
        else:
            g = k
            q, s = _symmetric_int8(w, k)
            blob = ark.repack_quantized_weight(q.t().contiguous(), s.t().contiguous(), torch.empty(0, dtype=torch.int8),
                                               g, "int8", "int8", "fp32", False)
            self.asym = False
        self.in_features, self.out_features, self.bits, self.group_size = k, n, bits, g
        self.river_kernel = kernel
        self.register_buffer("blob", blob)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().cpu().clone())
        self._no_bias = torch.empty(0, dtype=torch.float32)
        self.memo: CastMemo | None = None

    def weight_nbytes(self) -> int:
        """Bytes of ARK's packed blob (weights, scales, zero points) and the bias one call reads."""
        return self.blob.numel() * self.blob.element_size() + (0 if self.bias is None else 4 * self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ark = _ark()
        x2 = _cast_input(self, x)
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        if x2.shape[0]:
            ark.woqgemm(x2, self.blob, self._no_bias if self.bias is None else self.bias, self.out_features,
                        self.in_features, self.group_size, "int8", f"int{self.bits}", "fp32", self.asym, out=out)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


@functools.lru_cache(maxsize=None)
def ark_works() -> bool:
    """Whether auto-round-lib's CPU library is importable and ``woqgemm`` computes small 4- and
    8-bit products correctly on this CPU (checked once per process)."""
    try:
        ark = _ark()
    except Exception:  # noqa: BLE001 - not installed, or a broken install
        return False
    if getattr(ark, "cpu_lib", None) is None:
        return False
    return _smoke(lambda lin, bits: ArkWoqLinear(lin, bits=bits, group_size=32, kernel=f"ark-int{bits}"))
