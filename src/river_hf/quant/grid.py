"""``river-grid``: fp32 products on weights that sit exactly on a GGUF quantization grid, read from the
grid (about 1.25 bytes a weight) instead of the fp32 copy (4 bytes), with the same numbers up to fp32
summation order.

Why: a checkpoint converted from a GGUF file (every model ``river-hf`` fetches; transformers'
``from_pretrained(..., gguf_file=...)``) is fp32 in memory, but each weight is exactly what the GGUF's
dequantization computes from its blocks: ``fl(scale * q + offset)`` with an integer ``q`` and an fp32
scale (and offset) per group of 16 or 32 input channels (gguf-py's ``dequantize_blocks``:
``d * q`` for Q4_0 / Q5_0 / Q8_0, ``d * q + m`` for Q4_1 / Q5_1, ``d * sc * q - dmin * m`` for Q4_K /
Q5_K, ``d * sc * q`` for Q6_K). A decode step multiplies one row by every weight, so it costs the bytes
it reads: the same weights held as int8 ``q`` with fp32 group scales are read about 3-4x faster. On the
2-core AMD EPYC Zen 5, a 1536 x 8960 weight streamed from memory (``RiverFp32Linear.measure(...,
grid=True)``, one run): one row 361 µs against river-fp32's 1472 and prepacked oneDNN's 1167; past a
few rows the products turn compute-bound, and the grid's lead narrows (8 rows 899 µs against oneDNN's
1485, 16 rows 1417 against 1901).

Exactness: :func:`grid_weights` keeps a grid only when the C++ kernel's own dequantization
(``grid_equals``: ``grid_dequant``'s fma, the product's) gives every element of the model's fp32 weight, so a
product on the grid is the fp32 product on the model's weights; it differs from ``F.linear`` by fp32
summation order only (relative error ~1e-7), as river-fp32 does. :class:`GridLinear` (a
``TorchFunctionMode`` with the interface of :class:`~river_hf.quant.dense_river.RiverFp32Linear`)
reroutes the calls on those weights; a weight changed after the grid was read (``load_state_dict``,
a PEFT merge: :class:`~river_hf.quant.dense.WeightFingerprint`) loses its grid at the next
:meth:`GridLinear.refresh`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from . import river_int4
from .dense import _PLAIN, WeightFingerprint, _check_rows, _linear_args
from .gguf_index import gguf_tensors

__all__ = ["GridWeight", "GridLinear", "grid_weights", "GRID_FORMATS", "MAX_ROWS"]

#: most rows a call is rerouted: past a few rows the product is compute-bound (module docstring), and
#: a default lossless verify has 16
MAX_ROWS = 16


def _half(blocks, start):
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs):
    """[n, 16 * m] bytes -> [n, 32 * m] values, gguf-py's order (each 16 bytes' low nibbles, then high)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _q4_0(b):
    return (_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)), _half(b, 0), None, 32


def _q4_1(b):
    return _nibbles(b[:, 4:]).astype(np.int8), _half(b, 0), _half(b, 2), 32


def _high_bits(qh):
    return ((qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32))
            & np.uint32(1)).astype(np.uint8)


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _half(b, 0), None, 32


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << np.uint8(4))
    return q.astype(np.int8), _half(b, 0), _half(b, 2), 32


def _q8_0(b):
    return b[:, 2:].copy().view(np.int8), _half(b, 0), None, 32


def _k_scales(b):
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    d, dmin = _half(b, 0), _half(b, 2)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(b):
    n = b.shape[0]
    q = b[:, 16:].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    scale, offset = _k_scales(b)
    return (q & np.uint8(0x0F)).reshape(n, -1).astype(np.int8), scale, offset, 32


def _q5_k(b):
    n = b.shape[0]
    ql = b[:, 48:].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = (ql & np.uint8(0x0F)).reshape(n, -1, 32) | ((qh & np.uint8(1)).reshape(n, -1, 32) << np.uint8(4))
    scale, offset = _k_scales(b)
    return q.reshape(n, -1).astype(np.int8), scale, offset, 32


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, :128].reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, -1, 32)
    qh = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, -1, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    scale = _half(b, 208) * b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q.reshape(n, -1), scale, None, 16


#: GGUF block formats whose dequantization is ``fl(scale * q + offset)`` per group: name -> parser of
#: ``uint8 [blocks, block bytes]`` into ``(q int8 [blocks, block size], scale float32 [blocks, groups],
#: offset float32 or None, group size)``; each mirrors gguf-py's ``dequantize_blocks`` of that format
GRID_FORMATS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
                "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


