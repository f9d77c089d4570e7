"""What ``river-hf generate`` and ``river-hf convert`` both need: the checks on a model before any
weight is read (:func:`check_model`) and the "unmodified" reference their measurements compare
River with (:func:`unmodified`). Heavy imports stay inside the functions (``--help`` is fast).
"""

from __future__ import annotations

import os

from ..errors import RiverError

__all__ = ["check_model", "unmodified", "BACKBONE_REFERENCE", "TOKENIZER_FILES"]


#: What "unmodified" is in ``--compare`` (the timing table says it).
BACKBONE_REFERENCE = ("River model in backbone mode (river_mode('backbone'): the same weights through River's "
                      "wrappers and router)")

#: Files of which a model folder's tokenizer needs at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model(name: str, *, progress: bool = True):
    """What ``generate`` and ``convert`` need from ``name``, checked before any weight is read, on
    the path ``RiverForCausalLM.from_pretrained`` takes: :func:`river_hf.models.resolve`, the base
    weights present (:func:`~river_hf.river.serialization.check_base_weights`), the config read as
    ``from_pretrained`` reads it (one error for a missing, non-JSON or unknown ``model_type``
    config.json), River settings stored in it valid, a model type River supports, and a tokenizer.

    Returns:
        ``(path, config, tokenizer)``: what ``from_pretrained`` loads, its config (pass it as
        ``config=`` so it is not read again) and the tokenizer.

    Raises:
        RiverError: any of the above, as one message that says what to do.
    """
    from transformers import AutoTokenizer

    from ..models import resolve
    from .arch import SUPPORTED_MODEL_TYPES
    from .loading import read_config
    from .serialization import check_base_weights, saved_river_config

    path = resolve(name, progress=progress)
    check_base_weights(path)
    config = read_config(path, {}, name)
    saved_river_config(config, where=name)
    model_type = getattr(config.get_text_config(decoder=True), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise RiverError(
            f"{name!r} is a {model_type!r} model, which River does not support (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); pass a model of one of those types, or in Python try "
            "river_hf.enable_river(model, allow_untested=True)"
        )
    fix = ("save the tokenizer of its model into it (tokenizer.save_pretrained(FOLDER)), or pass a model key "
           "or Hub id")
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise RiverError(f"{name!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise RiverError(f"cannot load the tokenizer of {name!r} ({first}); {fix}") from None
    return path, config, tokenizer


def unmodified(model):
    """The model ``--compare`` times as "unmodified" and how its table names it: the plain
    transformers model on River's backbone tensors (:func:`river_hf.plain_model`, no copy), or,
    where the backbone is offloaded (nothing in memory to share), River in backbone mode."""
    from ..bench import REFERENCE_KINDS
    from .plain import plain_model

    try:
        plain = plain_model(model)
    except RiverError:
        return model, BACKBONE_REFERENCE
    return plain, REFERENCE_KINDS["plain"].format(cls=type(plain).__name__)

