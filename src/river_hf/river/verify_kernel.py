"""The kernel of lossless mode's backbone passes (:func:`verify_mode`), of route mode's backbone
layers (:func:`backbone_mode`, the same packed copy) and the unit lossless costs are counted in
(:func:`backbone_step_seconds`).

A lossless call's verify passes (k + 1 rows) and its prompt pass run on the backbone; on fp32 CPU
models their Linears may run through :class:`river_hf.quant.dense.PrepackedLinear` (oneDNN on a
prepacked copy of the weights) where that measured faster and the copy fits in memory
(``RiverConfig.verify_kernel``). :func:`verify_mode` decides once per model and refreshes the copy
on every call; the call holds the result (``GenerateCall.verify_linear``) and forward hooks on the
backbone's Linears enter it in backbone passes (:func:`backbone_hooks`).
"""

from __future__ import annotations

import threading
import time

import torch

from ..quant.dense import PrepackedLinear, linear_mode_hooks, onednn_available
from ..quant.dense_river import MAX_ROWS as RIVER_FP32_MAX_ROWS, RiverFp32Linear, river_fp32_works
from ..quant.grid import GridLinear
from .backbone_grid import backbone_grids
from .draft_schedule import row_cost_curve
from .layer import BACKBONE_ONLY, LOSSLESS

__all__ = ["verify_mode", "backbone_mode", "backbone_hooks", "backbone_step_seconds", "available_memory_bytes",
           "verify_row_costs", "PACK_MEMORY_SHARE", "PROMPT_TIMED_ROWS", "PROMPT_MAX_ROWS", "COST_ROWS"]


_PACK_LOCK = threading.Lock()
PACK_MEMORY_SHARE = 0.5  # the packed copy may take at most this share of the memory available when it is built
#: rows at which ``auto`` times prompt passes (a prompt of a few sentences or a short function) ...
PROMPT_TIMED_ROWS = 128
#: ... and the most rows a prompt pass reroutes to the packed copy when oneDNN won there
PROMPT_MAX_ROWS = 1 << 20
#: row counts at which :func:`verify_row_costs` times a backbone product (a batch of 4 with 15
#: drafts verifies 64 rows, of 8: 128)
COST_ROWS = (1, 8, 16, 32, 64, 128)
#: row counts at which ``auto`` times river-grid against the kernel the other modes give those rows;
#: the grid takes calls up to the last count it won at, from one row on
GRID_TIMED_ROWS = (1, 4, 8, 16)
#: the rows river-grid takes unmeasured (``RIVER_HF_AUTOTUNE=0``): at one row it reads ~1/3 of the
#: bytes; on the 2-core AMD EPYC Zen 5 it also won at 8 and 16 rows (:mod:`~river_hf.quant.grid`), but
#: an AVX2 build runs passes of 2 rows (AVX-512: 6), untimed past 4
GRID_PRIOR_ROWS = 4


def available_memory_bytes() -> int | None:
    """Memory the kernel says is available now (``MemAvailable`` of ``/proc/meminfo``, bytes), or
    None where it cannot be read (then River does not pack)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _candidates(river: bool = True) -> tuple[str, ...]:
    """The dense modes timed against ``F.linear`` here: ``onednn`` where this torch has it,
    ``river-fp32`` (when ``river``) where its kernel runs."""
    return ("torch", *(("onednn",) if onednn_available() else ()),
            *(("river-fp32",) if river and river_fp32_works() else ()))


def _timed(tuner, k_in: int, k_out: int, rows: int, names: tuple[str, ...] | None = None) -> tuple[str, dict]:
    """``F.linear`` against the other dense modes ``names`` (default :func:`_candidates`) on a
    ``k_in x k_out`` fp32 product at ``rows`` rows, weights streamed from memory, all in one run
    (``tuner.choose_mode``: cached in ``kernels.json``): the fastest one's name and every timing (µs)."""
    from ..quant.autotune import LinearSpec, last_level_cache_bytes

    names = _candidates() if names is None else names
    available = available_memory_bytes() or 0
    stream = min(2 * last_level_cache_bytes(), int(0.1 * available)) if available else None
    if "river-fp32" in names:
        def measure():
            return RiverFp32Linear.measure(k_in, k_out, rows, stream_bytes=stream, grid="river-grid" in names)
    else:
        def measure():
            return PrepackedLinear.measure(k_in, k_out, rows, stream_bytes=stream)
    return tuner.choose_mode(LinearSpec(k_in, k_out, False), rows, names,
                             lambda: {k: v for k, v in measure().items() if k in names})