class GridWeight:
    """One weight ``[out_features, in_features]`` on its grid, packed for ``grid_mm`` (blocks of 4
    rows, each one stream of int8 ``q`` and fp32 group scales and offsets; ``csrc/river_int4.cpp``).

    Args:
        q: int8 ``[out, in]``; scale: float32 ``[out, in / group]``; offset: the same or None.

    Raises:
        RiverError: the kernel cannot run here (:func:`~river_hf.quant.river_int4.extension`).
        RuntimeError: the shapes do not fit (the group size must divide ``in`` and be a multiple of
            16 on AVX-512, 8 on AVX2).
    """

    __slots__ = ("packed", "out_features", "in_features", "group", "has_offset")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None):
        self.out_features, self.in_features = q.shape
        self.group = self.in_features // scale.shape[1]
        self.has_offset = offset is not None
        self.packed = river_int4.extension().grid_pack(q, scale, offset)

    @property
    def nbytes(self) -> int:
        """Bytes of memory the packed grid takes."""
        return self.packed.numel()

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` the product multiplies by (the kernel's own fma)."""
        return river_int4.extension().grid_dequant(self.packed, self.out_features, self.in_features, self.group,
                                                   self.has_offset)

    def equals(self, weight: torch.Tensor) -> bool:
        """Whether :meth:`dequantize` equals ``weight`` (float32 ``[out, in]``) in every element, as
        ``torch.equal``, read once without the dequantized copy."""
        return bool(river_int4.extension().grid_equals(self.packed, self.out_features, self.in_features, self.group,
                                                       self.has_offset, weight))

    def mm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` float32 ``[..., in]`` times the weight (plus ``bias`` float32 ``[out]``): ``[..., out]``."""
        return river_int4.extension().grid_mm(x, self.packed, self.out_features, self.in_features, self.group,
                                              self.has_offset, bias)


def _reverse_permute(rows: int, heads: int) -> np.ndarray:
    """The row order transformers' GGUF loader gives a Llama ``attn_q`` / ``attn_k`` weight (it undoes
    llama.cpp's rotary permutation: ``reverse_permute_weights``), applied to row indices."""
    idx = np.arange(rows)
    return idx.reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def grid_weights(model, gguf_path: str, linears: dict[str, torch.nn.Linear]) -> tuple[dict, dict]:
    """Read the grids of ``linears`` (``{name in the architecture: nn.Linear}``, e.g.
    ``model.layers.0.mlp.up_proj``) from the GGUF file ``gguf_path`` the model was converted from,
    keeping each only where it reproduces the Linear's fp32 weight exactly (module docstring).

    Names are mapped by gguf-py's own table (``gguf.get_tensor_name_map``); a head tied to the
    embeddings is looked for under the GGUF's ``output`` and ``token_embd``. Takes a few seconds a
    GB of weights (parsing, packing, and one dequantizing read of each grid to check it); the
    file's tensor table is kept after its first read (:func:`~river_hf.quant.gguf_index.gguf_tensors`).

    Returns:
        ``({nn.Linear: GridWeight}, info)``; ``info`` has ``kept`` and ``skipped`` (``{name: why}``:
        no such tensor, a format that is not a grid, values that differ) and ``bytes`` (memory of
        the kept grids).

    Raises:
        OSError / ValueError: the file cannot be read as a GGUF (gguf-py's errors).
    """
    import gguf

    arch, tensors = gguf_tensors(gguf_path)
    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    config = model.config
    blocks = int(getattr(config, "num_hidden_layers", 0) or 0)
    names = gguf.get_tensor_name_map(arch_id, blocks) if arch_id is not None else None
    kept, skipped, nbytes = {}, {}, 0
    for name, linear in linears.items():
        found = names.get_name(name) if names is not None else None
        candidates = [f"{found}.weight"] if found else []
        if name.endswith("lm_head"):
            candidates += [c for c in ("output.weight", "token_embd.weight") if c not in candidates]
        why = "no tensor of that name in the GGUF"
        for tname in candidates:
            t = tensors.get(tname)
            if t is None:
                continue
            grid, why = _grid_of(t, linear.weight, config)
            if grid is not None:
                kept[linear] = grid
                nbytes += grid.nbytes
                break
        else:
            skipped[name] = why
    return kept, {"kept": len(kept), "skipped": skipped, "bytes": nbytes}


