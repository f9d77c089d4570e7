"""What ``river-hf eval``, ``bench``, ``pareto`` and ``calibrate`` share beyond their arguments:
loading a River model with its tokenizer and default τ, the software versions a result records,
and one-line progress logs.

The names these commands used to import from here live elsewhere now and are re-exported:
argument helpers in :mod:`river_hf.cli_args`, file writing in :mod:`river_hf.files`, task data in
:mod:`river_hf.eval.data`.
"""

from __future__ import annotations

import os
import sys

from ..cli_args import (KERNEL_CHOICES, add_river_arguments, check_output_path, check_writable_place,  # noqa: F401
                        parse_taus, positive_int, river_overrides)
from ..files import atomic_write, save_figure, write_json  # noqa: F401
from .data import humaneval_problems  # noqa: F401

__all__ = ["positive_int", "parse_taus", "check_output_path", "check_writable_place", "versions", "load_river_model",
           "write_json", "humaneval_problems"]


def versions() -> dict:
    """Versions of the software a result depends on (python, torch, transformers, river_hf, ...)."""
    import platform

    import torch
    import transformers

    from .._version import __version__

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "river_hf": __version__}
    for name in ("optimum.quanto", "datasets", "evaluate"):
        try:
            module = __import__(name, fromlist=["__version__"])
            out[name] = getattr(module, "__version__", None)
        except ImportError:
            out[name] = None
    out["threads"] = torch.get_num_threads()
    out["cpu_count"] = os.cpu_count()
    return out


def load_river_model(name_or_key: str, tau: float | None = None, progress: bool = True, **river_settings):
    """Load ``(model, tokenizer, default_tau)`` with River enabled; weights in float32 on CPU.
    ``river_settings``: overrides (``backend``, ``exit_head``, ``prefill``, ``min_layer``).

    ``default_tau`` is the τ of ``configs/<key>.json`` (the per-model default). Raises RiverError
    for an unknown model.
    """
    import torch
    from transformers import AutoTokenizer

    from ..models import resolve
    from ..river import RiverForCausalLM

    path = resolve(name_or_key, progress=progress)
    kwargs = {} if torch.cuda.is_available() else {"dtype": torch.float32}
    model = RiverForCausalLM.from_pretrained(name_or_key, tau=tau, progress=progress, **river_settings, **kwargs)
    default_tau = model.river_config.tau if tau is None else None
    if default_tau is None:
        from ..river import default_config

        default_tau = default_config(name_or_key, getattr(model.config, "model_type", None)).tau
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer, default_tau


def log(msg: str) -> None:
    print(f"[river-hf] {msg}", file=sys.stderr, flush=True)
