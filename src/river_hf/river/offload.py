"""Backbone offloading: keep backbone layers ``offload_from``.. off the compute device.

River-LLM's memory claim: once most decode steps leave the backbone early, the deep backbone
layers are rarely run, so they need not stay resident; resident memory then approaches that of a
fully quantized model (embeddings + exit layers + the first few backbone layers).

``RiverConfig.offload_from = k`` keeps backbone layers ``k..L-1`` away from the compute device:

* on a GPU, in CPU memory (accelerate's CPU offload);
* on a CPU-only machine, on disk: the weights stay in the checkpoint's safetensors file (or, for
  a model already in memory, in accelerate's memory-mapped ``.dat`` files under
  ``RiverConfig.offload_dir``).

All of it runs on accelerate's hooks (:class:`accelerate.hooks.AlignDevicesHook` with
``offload=True`` on each Linear/Norm of an offloaded backbone layer): a layer's weights are read in
just before that layer's forward and dropped (back to the ``meta`` device) just after it, so at
most one offloaded backbone layer is resident at a time, and only in steps that actually run it.
Exit layers, embeddings, norms and the first ``k`` backbone layers stay on the compute device.
The arithmetic is the same as without offload, so τ > 1 stays token-identical (only slower).

Two entry points:
    :func:`loading_kwargs` turns ``from_pretrained`` kwargs into a ``device_map`` that never
    loads the offloaded layers (transformers + accelerate read them straight from the
    checkpoint's safetensors), so even the load never holds the whole model.
    :func:`offload_backbone` offloads the backbones of a River model already in memory.
:func:`build_exit_layer` builds an exit layer from an offloaded backbone (weights read in for
the copy, then dropped again).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from ..errors import RiverError
from .arch import decoder_stack

__all__ = ["loading_kwargs", "offload_backbone", "build_exit_layer", "materialized", "is_offloaded", "offload_device_map"]

_HOOK_ATTRS = ("_hf_hook", "_old_forward", "forward")


def is_offloaded(module: nn.Module) -> bool:
    """True when some submodule of ``module`` has its weights offloaded by an accelerate hook."""
    from accelerate.utils import has_offloaded_params

    return any(has_offloaded_params(m) for m in module.modules())


@contextlib.contextmanager
def materialized(module: nn.Module):
    """Within the block, every offloaded submodule of ``module`` holds its real weights on its
    execution device (accelerate's ``align_module_device`` applied to each hooked submodule);
    on exit they go back to ``meta``."""
    from accelerate.utils import align_module_device, has_offloaded_params

    with contextlib.ExitStack() as stack:
        for m in module.modules():
            if has_offloaded_params(m):
                stack.enter_context(align_module_device(m))
        yield module


@contextlib.contextmanager
def _hooks_detached(module: nn.Module):
    """Temporarily remove accelerate's hook attributes so that ``copy.deepcopy`` copies the layer
    only, not its hook (whose weights map may hold the whole offloaded state dict)."""
    stash = []
    for m in module.modules():
        saved = {a: m.__dict__.pop(a) for a in _HOOK_ATTRS if a in m.__dict__}
        if saved:
            stash.append((m, saved))
    try:
        yield module
    finally:
        for m, saved in stash:
            m.__dict__.update(saved)


def build_exit_layer(build, backbone: nn.Module) -> nn.Module:
    """``build(backbone)`` (a callable that returns the exit layer), also for an offloaded
    backbone: its weights are read in for the copy and dropped again, and the exit layer carries
    no offload hook (it stays on the compute device)."""
    if not is_offloaded(backbone):
        return build(backbone)
    with materialized(backbone), _hooks_detached(backbone):
        return build(backbone)


def _execution_device(device_map) -> torch.device:
    """The compute device implied by a ``from_pretrained`` ``device_map`` argument."""
    if isinstance(device_map, (str, torch.device, int)) and str(device_map) not in ("auto", "balanced", "sequential"):
        return torch.device(device_map if not isinstance(device_map, int) else f"cuda:{device_map}")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def offload_device_map(meta_model: nn.Module, offload_from: int, execution_device: torch.device) -> dict:
    """``device_map`` for ``from_pretrained``: decoder layers ``offload_from``.. go to ``"disk"``
    (CPU compute) or ``"cpu"`` (GPU compute); every other top-level module to ``execution_device``.

    Args:
        meta_model: the architecture built on the ``meta`` device (only names are read).
        offload_from: first offloaded decoder layer.
        execution_device: where the forward passes run.
    """
    _, layers = decoder_stack(meta_model)
    names = {id(m): n for n, m in meta_model.named_modules()}
    prefix = names[id(layers)]
    exec_dev = "cpu" if execution_device.type == "cpu" else str(execution_device)
    off_dev = "disk" if execution_device.type == "cpu" else "cpu"
    device_map: dict[str, str] = {}

    def walk(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            full = f"{path}{name}"
            if full == prefix:
                for i in range(len(layers)):
                    device_map[f"{full}.{i}"] = off_dev if i >= offload_from else exec_dev
            elif prefix.startswith(full + "."):
                walk(child, full + ".")
            else:
                device_map[full] = exec_dev

    walk(meta_model, "")
    return device_map


def loading_kwargs(path: str, river_config, kwargs: dict, config=None) -> dict:
    """``from_pretrained`` kwargs that load the backbone layers ``river_config.offload_from``..
    offloaded from the start (never resident during the load).

    Leaves ``kwargs`` unchanged when offload is off or the caller passed its own dict
    ``device_map``. Otherwise adds a ``device_map`` from :func:`offload_device_map` and an
    ``offload_folder`` (``river_config.offload_dir`` or a new temporary folder; for a
    safetensors checkpoint transformers reads offloaded weights from the checkpoint itself and
    writes nothing there).

    Raises:
        RiverError: ``offload_from`` is not below the number of decoder layers.
    """
    k = getattr(river_config, "offload_from", None)
    if k is None or isinstance(kwargs.get("device_map"), dict):
        return kwargs
    if config is None:
        config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs.get("trust_remote_code"))
    n = config.get_text_config(decoder=True).num_hidden_layers
    if k >= n:
        raise RiverError(f"offload_from={k} but the model has {n} decoder layers; choose 0..{n - 1} or None")
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    out = dict(kwargs)
    out["device_map"] = offload_device_map(meta_model, k, _execution_device(kwargs.get("device_map")))
    out["offload_folder"] = river_config.offload_dir or tempfile.mkdtemp(prefix="river-offload-")
    return out


def offload_backbone(layers, offload_from: int, offload_dir: str | None = None) -> int:
    """Offload the backbones of the :class:`RiverLayer` s ``layers[offload_from:]`` of a model
    already in memory; layers already offloaded (loaded with :func:`loading_kwargs`) are skipped.

    GPU backbones go to CPU memory (``accelerate.cpu_offload``); CPU backbones go to disk
    (``accelerate.disk_offload``: memory-mapped ``.dat`` files in a new temporary folder, inside
    ``offload_dir`` when given). Their parameters become ``meta`` tensors, so
    the memory they held is freed once nothing else refers to it.

    Returns:
        The number of backbone layers offloaded by this call.

    Raises:
        RiverError: ``offload_from`` is not below the number of layers.
    """
    from accelerate import cpu_offload, disk_offload

    if offload_from >= len(layers):
        raise RiverError(f"offload_from={offload_from} but the model has {len(layers)} decoder layers")
    root = None
    done = 0
    for i in range(offload_from, len(layers)):
        backbone = layers[i].backbone
        if is_offloaded(backbone):
            continue
        device = next(backbone.parameters()).device
        if device.type == "cpu":
            if root is None:  # always a fresh folder: disk_offload reuses any index.json it finds
                if offload_dir is not None:
                    os.makedirs(offload_dir, exist_ok=True)
                root = tempfile.mkdtemp(prefix="river-offload-", dir=offload_dir)
            disk_offload(backbone, os.path.join(root, f"layer_{i}"), execution_device=device)
        else:
            cpu_offload(backbone, execution_device=device)
        done += 1
    return done
