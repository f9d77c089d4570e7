"""Hugging Face-native River checkpoints: what ``save_pretrained`` writes and ``from_pretrained`` reads.

(The ``from_pretrained`` / ``save_pretrained`` methods themselves are those of
:class:`~river_hf.river.modeling.RiverForCausalLM`; this module holds the folder format.)

Folder layout written by ``model.save_pretrained(out)`` on a River model:

* the base model's weights under their **original names** (``model.safetensors``): the folder
  also loads as the plain model (``AutoModelForCausalLM.from_pretrained(out)``);
* ``config.json``: the base model's config plus ``"river"`` (the :class:`RiverConfig`: τ, exit
  rules, quantization backend and bits, offload policy) and ``"auto_map"``
  ``{"AutoModelForCausalLM": "modeling_river.River<Arch>ForCausalLM"}``;
* ``modeling_river.py``: three lines importing that class from the installed river-hf, so
  ``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`` and
  ``pipeline("text-generation", model=out, trust_remote_code=True)`` return a River model;
* ``README.md``: a model card (see :func:`model_card`).

Exit layers are **rebuilt at load**, not stored: quantizing is deterministic (same weights, same
exit layers, same tokens), takes seconds (River-LLM builds them without training), keeps the
folder a plain checkpoint of the base model (no second, quantized copy of every layer on disk and
no dependency on optimum-quanto's serialization format), and lets a user change the backend.

Every save is written to a temporary folder next to the target first. A new target is that
folder renamed into place (``os.replace``), so an interrupted save never leaves a folder that
loads as if whole. Into an existing folder the new files are moved one by one (each an atomic
rename, weights first and ``config.json`` last) and, as transformers' own ``save_pretrained``
does, base-weight files of an earlier save that this save does not rewrite are removed; nothing
else in the folder (subfolders such as ``.git``, other files) is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

from .._lazy import lazy_exports
from ..errors import RiverError
from ..models import REGISTRY
from .arch import base_class, decoder_stack
from .config import RiverConfig
from .offload import materialized

__all__ = [
    "base_class",
    "saved_river_config",
    "check_base_weights",
    "save_river",
    "model_card",
    "MODELING_FILE",
    "INSTALL_HINT",
]

# Folders saved by earlier versions of river-hf import ``river_class`` from this module in their
# modeling_river.py; it lives in .modeling (which imports this module), so it is bound on first use.
__getattr__, __dir__ = lazy_exports(__name__, {"river_class": "..modeling"})

MODELING_FILE = "modeling_river.py"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")

#: How to get river-hf, which is not published on PyPI (said in modeling_river.py and the card).
INSTALL_HINT = (
    "river-hf is not published on PyPI: install it from its repository, "
    "`pip install -e <path to the river-hf repository>` or `pip install git+<river-hf repository URL>`"
)

_MODELING_TEMPLATE = '''"""River-LLM early exit for {arch} (written by river-hf).

