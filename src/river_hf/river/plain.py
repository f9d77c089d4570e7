"""The plain transformers model inside a River model, as a model of its own.

:func:`plain_model` gives the architecture's own ``*ForCausalLM`` (its class, its decoder layers,
its LM head, its ``forward`` and ``generate``; no River layer, hook or router) built over the very
weight tensors River's backbone holds: no second copy of the weights, so a 1.5B fp32 model and its
plain twin fit where one does. Benchmarks use it as the "unmodified" reference (the model a user
has without river-hf), not the River model in backbone mode, so the wrapper's own cost is inside
what River is compared with.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from ..errors import RiverError
from .modeling import RiverForCausalLM
from .serialization import _base_class_view

__all__ = ["plain_model"]


def plain_model(model):
    """The unmodified transformers model over ``model``'s backbone weights (shared, not copied).

    Args:
        model: a River model (``RiverForCausalLM`` or a model given to ``enable_river``).

    Returns:
        A new ``AutoModelForCausalLM`` of the architecture's own class, in eval mode, whose
        parameters are the same tensor objects as River's backbone layers, embeddings and original
        LM head (changing one changes the other), with its own copy of the config and generation
        config. Its tokens are those of ``model`` in ``river_mode("backbone")`` and of the model
        before ``enable_river``.

    Raises:
        RiverError: ``model`` is not a River model, or some backbone layers are offloaded
            (``offload_from``): their weights are not in memory to share.
    """
    if not isinstance(model, RiverForCausalLM):
        raise RiverError(f"plain_model needs a River model, got a {type(model).__name__}")
    if getattr(model.river_config, "offload_from", None) is not None or model.__dict__.get("hf_device_map"):
        raise RiverError("plain_model cannot share offloaded backbone weights; load the model without offload_from "
                         "(or load the plain model with AutoModelForCausalLM.from_pretrained)")
    with _base_class_view(model):  # state_dict and named_modules speak the plain names already
        state = model.state_dict(keep_vars=True)
        source = dict(model.named_modules())
        config = copy.deepcopy(model.config)
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
        plain.load_state_dict(state, assign=True, strict=True)
        for name, module in plain.named_modules():  # non-persistent buffers and tensor attributes (rotary inv_freq)
            twin = source[name]
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.is_meta:
                    module._buffers[key] = twin._buffers[key]
            for key, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.is_meta:
                    module.__dict__[key] = twin.__dict__[key]
    left = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if left:
        raise RiverError(f"plain_model: {len(left)} tensors could not be shared (first: {left[0]}); "
                         "load the plain model with AutoModelForCausalLM.from_pretrained instead")
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()

