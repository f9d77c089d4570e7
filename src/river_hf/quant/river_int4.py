"""``river-int4``: river-hf's own 4-bit weight-only product for x86 CPUs with AVX-512 VNNI or AVX2.

torch's tinygemm (``torch-int4``) computes a one-row 4-bit product in bf16: it turns every weight
back into a float and multiplies, which on a 2-core AVX-512 CPU runs far below the memory's rate
(a decode step of the fully quantized Qwen2.5-Coder-0.5B spent 15 ms a token in it). This kernel
does what llama.cpp's do instead: each activation row is quantized to int8 per group of input
channels, and the products run on integer dot-product instructions (``vpdpbusd`` with AVX-512
VNNI, 64 multiply-adds per instruction; ``vpmaddubsw`` and ``vpmaddwd`` with AVX2, as llama.cpp's
AVX2 kernels; both give the same numbers bit for bit). The grid of the weights is torch-int4's (asymmetric 4-bit groups,
``(q - 8) * scale + zero``, :func:`~river_hf.quant.modules.int4_grid`), so both kernels quantize a
Linear alike (scales and zeros kept in fp16 here, as llama.cpp keeps its block scales; tinygemm keeps
them in bf16); this one adds the activations' int8 rounding (symmetric per group, ``max|x| / 127``:
about 0.7 % relative error of a product on random data, against the weights' own 10 %). Each block of
16 output channels is one contiguous stream of nibbles, scales and zeros (6 % over the 4-bit weights at
groups of 128), read once per call.

The C++ source (``csrc/river_int4.cpp``) is compiled once per source, instruction set and torch
version by torch's ``cpp_extension`` (gcc, about 25 s) into ``~/.cache/torch_extensions/river_hf``
(``$TORCH_EXTENSIONS_DIR``), with explicit instruction-set flags (:data:`INSTRUCTION_SETS`: AVX-512
F/BW/VL/VNNI where the CPU has them, else AVX2 with FMA and F16C; not ``-march=native``), so the
library runs on any CPU with those features; :func:`works` is False without either set, without a
compiler, or when the build or a small
product's check fails (the reason is :func:`unavailable_reason`), and the ``int4`` choice then
measures only the other kernels. It threads over blocks of 16 output channels with torch's own
intra-op pool (``at::parallel_for``, ``torch.set_num_threads``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch
from torch import nn

from ..errors import RiverError
from .modules import CastMemo, int4_grid
from .registry import KernelModule

__all__ = ["RiverInt4Linear", "works", "unavailable_reason", "extension", "product_clock", "instruction_set",
           "INSTRUCTION_SETS", "build_id"]

_SOURCE = Path(__file__).parent / "csrc" / "river_int4.cpp"
#: the headers it includes (part of the build's identity)
_HEADERS = (Path(__file__).parent / "csrc" / "layer_ops.h",)
#: the instruction sets the kernel is built for, best first: name -> (the ``/proc/cpuinfo`` flags it
#: needs, gcc's flags for them)
INSTRUCTION_SETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "AVX-512 VNNI": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"),
                     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c")),
    "AVX2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
}
_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
_LANES = 16


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def instruction_set() -> str | None:
    """The first of :data:`INSTRUCTION_SETS` whose flags this CPU has, or None."""
    flags = _cpu_flags()
    for name, (needed, _) in INSTRUCTION_SETS.items():
        if all(f in flags for f in needed):
            return name
    return None


def _build_root() -> Path:
    """Where compiled extensions live: torch's own place (``$TORCH_EXTENSIONS_DIR``, else
    ``~/.cache/torch_extensions``), under ``river_hf/``; not ``$RIVER_HF_CACHE``, so processes with
    their own model cache (tests, servers) share one build."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "torch_extensions") / "river_hf"


def _build_name(isa: str) -> tuple[str, list[str]]:
    """(the extension's name, gcc flags) for instruction set ``isa``: ``river_int4_`` and 16 hex
    digits of the SHA-256 of the source and its headers, the flags and the torch version."""
    cflags = [*_CFLAGS, *INSTRUCTION_SETS[isa][1]]
    source = _SOURCE.read_bytes() + b"".join(h.read_bytes() for h in _HEADERS)
    digest = hashlib.sha256(source + " ".join(cflags).encode() + torch.__version__.encode()).hexdigest()
    return f"river_int4_{digest[:16]}", cflags


@functools.lru_cache(maxsize=1)
def build_id() -> str | None:
    """Which build of ``csrc/river_int4.cpp`` this process uses (river-int4, and river-fp32's
    ``dense_mm``): the extension's name, which changes with the source, the instruction set, the
    flags or torch; None where this CPU has no instruction set for it. Reads the source, compiles
    nothing. The kernel cache records it with each timing of these kernels, so a changed kernel is
    measured again (:func:`river_hf.quant.kernel_cache.entry_status`)."""
    isa = instruction_set()
    return None if isa is None else _build_name(isa)[0]


@functools.lru_cache(maxsize=1)
def _extension():
    """(the compiled module, None) or (None, why not). Built on first use, then loaded from the cache."""
    if sys.platform != "linux":
        return None, "river-int4 is built for Linux x86-64 only"
    isa = instruction_set()
    if isa is None:
        return None, "this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C"
    name, cflags = _build_name(isa)
    build = _build_root() / name
    try:
        from torch.utils import cpp_extension

        build.mkdir(parents=True, exist_ok=True)
        if not (build / f"{name}.so").exists():
            from tqdm import tqdm

            tqdm.write(f"river-int4: compiling river-hf's {isa} int4 kernel once for this torch (about 30 s)",
                       file=sys.stderr)
        module = cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=cflags,
                                    extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, a failed build: the kernel is not available
        return None, f"its build failed ({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''})"
    return module, None