def _faster(timings: dict, name: str, than: str = "torch") -> bool:
    return name in timings and timings[name] < timings[than]


def _representative_shape(linears, head) -> tuple[int, int]:
    """``(in_features, out_features)`` of the backbone Linear shape that holds the most weight bytes
    in total (an MLP projection in every model here), the LM head left out: timing it costs a few
    copies of one layer's product, not of a 0.5-3.7 GB head."""
    totals: dict[tuple[int, int], int] = {}
    for m in linears:
        if m is head:
            continue
        shape = (m.in_features, m.out_features)
        totals[shape] = totals.get(shape, 0) + m.weight.numel()
    if not totals:
        return head.in_features, head.out_features
    return max(totals, key=totals.get)


def verify_mode(model, choice: str, rows: int):
    """The ``TorchFunctionMode`` the verify passes of ``model`` run in (or None: plain ``F.linear``)
    and a dict saying why (``model._river_verify_linear[1]``, reported in ``river_stats["lossless"]
    ["verify_kernel"]``).

    ``choice`` is ``RiverConfig.verify_kernel``; ``rows`` the most rows a verify pass runs
    (``max_draft_tokens + 1``). The decision is taken once per model (the first lossless call):

    - ``torch``, no oneDNN in this torch, or no fp32 CPU backbone Linear: no packing.
    - The packed copy (as many bytes as the fp32 backbone Linears, the LM head included) must fit:
      it is built only when it takes at most :data:`PACK_MEMORY_SHARE` of the memory available
      (``/proc/meminfo``) at that moment; otherwise plain ``F.linear`` is used and a warning says so,
      for ``onednn`` too.
    - ``auto`` first times ``F.linear`` against oneDNN on the backbone's most common Linear shape
      (an MLP projection, not the LM head) at ``min(rows, 8)`` rows and packs only when oneDNN was
      faster (``RIVER_HF_AUTOTUNE=0``: no measurement, no packing).
    - The prompt pass (prefill) is a backbone pass too: once the copy is packed, ``auto`` also times
      the two at :data:`PROMPT_TIMED_ROWS` rows, and where oneDNN wins there the mode reroutes
      calls of up to :data:`PROMPT_MAX_ROWS` rows, so the prompt is read through the packed copy
      as well (on the 2-core AMD EPYC Zen 5, 0.5B: time to first token 0.88 s on ``F.linear``,
      0.41 s for the plain model on the packed copy); ``onednn`` always does. ``info["prompt"]``
      says which. A one-row call (the prompt pass's LM head, whose ``logits_to_keep=1`` leaves one
      row; a verify of no draft) goes to the copy where oneDNN also won at one row, the measurement
      :func:`backbone_mode` takes (``info["one_row"]``); ``onednn`` always. The timing goes through
      :meth:`river_hf.quant.autotune.KernelTuner.choose_mode`: cached in ``kernels.json`` with the
      exit kernels' timings, so a second process on this machine measures nothing.

    Every later call only :meth:`~river_hf.quant.dense.PrepackedLinear.refresh` es the copy: weights
    changed since they were packed (``load_state_dict``, ``param.data = ...``, a PEFT merge) are
    repacked, so a verify always computes with the model's current weights. Opt out with
    ``RiverConfig(verify_kernel="torch")``.

    Returns:
        ``(mode or None, info)``; ``info`` has ``kernel`` (``onednn-prepacked`` or ``torch``),
        ``why``, ``packed_bytes`` (memory the copy adds, bytes), ``timing_us`` (the measurement, or
        None), ``shape`` (the timed ``in x out``), ``max_rows`` (the verify rows), ``prompt`` (the
        kernel of prompt passes, ``onednn-prepacked`` or ``torch``), ``prompt_timing_us`` (its
        measurement at :data:`PROMPT_TIMED_ROWS` rows, or None), ``one_row`` and
        ``one_row_timing_us`` (the same at one row), ``repacked`` (weights repacked by this
        call's refresh) and ``grid`` (river-grid on top where the backbone has a GGUF grid:
        ``source``, ``kept``, ``skipped``, ``bytes``, ``timing_us``, ``max_rows``, ``why``; then
        ``one_row`` is ``river-grid``).
    """
    info = {"kernel": "torch", "why": "", "packed_bytes": 0, "timing_us": None, "shape": None,
            "max_rows": rows, "prompt": "torch", "prompt_timing_us": None, "one_row": "torch",
            "one_row_timing_us": None, "repacked": 0}
    if choice == "torch":
        return None, {**info, "why": "verify_kernel='torch'"}
    if not onednn_available() and not river_fp32_works():
        return None, {**info, "why": "this torch build has no oneDNN and river-fp32 cannot run here"}
    with _PACK_LOCK:
        cached = model.__dict__.get("_river_verify_linear")
        if cached is None:
            cached = _with_grids(model, *_decide_verify_kernel(model, choice, rows, dict(info)))
            model._river_verify_linear = cached
        mode, decided = cached
        info = dict(decided)
        if mode:
            info["repacked"] = mode.refresh()
            info["packed_bytes"] = mode.packed_bytes
        return mode or None, info