def _grid_of(t, weight: torch.Tensor, config):
    fmt = t.format
    parse = GRID_FORMATS.get(fmt)
    if parse is None:
        return None, f"{t.name} is {fmt}, not a grid format"
    k, n = (int(d) for d in t.shape[:2])
    if tuple(weight.shape) != (n, k) or weight.dtype != torch.float32:
        return None, f"{t.name} is {n}x{k}, the weight {tuple(weight.shape)} {weight.dtype}"
    raw = np.asarray(t.data).reshape(-1)
    size = raw.size // (n * k // gguf_block_size(fmt))
    q, scale, offset, group = parse(raw.reshape(-1, size))
    q, scale = q.reshape(n, k), scale.reshape(n, k // group)
    offset = None if offset is None else offset.reshape(n, k // group)
    orders = [None]
    for heads in {getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)}:
        if heads and n % (2 * heads) == 0 and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            orders.append(_reverse_permute(n, heads))
    for order in orders:
        qq, ss, oo = (q, scale, offset) if order is None else (q[order], scale[order], None if offset is None else offset[order])
        grid = GridWeight(torch.from_numpy(np.ascontiguousarray(qq)), torch.from_numpy(np.ascontiguousarray(ss)),
                          None if oo is None else torch.from_numpy(np.ascontiguousarray(oo)))
        if grid.equals(weight.detach()):
            return grid, ""
    return None, f"{t.name} ({fmt}) does not give this weight's values"


def gguf_block_size(fmt: str) -> int:
    """Weights per block of a GGUF format (gguf-py's ``GGML_QUANT_SIZES``)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]][0]


class GridLinear(TorchFunctionMode):
    """Compute fp32 CPU ``F.linear`` calls of ``min_rows..max_rows`` rows on a weight that has a grid
    (:func:`grid_weights`) with ``grid_mm``; every other call goes to ``fallback`` (another mode of
    this interface, e.g. the verify kernel's) or to ``F.linear``.

    Inside the mode, ``F.linear(x, W, b)`` with ``x: float32 [..., in]`` on CPU and ``W`` a weight
    with a grid returns ``float32 [..., out]``, equal to ``F.linear`` up to fp32 summation order.

    Args:
        grids: ``{nn.Linear: GridWeight}``; each is fingerprinted now (:meth:`refresh` drops a grid
            whose weight changed since).
        min_rows, max_rows: the row counts rerouted (1 or 2; default :data:`MAX_ROWS`).
        fallback: the mode that takes the other calls, or None.

    Raises:
        ValueError: ``min_rows`` is not 1 or 2, or ``max_rows < min_rows``.
    """

    def __init__(self, grids: dict, min_rows: int = 1, max_rows: int = MAX_ROWS, fallback=None):
        super().__init__()
        _check_rows(min_rows, max(2, max_rows))
        if max_rows < min_rows:
            raise ValueError(f"max_rows must be >= min_rows ({min_rows}), got {max_rows!r}")
        self.min_rows, self.max_rows, self.fallback = min_rows, max_rows, fallback
        self._grids = {m: (grid, WeightFingerprint(m.weight)) for m, grid in grids.items()}
        self.calls_rerouted = 0
        self.dropped = 0
        self._by_weight = {}
        self.refresh()

    def refresh(self) -> int:
        """Drop the grids whose weight changed or was replaced (counted in ``dropped``) and refresh
        the fallback; returns what the fallback's refresh returned, else 0."""
        for m, (grid, print_) in list(self._grids.items()):
            if not print_.matches(m.weight):
                del self._grids[m]
                self.dropped += 1
        self._by_weight = {id(m.weight): (m.weight, grid) for m, (grid, _) in self._grids.items()}
        refresh = getattr(self.fallback, "refresh", None)
        return refresh() if refresh is not None else 0

    def with_rows(self, *, min_rows: int | None = None, max_rows: int | None = None) -> "GridLinear":
        """The same grids and fallback for other row counts (each defaults to this mode's)."""
        view = GridLinear.__new__(GridLinear)
        TorchFunctionMode.__init__(view)
        view.min_rows = self.min_rows if min_rows is None else min_rows
        view.max_rows = self.max_rows if max_rows is None else max_rows
        _check_rows(view.min_rows, max(2, view.max_rows))
        view.fallback, view._grids, view._by_weight, view.dropped = self.fallback, self._grids, self._by_weight, 0
        view.calls_rerouted = 0
        return view

    @property
    def grids(self) -> dict:
        """``{nn.Linear: GridWeight}`` of the weights it reroutes now."""
        return {m: grid for m, (grid, _) in self._grids.items()}

    @property
    def packed_bytes(self) -> int:
        """Bytes of memory the grids and the fallback's packed copy take."""
        return sum(g.nbytes for g, _ in self._grids.values()) + getattr(self.fallback, "packed_bytes", 0)

    def __len__(self) -> int:
        return len(self._grids)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = _linear_args(func, args, kwargs)
        if call is not None:
            x, weight, bias = call
            held = self._by_weight.get(id(weight))
            if (held is not None and held[0] is weight and type(x) in _PLAIN and x.dtype == torch.float32
                    and x.device.type == "cpu" and x.dim() and x.shape[-1] == weight.shape[1]
                    and (bias is None or (type(bias) in _PLAIN and bias.dtype == torch.float32 and bias.dim() == 1))):
                rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
                if self.min_rows <= rows <= self.max_rows:
                    self.calls_rerouted += 1
                    return held[1].mm(x, bias)
        if self.fallback is not None:
            return self.fallback.__torch_function__(func, types, args, kwargs)
        return func(*args, **kwargs)