@functools.lru_cache(maxsize=1)
def _checked() -> str | None:
    """None when the kernel builds and a small product is right, else why not (once per process)."""
    module, why = _extension()
    if module is None:
        return why
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(256, 32, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, 256, generator=gen))
        linear.bias.copy_(torch.randn(32, generator=gen))
        x = torch.randn(3, 256, generator=gen)
        ref = linear(x)
        try:
            y = RiverInt4Linear(linear)(x)
        except Exception as e:  # noqa: BLE001 - a kernel that raises here is not usable
            return f"its check raised {type(e).__name__}: {e}"
    error = float((y - ref).norm() / ref.norm())
    return None if error < 0.3 else f"its check was off by {error:.2f} (relative)"


def works() -> bool:
    """Whether ``river-int4`` can run here: AVX-512 VNNI or AVX2, the kernel compiled (or cached), and a
    small product within the 4-bit grid's error."""
    if os.environ.get("RIVER_HF_NO_EXTENSIONS") == "1":
        return False
    return _checked() is None


def extension():
    """The compiled module (``pack``, ``mm``, and the Llama family's fused exit layer in two calls,
    ``attention_in`` and ``attention_out``, see ``csrc/river_int4.cpp``), built on first use.

    Raises:
        RiverError: it cannot be built here (the reason as :func:`unavailable_reason` gives it).
    """
    module, why = _extension()
    if module is None:
        raise RiverError(f"river-int4 cannot run here: {why}")
    return module


def product_clock():
    """The kernel's product clock when this process has already loaded the kernel (nothing is built
    or checked here), else None: the module's ``set_product_clock(on: bool)`` starts or stops adding
    up the wall time of every weight product (the activations' int8 quantization and the dot
    products, timed on the calling thread, also inside ``attention_in`` / ``attention_out``), and
    ``product_ns()`` returns the total in nanoseconds (int). Used by the step profile to split a
    fused exit layer's calls into products and the rest."""
    if os.environ.get("RIVER_HF_NO_EXTENSIONS") == "1" or _extension.cache_info().currsize == 0:
        return None
    return _extension()[0]


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(scores, dim=-1)`` of ``scores`` ``[batch, vocab]`` float32 on the CPU: int64
    ``[batch]``, the first index of each row's largest value (a NaN counts as the largest, as in torch).
    Through the extension's vectorized pass when this process has already loaded it (nothing is built
    here; ATen's argmax compares one value at a time, ~80 µs a step on a 152k vocabulary), else
    torch's own."""
    if (scores.dim() == 2 and scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.shape[1]
            and os.environ.get("RIVER_HF_NO_EXTENSIONS") != "1" and _extension.cache_info().currsize):
        module = _extension()[0]
        if module is not None:
            return module.argmax_rows(scores)
    return torch.argmax(scores, dim=-1)


def unavailable_reason() -> str | None:
    """Why :func:`works` is False (None when it is True)."""
    if os.environ.get("RIVER_HF_NO_EXTENSIONS") == "1":
        return "RIVER_HF_NO_EXTENSIONS=1"
    return _checked()


def _half(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) in fp16, clamped to fp16's finite range (a scale below fp16's smallest
    subnormal, 6e-8, only occurs for a constant group, whose weights the zero alone gives)."""
    limit = torch.finfo(torch.float16).max
    return t.clamp(-limit, limit).to(torch.float16).contiguous()


class RiverInt4Linear(KernelModule):
    """``y = x @ W4.T + b`` on river-hf's int4 kernel (AVX-512 VNNI or AVX2, module docstring).

    Weights on torch-int4's grid (:func:`~river_hf.quant.modules.int4_grid`: groups of at most
    ``group_size`` input channels), packed for byte dot products: ``packed`` uint8 ``[out / 16, in / group,
    group * 8 + 64]``, one stream per block of 16 output channels, each group's nibbles followed by its
    16 scales and 16 zeros in fp16 (``csrc/river_int4.cpp`` gives the byte layout); ``bias`` float32
    or None. ``forward(x)``: ``x [..., in]`` any float dtype -> ``[..., out]`` in x's dtype (computed
    in fp32 with int8 activations).

    Raises:
        RiverError: ``in_features`` not divisible by 32 or ``out_features`` by 16; the kernel cannot
            run here (:func:`unavailable_reason`).
    """

    river_kernel = "river-int4"

    def __init__(self, linear: nn.Linear, group_size: int = 128):
        super().__init__()
        module, why = _extension()
        if module is None:
            raise RiverError(f"river-int4 cannot run here: {why}")
        n, k = linear.out_features, linear.in_features
        if n % _LANES or k % 32:
            raise RiverError(f"river-int4 needs in_features divisible by 32 and out_features by 16, got {k}x{n}")
        q, scale, zero, g = int4_grid(linear.weight.detach().float().cpu(), group_size)
        self.in_features, self.out_features, self.group_size = k, n, g
        self.register_buffer("packed", module.pack(q, _half(scale), _half(zero), g))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().cpu().contiguous())
        self.memo: CastMemo | None = None

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """``in_features % 32 == 0`` and ``out_features % 16 == 0``."""
        return linear.in_features % 32 == 0 and linear.out_features % _LANES == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module, _ = _extension()
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        y = module.mm(x2, self.packed, self.bias, self.group_size, None, 0.0, False, None)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
