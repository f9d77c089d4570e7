"""Where River's backbone reads its weights' GGUF grid from (``RiverConfig.backbone_grid``): the GGUF
file a model was converted from, and the grids of its backbone Linears (:mod:`river_hf.quant.grid`).

``auto`` finds the file for a registry model and a River folder saved from one (``river-hf``
converts it from the GGUF it keeps in ``$RIVER_HF_CACHE/gguf/``); a path names it for any other model converted from a GGUF (transformers'
``from_pretrained(..., gguf_file=...)`` and ``save_pretrained``); ``off`` reads nothing. Every grid
is checked bit for bit against the weight it stands for, so a wrong file only costs the read: its
weights are skipped, and ``river_stats()["backbone_kernel"]`` / ``["lossless"]["verify_kernel"]``
say how many were kept.
"""

from __future__ import annotations

import os
import warnings

import torch

from ..files import cache_dir
from .serialization import _registry_entry

__all__ = ["source_gguf", "backbone_grids", "BACKBONE_GRID_VALUES"]

#: the named values of ``RiverConfig.backbone_grid`` (any other value is a GGUF file's path)
BACKBONE_GRID_VALUES = ("auto", "off")


def source_gguf(model) -> str | None:
    """The GGUF file of the registry model ``model``'s weights come from (its converted folder, or a
    River folder saved from one: ``river_source``), where ``river-hf`` keeps it
    (``$RIVER_HF_CACHE/gguf/<key>.gguf``); None otherwise. Each grid read from it is still checked
    against its weight."""
    entry = _registry_entry(model)
    if entry is None:
        return None
    gguf = cache_dir() / "gguf" / f"{entry.key}.gguf"
    return str(gguf) if gguf.is_file() else None


def _named_backbone_linears(model) -> dict[str, torch.nn.Linear]:
    """``{name in the architecture: nn.Linear}`` of the fp32 CPU backbone Linears and the original LM head."""
    backbone = {id(m) for m in model.river_backbone_modules() if isinstance(m, torch.nn.Linear)}
    named = {}
    for name, m in model.named_modules():
        if id(m) in backbone and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
            named.setdefault(name, m)
    head = model.get_output_embeddings()
    head = getattr(head, "backbone", head)
    if isinstance(head, torch.nn.Linear) and head not in named.values() and head.weight.dtype == torch.float32:
        named["lm_head"] = head
    return named


def backbone_grids(model, memory_limit: int | None) -> tuple[dict, dict]:
    """The grids of ``model``'s backbone Linears (``{nn.Linear: GridWeight}``) as
    ``model.river_config.backbone_grid`` asks, and ``info``: ``source`` (the file, or None), ``kept``,
    ``skipped`` (count), ``bytes`` (memory they take) and ``why`` (empty when some were kept).

    ``memory_limit``: bytes the grids may take (None: no limit); grids past it are not read (the
    backbone's deepest layers first left out), and ``why`` says so. Never raises for a file that is
    not the model's (its weights are skipped); a file that cannot be read gives ``why``.
    """
    from ..quant import river_int4
    from ..quant.grid import grid_weights

    info = {"source": None, "kept": 0, "skipped": 0, "bytes": 0, "why": ""}
    setting = model.river_config.backbone_grid
    if setting == "off":
        return {}, {**info, "why": "backbone_grid='off'"}
    if not river_int4.works():
        return {}, {**info, "why": f"river-grid cannot run here: {river_int4.unavailable_reason()}"}
    path = source_gguf(model) if setting == "auto" else os.path.expanduser(setting)
    if path is None:
        return {}, {**info, "why": "no GGUF file known for this model (backbone_grid='auto' knows the registry "
                                   "models' own; give backbone_grid=PATH for another model converted from a GGUF)"}
    linears = _named_backbone_linears(model)
    if memory_limit is not None:
        total, within = 0, {}
        for name, m in linears.items():  # in module order: the first layers, which River runs most, first
            total += m.weight.numel() * 5 // 4  # a grid's bytes: ~1.25 a weight
            if total <= memory_limit:
                within[name] = m
        if len(within) < len(linears):
            info["why"] = f"{len(linears) - len(within)} Linears left out: their grids would pass the memory limit"
        linears = within
    try:
        grids, read = grid_weights(model, path, linears)
    except Exception as e:  # a broken file raises whatever gguf-py's parse meets (ValueError, IndexError, ...)
        grids, read = {}, {"kept": 0, "skipped": {}, "bytes": 0}
        info["why"] = f"{path} could not be read as a GGUF file ({type(e).__name__}: {e})"
    info.update(source=path, kept=read["kept"], skipped=len(read["skipped"]), bytes=read["bytes"])
    if not grids and not info["why"]:
        info["why"] = f"no weight of this model is on a grid of {path}"
    if not grids and setting != "auto":  # a file the user named that gave nothing: say so once
        warnings.warn(f"River backbone_grid={setting!r}: {info['why']}; the backbone reads its fp32 weights",
                      UserWarning, stacklevel=2)
    return grids, info