Needs river-hf installed in the same environment; {install}.
The weights in this folder are the base model's own; River's quantized exit layers are rebuilt
from them at load, with the settings in config.json "river".
"""

from river_hf.river.modeling import river_class

{name} = river_class("{arch}")
'''


def _config_dict(path_or_config) -> dict | None:
    if hasattr(path_or_config, "to_dict"):
        return {"river": getattr(path_or_config, "river", None)}
    cfg = Path(path_or_config) / "config.json"
    if not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise RiverError(f"{cfg} is not valid JSON ({e}); the folder is damaged: convert the model again") from None


def saved_river_config(path_or_config, where: str | None = None):
    """The :class:`RiverConfig` stored under ``"river"`` in a folder's config.json (or in a loaded
    ``PretrainedConfig``); None when there is none (a plain model). ``where`` names the source in
    the error message (default: the folder, or "the model config").

    Raises:
        RiverError: the stored settings are invalid (unknown keys, τ not a number, ...).
    """
    d = _config_dict(path_or_config)
    settings = None if d is None else d.get("river")
    if settings is None:
        return None
    try:
        return RiverConfig.from_dict(settings)
    except RiverError as e:
        if where is None:
            where = path_or_config if isinstance(path_or_config, (str, os.PathLike)) else "the model config"
        raise RiverError(
            f"invalid River settings in {where} (config.json \"river\"): {e}; fix or delete that entry, "
            "or convert the model again with `river-hf convert`"
        ) from None


def check_base_weights(path) -> None:
    """Raise :class:`RiverError` when a local folder lacks the base model's weights (or a shard
    named by its index). Hub ids are left to ``from_pretrained``."""
    folder = Path(path)
    if not folder.is_dir():
        return
    present = [f for f in WEIGHT_FILES if (folder / f).is_file()]
    if not present:
        raise RiverError(
            f"{folder} has no base model weights (none of {', '.join(WEIGHT_FILES)}); the folder is "
            "incomplete: copy the weights back or re-create it with `river-hf convert MODEL OUT_DIR`"
        )
    for index in (f for f in present if f.endswith(".index.json")):
        try:
            shards = set(json.loads((folder / index).read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError) as e:
            raise RiverError(f"{folder / index} is damaged ({e}); re-create the folder with `river-hf convert`") from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise RiverError(
                f"{folder} lacks weight shard(s) {', '.join(missing)} named in {index}; copy them back or "
                "re-create the folder with `river-hf convert`"
            )


def _registry_entry(model):
    """The offline registry entry (:data:`river_hf.models.REGISTRY`) the model was loaded from
    (its key, or a folder named after its key, as :func:`river_hf.models.resolve` makes), or None."""
    name = str(getattr(model.config, "_name_or_path", "") or "")
    return REGISTRY.get(Path(name.rstrip("/")).name)


def _base_model_id(model) -> str | None:
    """The Hub id of the base model, when it can be told (model key or Hub id)."""
    entry = _registry_entry(model)
    if entry is not None:
        return entry.hub_id
    name = str(getattr(model.config, "_name_or_path", "") or "")
    if name.count("/") == 1 and not os.path.exists(name):
        return name
    return None


def model_card(model, *, base_model: str | None = None, measurement: dict | None = None) -> str:
    """README.md text for a River folder: YAML front matter (``base_model``, ``library_name``,
    ``pipeline_tag``, ``tags``), how to install river-hf, where the weights come from (for the
    offline registry: GGUF dequantized to fp32), the River settings, a usage snippet, and the figures of
    ``measurement`` (as produced by ``river-hf convert --measure``) or a line saying that none
    were measured."""
    rc = model.river_config
    base_model = base_model or _base_model_id(model)
    quant = rc.to_dict()["quantization"]
    lines = ["---"]
    lines.append(f"base_model: {base_model}" if base_model else "# base_model: unknown (converted from a local folder)")
    lines += [
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        "- river-llm",
        "- early-exit",
        "- river-hf",
        "---",
        "",
        f"# River-LLM early exit for {base_model or type(model).__name__}",
        "",
        "The base model's own weights, plus River-LLM settings: decoding leaves the backbone layers "
        "once the state transition similarity (cosine of a layer's input and output hidden state) "
        "exceeds τ, and runs the remaining layers as 4-bit exit copies that share the KV cache.",
        "Exit layers are rebuilt from these weights at load (seconds).",
        "",
        f"Loading it with River needs river-hf installed in the same environment: {INSTALL_HINT}.",
        "",
        *_weights_note(model),
        "| setting | value |",
        "|---|---|",
        f"| τ (tau) | {rc.tau} |",
        f"| min_layer | {rc.min_layer} |",
        f"| exit layers | {quant['name']}, {quant['bits']}-bit weights, {quant['compute_dtype'] or 'model dtype'} activations |",
        f"| exit head | {rc.exit_head + ' (quantized copy of the LM head, used by steps that left the backbone)' if rc.exit_head else 'none (the original LM head serves every step)'} |",
        f"| prefill | {rc.prefill} |",
        f"| backbone offload | {'layers ' + str(rc.offload_from) + '.. off the compute device' if rc.offload_from is not None else 'off'} |",
        "",
        "## Usage",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        'pipe = pipeline("text-generation", model="PATH_OR_REPO", trust_remote_code=True)',
        'print(pipe("def fibonacci(n):", max_new_tokens=64, do_sample=False)[0]["generated_text"])',
        "print(pipe.model.river_stats)  # mean exit layer, exit fraction, tokens/s of the last call",
        "```",
        "",
        "The folder also loads as the plain base model without `trust_remote_code`.",
        "",
        "## Measurements",
        "",
    ]
    if not measurement:
        lines.append("Not measured: speed, next-token match and mean exit layer were not measured for this folder "
                     "(`river-hf convert MODEL OUT_DIR --measure` measures them).")
    else:
        m = measurement
        lines += [
            f"Measured at conversion on {m['device']} ({m['date']}), {m['prompts']} prompt(s), "
            f"{m['max_new_tokens']} new tokens each, greedy, command: `{m['command']}`.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| tokens/s, unmodified model | {m['unmodified_tokens_per_s']:.2f} |",
            f"| tokens/s, River | {m['river_tokens_per_s']:.2f} |",
            f"| speed-up | {m['river_tokens_per_s'] / m['unmodified_tokens_per_s']:.2f}x |",
            f"| {m['match_name']} | {100 * m['match']:.1f} % |",
            f"| mean exit layer (of {m['num_layers']}) | {m['mean_exit_layer']:.2f} |",
            f"| decode steps that exited early | {100 * m['exit_fraction']:.1f} % |",
            "",
            m.get("note", ""),
        ]
    return "\n".join(lines).rstrip() + "\n"


def _weights_note(model) -> list[str]:
    """Card lines saying that weights from the offline registry are dequantized GGUF (none for
    other models, whose weights the card does not claim to know)."""
    entry = _registry_entry(model)
    if entry is None:
        return []
    gguf = entry.description.rsplit(", ", 1)[-1]  # "GGUF Q4_K_M"
    return [
        f"The base weights are river-hf's offline copy of {entry.hub_id} (model key `{entry.key}`): a {gguf} "
        "file dequantized to fp32, not the Hub's original weights. The \"unmodified\" model of this folder "
        "therefore already sits on a 4-bit grid, and River's exit layers re-quantize these dequantized weights.",
        "",
    ]


@contextlib.contextmanager
def _plain_view(model):
    """Within the block ``model`` looks like the base model: its class is the architecture's own,
    each RiverLayer is replaced by its backbone, and offloaded backbones hold their weights."""
    _, layers = decoder_stack(model)
    river_layers = list(layers)
    river_head = model.get_output_embeddings()
    river_cls = type(model)
    device_map = model.__dict__.pop("hf_device_map", None)
    try:
        with contextlib.ExitStack() as stack:
            for i, rl in enumerate(river_layers):
                stack.enter_context(materialized(rl.backbone))
                layers[i] = rl.backbone
            if river_head is not None and hasattr(river_head, "exit_head"):
                model.set_output_embeddings(river_head.backbone)
            model.__class__ = base_class(river_cls)
            yield model
    finally:
        model.__class__ = river_cls
        for i, rl in enumerate(river_layers):
            layers[i] = rl
        if river_head is not None and hasattr(river_head, "exit_head"):
            model.set_output_embeddings(river_head)
        if device_map is not None:
            model.hf_device_map = device_map


_MISSING = object()


@contextlib.contextmanager
def _config_attributes(config, **values):
    """Within the block ``config`` has the given attributes; afterwards each is as before (absent
    again where it was absent), so a save does not leave River's ``auto_map`` on the model."""
    old = {k: config.__dict__.get(k, _MISSING) for k in values}
    for k, v in values.items():
        setattr(config, k, v)
    try:
        yield config
    finally:
        for k, v in old.items():
            if v is _MISSING:
                config.__dict__.pop(k, None)
            else:
                setattr(config, k, v)


