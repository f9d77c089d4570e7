"""The checkpoint side of ``RiverForCausalLM.from_pretrained`` / ``from_config``: resolving the
name, reading the config with the caller's Hub arguments, the River settings in force (given,
stored in the folder's config.json ``"river"``, or the per-model default), and the architecture
class that loads the weights. Enabling River on the loaded model is
:func:`~river_hf.river.modeling.enable_river`.
"""

from __future__ import annotations

import dataclasses
import os

import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from ..errors import RiverError
from ..models import is_key, resolve
from .arch import is_river_class
from .config import RiverConfig, default_config
from .offload import loading_kwargs
from .serialization import check_base_weights, saved_river_config

__all__ = ["load_checkpoint", "read_config", "architecture", "as_class"]

#: ``from_pretrained`` arguments that also apply to reading the config (``AutoConfig``).
HUB_KWARGS = ("revision", "token", "trust_remote_code", "cache_dir", "local_files_only", "force_download",
              "proxies", "subfolder", "code_revision")


def load_checkpoint(cls: type, name: str, model_args: tuple, kwargs: dict, river_config: RiverConfig | None,
                    given: dict, progress: bool):
    """Load ``name`` (a model key, folder or Hub id) as ``from_pretrained`` does, in eval mode, not yet
    River; returns ``(model, river_config)``: the settings to enable River with (``river_config``,
    else the folder's, else the per-model default, with the ``given`` fields overriding them)."""
    keep_hub_id = "revision" in kwargs and not is_key(name) and not os.path.isdir(name)
    path = name if keep_hub_id else resolve(name, progress=progress)  # resolve ignores revisions
    check_base_weights(path)
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, (str, os.PathLike)):
        config = read_config(config or path, kwargs, name)
    if river_config is None:
        river_config = saved_river_config(config, where=name)
    if river_config is None:
        river_config = default_config(name, config.get_text_config(decoder=True).model_type)
    river_config = dataclasses.replace(river_config, **given)
    kwargs = loading_kwargs(path, river_config, kwargs, config)
    try:
        model = architecture(cls, config).from_pretrained(path, *model_args, config=config, **kwargs)
    except RuntimeError as e:
        if "mismatch" not in str(e):  # a weight shape against config.json is the user's to fix; others are not
            raise
        raise RiverError(f"the weights in {name!r} do not match the shapes its config.json gives (transformers' load "
                         "report above lists each mismatched tensor); pass the folder's own config.json, or the model "
                         "folder the weights were saved with") from None
    model.eval()
    return model, river_config


def _validation_errors() -> tuple:
    """huggingface_hub's strict-dataclass error, which transformers' configs raise for a wrongly
    typed field (``"hidden_size": "abc"``); not a ValueError or TypeError subclass."""
    try:
        from huggingface_hub.errors import StrictDataclassFieldValidationError
    except ImportError:  # an older huggingface_hub: the configs do not validate fields
        return ()
    return (StrictDataclassFieldValidationError,)


_CONFIG_VALIDATION_ERRORS = _validation_errors()


def read_config(source, kwargs: dict, name: str):
    """``AutoConfig.from_pretrained(source)`` with the caller's hub arguments; any failure is one
    RiverError."""
    hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    try:
        return AutoConfig.from_pretrained(source, **hub)
    except (OSError, ValueError, KeyError, TypeError, *_CONFIG_VALIDATION_ERRORS) as e:  # a wrongly typed field too
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if len(first) > 300:
            first = first[:300] + " ..."
        raise RiverError(
            f"cannot read the model config of {name!r} ({first}); pass a transformers model folder with a valid "
            "config.json (it needs a model_type, and fields of the right types), a model key, or a Hub id"
        ) from None


def architecture(cls: type, config) -> type:
    """The class that loads ``config``'s weights: the River class's own architecture, the
    architecture named by a River folder's config (so its ``auto_map`` is not followed back into
    River), or ``AutoModelForCausalLM``."""
    if is_river_class(cls):
        return cls.river_base_class
    if getattr(config, "river", None) is not None and getattr(config, "architectures", None):
        arch = getattr(transformers, config.architectures[0], None)
        if isinstance(arch, type):
            return arch
    return AutoModelForCausalLM


def as_class(model: nn.Module, cls: type) -> nn.Module:
    """Give ``model`` the class it was asked for when that is a subclass of its River class (the
    Auto classes hand back such a subclass of a folder's River class)."""
    if isinstance(cls, type) and cls is not type(model) and issubclass(cls, type(model)):
        model.__class__ = cls
    return model