def _decide_verify_kernel(model, choice: str, rows: int, info: dict):
    import warnings

    from ..quant.autotune import default_tuner  # None when RIVER_HF_AUTOTUNE=0

    head = model.get_output_embeddings()
    head = getattr(head, "backbone", head)
    linears = [m for m in model.river_backbone_modules() if isinstance(m, torch.nn.Linear)
               and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    if not linears:
        return False, {**info, "why": "no fp32 CPU backbone Linear"}
    if choice == "river-fp32":
        if not river_fp32_works():
            why = "river-fp32 cannot run here: verify passes use F.linear"
            warnings.warn(f"River lossless verify_kernel='river-fp32': {why}", UserWarning, stacklevel=4)
            return False, {**info, "why": why}
        mode = RiverFp32Linear(linears, min_rows=1, max_rows=max(2, min(rows, RIVER_FP32_MAX_ROWS)))
        return mode, {**info, "kernel": "river-fp32", "why": "verify_kernel='river-fp32'", "one_row": "river-fp32"}
    need = sum(m.weight.numel() * 4 for m in linears)
    available = available_memory_bytes()
    pack_why = None
    if not onednn_available():
        pack_why = "this torch build has no oneDNN"
    elif available is None or need > PACK_MEMORY_SHARE * available:
        have = "unknown" if available is None else f"{available / 1e9:.1f} GB"
        pack_why = (f"a packed copy of the backbone Linears needs {need / 1e9:.2f} GB, more than "
                    f"{PACK_MEMORY_SHARE:.0%} of the memory available ({have}): verify passes use F.linear")
    if choice == "onednn":
        if pack_why is not None:
            warnings.warn(f"River lossless verify_kernel='onednn': {pack_why}", UserWarning, stacklevel=4)
            return False, {**info, "why": pack_why}
        mode = PrepackedLinear(linears, max_rows=PROMPT_MAX_ROWS, min_rows=1)
        return mode, {**info, "kernel": "onednn-prepacked", "why": "verify_kernel='onednn'",
                      "packed_bytes": mode.packed_bytes, "prompt": "onednn-prepacked", "one_row": "onednn-prepacked"}
    tuner = default_tuner()
    if tuner is None:
        return False, {**info, "why": "RIVER_HF_AUTOTUNE=0: not measured, not packed"}
    k_in, k_out = _representative_shape(linears, head)
    verify_rows = max(2, min(rows, RIVER_FP32_MAX_ROWS))
    best, timing = _timed(tuner, k_in, k_out, verify_rows)
    info.update(timing_us=timing, shape=f"{k_in}x{k_out}")
    river_rows = best == "river-fp32"  # a verify pass's rows (up to RIVER_FP32_MAX_ROWS) on river-fp32
    packed = None
    if pack_why is None and _faster(timing, "onednn"):  # oneDNN beat F.linear at the verify rows: pack
        info["prompt_timing_us"] = _timed(tuner, k_in, k_out, PROMPT_TIMED_ROWS, ("torch", "onednn"))[1]
        prompt = _faster(info["prompt_timing_us"], "onednn")
        _, info["one_row_timing_us"] = _timed(tuner, k_in, k_out, 1)
        one_row = _faster(info["one_row_timing_us"], "onednn")
        packed = PrepackedLinear(linears, max_rows=PROMPT_MAX_ROWS if prompt else max(2, rows),
                                 min_rows=1 if one_row else 2)
        info.update(kernel="onednn-prepacked", packed_bytes=packed.packed_bytes,
                    prompt="onednn-prepacked" if prompt else "torch",
                    one_row="onednn-prepacked" if one_row else "torch",
                    why="prepacked oneDNN measured faster than F.linear")
    elif pack_why is None:
        info["why"] = "F.linear measured faster than prepacked oneDNN"
    else:
        info["why"] = pack_why
    if "river-fp32" in timing:
        if info["one_row_timing_us"] is None:
            _, info["one_row_timing_us"] = _timed(tuner, k_in, k_out, 1)
        one_row_river = min(info["one_row_timing_us"], key=info["one_row_timing_us"].get) == "river-fp32"
        if river_rows or one_row_river:
            mode = RiverFp32Linear(linears, min_rows=1 if one_row_river else 2,
                                   max_rows=verify_rows if river_rows else 1, fallback=packed)
            if river_rows:
                info["kernel"] = "river-fp32"
            if one_row_river:
                info["one_row"] = "river-fp32"
            info["why"] = (f"river-fp32 measured fastest at {'one row' if not river_rows else f'{verify_rows} rows'}"
                           + (" and one row" if river_rows and one_row_river else "") + "; " + info["why"])
            return mode, {**info, "max_rows": rows}
    return packed or False, info


def kernel_at(mode, rows: int) -> str:
    """The dense mode name (``river-grid``, ``river-fp32``, ``onednn`` or ``torch``) that takes an
    fp32 call of ``rows`` rows inside ``mode`` (a verify or backbone mode, or None), down its
    fallbacks (``river-grid`` for the weights that have a grid)."""
    while mode is not None:
        if mode.min_rows <= rows <= mode.max_rows:
            return ("river-grid" if isinstance(mode, GridLinear) else "river-fp32" if isinstance(mode, RiverFp32Linear)
                    else "onednn")
        mode = getattr(mode, "fallback", None)
    return "torch"


def _with_grids(model, mode, info: dict):
    """``(mode, info)`` of the verify kernel decision with river-grid on top where the model's
    backbone weights have a GGUF grid (:func:`~river_hf.river.backbone_grid.backbone_grids`, within
    the packing's memory rule): a :class:`~river_hf.quant.grid.GridLinear` falling back to ``mode``
    for calls of more rows than the grid won at (``auto``: timed at :data:`GRID_TIMED_ROWS` against
    the kernel ``mode`` gives those rows, cached in ``kernels.json``; ``RIVER_HF_AUTOTUNE=0``: up to
    :data:`GRID_PRIOR_ROWS`). ``info["grid"]`` says what was read and why not, where not."""
    if not river_fp32_works():  # (verify_kernel='torch' never gets here: verify_mode returns first)
        return mode, {**info, "grid": {"why": "river-hf's C++ kernels cannot run here"}}
    available = available_memory_bytes()
    limit = 0 if available is None else max(0, int(PACK_MEMORY_SHARE * available) - info.get("packed_bytes", 0))
    grids, grid_info = backbone_grids(model, limit)
    info = {**info, "grid": grid_info}
    if not grids:
        return mode, info
    rows, grid_info["timing_us"] = _grid_rows(model, mode or None, grids)
    grid_info["max_rows"] = rows
    if rows == 0:
        grid_info["why"] = "river-grid measured slower at one row than the kernel it would replace"
        return mode, info
    grid_mode = GridLinear(grids, min_rows=1, max_rows=rows, fallback=mode or None)
    _count_grid_bytes(model, grids)
    return grid_mode, {**info, "one_row": "river-grid", "packed_bytes": grid_mode.packed_bytes}


def _count_grid_bytes(model, grids) -> None:
    """Recount the model's weight bytes per decode step (``_river_step_bytes``, the GB/s figures of
    ``river_stats``) with each backbone Linear that has a grid at the grid's bytes, as a one-row step reads it."""
    step_bytes, layers = model.__dict__.get("_river_step_bytes"), getattr(model.river, "layers", None)
    if not step_bytes or not layers:
        return

    def saved(module) -> int:
        return sum(m.weight.numel() * m.weight.element_size() - grids[m].nbytes for m in module.modules() if m in grids)

    delta = [saved(getattr(layer, "backbone", layer)) for layer in layers]
    head = model.get_output_embeddings()
    head_delta = saved(getattr(head, "backbone", head)) if head is not None else 0
    model._river_step_bytes = {name: [b - sum(delta[:k]) - (head_delta if k == len(layers) else 0)
                                      for k, b in enumerate(row)] for name, row in step_bytes.items()}


def _grid_rows(model, fallback, grids) -> tuple[int, dict | None]:
    """The most rows river-grid takes (0: none) and the timings (µs by rows, or None unmeasured)."""
    from ..quant.autotune import default_tuner

    tuner = default_tuner()
    if tuner is None:
        return GRID_PRIOR_ROWS, None
    head = model.get_output_embeddings()
    k_in, k_out = _representative_shape(list(grids), getattr(head, "backbone", head))
    names, rows, timings = (*_candidates(), "river-grid"), 0, {}
    for count in GRID_TIMED_ROWS:
        timings[count] = _timed(tuner, k_in, k_out, count, names)[1]
        if timings[count]["river-grid"] >= timings[count][kernel_at(fallback, count)]:
            break
        rows = count
    return rows, timings


def verify_row_costs(model, mode):
    """``v(rows)``, what a verify pass of ``rows`` rows costs over a one-row backbone pass on this
    machine, for the ``cost`` draft schedule (:mod:`~river_hf.river.draft_schedule`); None where
    it is not measured (``RIVER_HF_AUTOTUNE=0``, no oneDNN in this torch, no fp32 CPU backbone
    Linear): the schedule then takes a verify to cost one pass whatever its rows.

    The backbone's most common Linear shape (the one :func:`verify_mode` times, an MLP
    projection) is timed at each of :data:`COST_ROWS` rows on the kernel a verify pass of that many
    rows runs on (``mode``, the call's verify mode: river-grid, river-fp32 or prepacked oneDNN for
    the rows each reroutes, else ``F.linear``); each point is that time over the one-row time of
    the fastest kernel in ``mode``'s chain (``F.linear`` included): the one-row pass the ``cost``
    schedule's draft cost is counted in (:func:`~river_hf.river.draft_schedule.bytes_cost`, weight
    bytes at the backbone's one-row rate: with river-grid, the grid's bytes). Each kernel's own
    one-row time was the unit before; with river-grid taking one row at ~1/3 of oneDNN's time that
    priced a verify past the grid's rows at a third of its cost against the drafts.
    :func:`~river_hf.river.draft_schedule.row_cost_curve` interpolates between the points. Decode
    streams the weights, so up to some rows a pass costs about one one-row pass of the same kernel;
    past them the products turn compute-bound (on the 2-core AMD EPYC Zen 5, Qwen2.5-Coder-0.5B,
    prepacked oneDNN over its own one-row time: 1.02 at 8 rows, 1.40 at 16, 2.35 at 32, 4.23 at 64).
    The timings go through
    :meth:`river_hf.quant.autotune.KernelTuner.choose_mode`, cached in ``kernels.json`` with the
    exit kernels' (a second process measures nothing); the curve is kept on the model
    (``_river_verify_costs``) for its later calls.
    """
    cached = model.__dict__.get("_river_verify_costs")
    if cached is not None:
        return cached or None
    from ..quant.autotune import default_tuner

    tuner = default_tuner()
    linears = [m for m in model.river_backbone_modules() if isinstance(m, torch.nn.Linear)
               and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    chain, link = [], mode
    while link is not None:
        chain, link = chain + [link], getattr(link, "fallback", None)
    names = _candidates(river=any(isinstance(m, (RiverFp32Linear, GridLinear)) for m in chain))
    if any(isinstance(m, GridLinear) for m in chain):
        names = (*names, "river-grid")
    if tuner is None or not linears or len(names) == 1:
        return None  # not kept: a later call may have a tuner (RIVER_HF_AUTOTUNE set again)
    head = model.get_output_embeddings()
    k_in, k_out = _representative_shape(linears, getattr(head, "backbone", head))

    timings = {rows: _timed(tuner, k_in, k_out, rows, names)[1] for rows in COST_ROWS}
    one_row = min(timings[1][kernel_at(link, 1)] for link in (*chain, None))
    points = [(rows, timings[rows][kernel_at(mode, rows)] / one_row) for rows in COST_ROWS]
    curve = model._river_verify_costs = row_cost_curve(points)
    return curve


def backbone_mode(model, choice: str):
    """The ``TorchFunctionMode`` a route-mode call's backbone layers and original LM head run their
    Linears in (or None: plain ``F.linear``), and a dict saying why (``river_stats["backbone_kernel"]``).

    River's route mode runs its first layers, and every layer of a row that has not exited, on the
    fp32 backbone. A one-row fp32 product through ``F.linear`` (MKL) reads the weights at about
    half the rate oneDNN reaches on a prepacked copy on AMD EPYC (see
    :class:`~river_hf.quant.dense.PrepackedLinear`'s ``min_rows``), and at batch 4 and 8 the plain
    model on the packed copy decodes 2.7x / 2.4x faster than on ``F.linear`` there
    (``docs/results/epyc-zen5-2core/``, ``unmodified-onednn``). This mode is a view of lossless mode's packed copy
    (:func:`verify_mode`, the same memory rule; no second copy when both modes are used) that also
    takes one-row calls. ``choice`` is ``RiverConfig.backbone_kernel``:

    - ``torch``: no packing. The rules in force can never exit (τ > 1): none either, so τ > 1 stays
      the plain model token for token (oneDNN sums in another order than ``F.linear``).
    - ``auto``: the copy exists (:func:`verify_mode` ``auto`` packed it) and oneDNN measured faster
      than ``F.linear`` at one row on the backbone's most common Linear shape (cached in
      ``kernels.json``; ``RIVER_HF_AUTOTUNE=0``: not measured, not used).
    - ``onednn``: the copy is built (memory permitting) and used, unmeasured.

    Tokens change only by the summation order of the products (relative error ~1e-6), like any
    River pass that runs other kernels; the backbone's modules are not touched.

    Returns:
        ``(mode or None, info)``; ``info`` has ``kernel`` (``onednn-prepacked`` or ``torch``),
        ``why``, ``packed_bytes`` (memory the copy takes, bytes, shared with lossless mode),
        ``timing_us`` (the one-row measurement, or None) and ``max_rows`` (the most rows a call may
        have to go to oneDNN).
    """
    info = {"kernel": "torch", "why": "", "packed_bytes": 0, "timing_us": None, "max_rows": 0}
    if choice == "torch":
        return None, {**info, "why": "backbone_kernel='torch'"}
    if not model.river.rules.may_exit():
        return None, {**info, "why": "the rules never exit (τ > 1): the plain model's own kernels"}
    copy, copy_info = verify_mode(model, choice, model.river_config.max_draft_tokens + 1)
    if copy is None:
        return None, {**info, "why": copy_info["why"]}
    timing = copy_info["one_row_timing_us"]
    kernel = kernel_at(copy, 1)
    if kernel == "torch":
        return None, {**info, "why": "F.linear measured fastest at one row", "timing_us": timing}
    why = (f"backbone_kernel={choice!r}" if choice != "auto"
           else f"{'prepacked oneDNN' if kernel == 'onednn' else kernel} measured fastest at one row")
    mode = copy.with_rows()  # a view: its own count of rerouted calls
    return mode, {**info, "kernel": copy_info["one_row"], "why": why, "timing_us": timing,
                  "packed_bytes": copy.packed_bytes, "max_rows": _max_rows(copy), "grid": copy_info.get("grid")}


def _max_rows(mode) -> int:
    """The most rows a call may have to be rerouted by ``mode`` or its fallbacks."""
    rows = 0
    while mode is not None:
        rows, mode = max(rows, mode.max_rows), getattr(mode, "fallback", None)
    return rows


def backbone_hooks(linears, router) -> list:
    """Forward hooks on each of ``linears`` (the backbone decoder layers' ``nn.Linear`` modules and
    the original LM head) that run the Linear inside its call's kernel mode: a lossless call's
    :attr:`~river_hf.river.call.GenerateCall.verify_linear` in its backbone passes (prefill and
    verify, ``router.mode`` lossless), else the call's :attr:`~river_hf.river.call.GenerateCall.backbone_linear`
    (route mode's backbone layers); nothing outside a ``generate`` call. Only the Linears: the
    layers' other ops (norms, rotary, attention) and the exit layers pay no mode dispatch
    (:func:`~river_hf.quant.dense.linear_mode_hooks`). Returns the handles."""

    def pick():
        call = router.current_call
        if call is None:
            return None
        return call.verify_linear if router.mode == LOSSLESS else call.backbone_linear

    return linear_mode_hooks(linears, pick)


def backbone_step_seconds(model, repeats: int = 3) -> float:
    """Seconds of one one-token decode pass of ``model``'s backbone (the unit of the lossless
    costs in ``river_stats["lossless"]``): the median of ``repeats`` passes on a fresh cache after
    one untimed pass, in ``backbone`` mode, plain kernels. Measured on the first lossless call of a
    model and kept (``_river_backbone_step``); about ``repeats + 1`` decode steps once."""
    cached = model.__dict__.get("_river_backbone_step")
    if cached is not None:
        return cached
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    times = []
    # its own recording: these passes are not the call's, so they stay out of its river_stats
    # (forward passes, weight bytes per token, GB/s)
    with model.river.recording(), model.river.override(mode=BACKBONE_ONLY), torch.no_grad():
        cache = DynamicCache(config=model.config)
        for i in range(repeats + 1):
            start = time.perf_counter()
            model(input_ids=ids, position_ids=torch.full((1, 1), i, dtype=torch.long, device=device), cache=cache,
                  use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - start)
    value = sorted(times[1:])[len(times[1:]) // 2]
    model._river_backbone_step = value
    return value