def save_river(model, save_directory, *, card: str | None = None, tokenizer=None, **save_kwargs) -> Path:
    """Write ``model`` (a River model) as a River folder; see the module docstring.

    Args:
        model: a model returned by ``enable_river`` / ``RiverForCausalLM.from_pretrained``.
        save_directory: target folder; an existing one keeps every file and subfolder this save
            does not write (a tokenizer saved there earlier, ``.git``), except base-weight files
            of an earlier save, which are replaced.
        card: README.md text; default :func:`model_card` without measurements.
        tokenizer: saved into the same folder (inside the same atomic rename) when given.
        **save_kwargs: passed to the base ``save_pretrained`` (``max_shard_size``, ...).

    Returns:
        The folder. Offloaded backbone layers are read back for the save (the whole model is
        resident while saving).
    """
    out = Path(save_directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        settings = dataclasses.replace(model.river_config, offload_dir=None).to_dict()
        base = base_class(type(model))
        auto_map = {"AutoModelForCausalLM": f"{Path(MODELING_FILE).stem}.River{base.__name__}"}
        with _plain_view(model), _config_attributes(model.config, river=settings, auto_map=auto_map):
            base.save_pretrained(model, tmp, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / MODELING_FILE).write_text(
            _MODELING_TEMPLATE.format(arch=base.__name__, name=f"River{base.__name__}", install=INSTALL_HINT))
        (tmp / "README.md").write_text(card if card is not None else model_card(model))
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _is_base_weight_file(name: str) -> bool:
    """``model*.safetensors`` / ``pytorch_model*.bin`` shards and their index files: what a
    transformers save writes for the base weights (adapter or other files do not match)."""
    return (name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json"))) or (
        name.startswith("pytorch_model") and name.endswith((".bin", ".bin.index.json"))
    )


def _replace_dir(new: Path, out: Path) -> None:
    """Put the files of folder ``new`` at ``out`` (see the module docstring); ``new`` is consumed.

    Raises:
        RiverError: ``out`` exists and is not a folder.
    """
    if not out.exists():
        _share_like_umask(new)
        os.replace(new, out)
        return
    if not out.is_dir():
        raise RiverError(f"{out} exists and is not a folder; choose another output path")
    _share_like_umask(new)
    written = sorted(new.iterdir(), key=lambda f: (f.name == "config.json", not _is_base_weight_file(f.name)))
    names = {f.name for f in written}
    for f in out.iterdir():
        if f.is_file() and _is_base_weight_file(f.name) and f.name not in names:
            f.unlink()
    for f in written:
        os.replace(f, out / f.name)
    new.rmdir()


def _share_like_umask(folder: Path) -> None:
    """Give ``folder`` (made by ``tempfile.mkdtemp``, mode 0700) and its files the modes of an
    ordinary ``mkdir`` / ``open`` under the current umask, so a saved model is as readable as any
    other file the user writes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)
