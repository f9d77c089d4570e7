"""Where River hooks into an architecture: its decoder stack, and its River class.

* :func:`decoder_stack` finds the module that runs the decoder loop and its list of layers;
* :func:`mix_in` builds (once per architecture, cached) the River class of a transformers
  causal-LM class: River's mixin in front (``LlamaForCausalLM`` -> ``RiverLlamaForCausalLM``),
  with ``river_base_class`` naming the architecture's own class (:func:`base_class`);
* every River class is listed among text-generation's supported models, so
  ``pipeline("text-generation", model=river_model)`` does not log that the model "is not
  supported" (the list it checks holds class names, one per model type; a River class adds an
  entry under a key that is no model type, so the Auto classes never map a config to it).
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..errors import RiverError

__all__ = ["SUPPORTED_MODEL_TYPES", "decoder_stack", "mix_in", "base_class", "is_river_class"]

#: model_type values whose decoder layers River has been tested on (tests/test_river_core.py).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma3_text")

_RIVER_CLASSES: dict[tuple[type, type], type] = {}


def decoder_stack(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The module that runs the decoder loop of ``model`` (e.g. ``LlamaModel``), and its
    ``nn.ModuleList`` of decoder layers.

    Raises:
        RiverError: no such list is found (not a decoder-only architecture River knows).
    """
    config = model.config.get_text_config(decoder=True)
    n = getattr(config, "num_hidden_layers", None)
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    if base is not None and isinstance(getattr(base, "layers", None), nn.ModuleList):
        return base, base.layers
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == n:
            return module, layers
    raise RiverError(
        f"cannot find the decoder layers of {type(model).__name__}; River supports model types "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def is_river_class(cls: type) -> bool:
    """True for a class built by :func:`mix_in` (or a subclass of one)."""
    return isinstance(getattr(cls, "river_base_class", None), type)


def mix_in(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin`` in front: ``type("River" + cls.__name__, (mixin, cls), ...)``, built
    once per ``(mixin, cls)`` and reused, so every River model of one architecture has the same
    class. A class that already is a River class is returned as is."""
    if is_river_class(cls):
        return cls
    key = (mixin, cls)
    if key not in _RIVER_CLASSES:
        river_cls = type(f"River{cls.__name__}", (mixin, cls),
                         {"__module__": cls.__module__, "river_base_class": cls})
        _RIVER_CLASSES[key] = river_cls
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(f"river-hf:{river_cls.__name__}", river_cls.__name__)
    return _RIVER_CLASSES[key]


def base_class(cls: type) -> type:
    """The architecture's own ``PreTrainedModel`` class behind a River class (``cls`` itself for
    any other class).

    Raises:
        RiverError: ``cls`` is not a transformers model class.
    """
    base = getattr(cls, "river_base_class", cls)
    if not (isinstance(base, type) and issubclass(base, PreTrainedModel)):
        raise RiverError(f"{getattr(cls, '__name__', cls)} is not a transformers model class")
    return base
