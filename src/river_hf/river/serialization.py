"""Hugging Face-native River checkpoints: what ``save_pretrained`` writes and ``from_pretrained`` reads.

(The ``from_pretrained`` / ``save_pretrained`` methods themselves are those of
:class:`~river_hf.river.modeling.RiverForCausalLM`; this module holds the folder format.)

Folder layout written by ``model.save_pretrained(out)`` on a River model:

* the base model's weights under their **original names** (``model.safetensors``): the folder
  also loads as the plain model (``AutoModelForCausalLM.from_pretrained(out)``);
* ``config.json``: the base model's config plus ``"river"`` (the :class:`RiverConfig`: τ, exit
  rules, quantization backend and bits, offload policy), ``"auto_map"``
  ``{"AutoModelForCausalLM": "modeling_river.River<Arch>ForCausalLM"}`` and, when known,
  ``"river_source"`` (``{"base_model": Hub id, "model_key": registry key}``: where the base
  weights come from, so converting the folder again keeps the card's base model and GGUF note);
  a GGUF file's own label (``_model_name_or_path``) is not carried over;
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
from ..files import share_like_umask
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
    "river-hf is not published on PyPI: install it from a checkout of its repository, with "
    "`bash scripts/setup.sh` in the checkout (a .venv with torch and river-hf) or "
    "`pip install <path to the river-hf checkout>` into an environment that has torch"
)

#: The Auto classes a River folder's ``auto_map`` sends to its River class. ``AutoModelForDecision``
#: because ``transformers serve`` (5.24, ``ModelManager._load_model``) loads a model through it
#: first (a decision model; any other chat model answers the decision task by its next-token
#: logits, as the ``decision`` pipeline does) and only then by ``config.architectures[0]``, which
#: names the plain class: with ``--trust-remote-code`` the folder is then served as River.
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForDecision")

#: config.json key recording where the base weights come from (see the module docstring).
SOURCE_KEY = "river_source"

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


def _source(model) -> dict:
    """Where the base weights come from: ``{"base_model": Hub id or None, "model_key": registry key
    or None}``. A model loaded from a River folder has it in its config (``river_source``, written
    by :func:`save_river`); otherwise it is told from ``_name_or_path``: a model key, a folder named
    after one (as :func:`river_hf.models.resolve` makes), or a Hub id."""
    saved = getattr(model.config, SOURCE_KEY, None)
    if isinstance(saved, dict):
        key, base = saved.get("model_key"), saved.get("base_model")
        return {"base_model": base if isinstance(base, str) and base else None,
                "model_key": key if key in REGISTRY else None}
    name = str(getattr(model.config, "name_or_path", "") or "")
    entry = REGISTRY.get(Path(name.rstrip("/")).name)
    if entry is not None:
        return {"base_model": entry.hub_id, "model_key": entry.key}
    hub_id = name if name.count("/") == 1 and not os.path.exists(name) else None
    return {"base_model": hub_id, "model_key": None}


def _registry_entry(model):
    """The offline registry entry (:data:`river_hf.models.REGISTRY`) the base weights come from, or None."""
    key = _source(model)["model_key"]
    return REGISTRY[key] if key else None


def _base_model_id(model) -> str | None:
    """The Hub id of the base model, when it can be told (model key, Hub id, or a River folder's record)."""
    return _source(model)["base_model"]


def _bits_phrase(quant: dict) -> str:
    """How wide a backend's weights are, in the card's words: "4-bit", "8-bit", or "full-precision"
    for the unquantized copy."""
    bits = quant.get("bits")
    return "full-precision" if not isinstance(bits, int) or bits >= 16 else f"{bits}-bit"


def _lossless_section(rc) -> list[str]:
    """Card lines on lossless mode, for a folder whose settings make it the default."""
    if not rc.lossless:
        return []
    lookup = (f"; rounds whose last tokens occurred earlier draft up to {rc.prompt_lookup_tokens} tokens by prompt "
              "lookup instead" if rc.prompt_lookup_tokens else "")
    return [
        "## Lossless mode",
        "",
        "This folder's settings have `lossless: true`, so `generate` and `pipeline` run River's lossless mode "
        "by default: the exit path (the quantized exit layers and exit head) drafts tokens, and the backbone "
        "verifies them in the same KV cache, through transformers' own assisted decoding "
        f"(first round {rc.draft_tokens} draft(s), at most {rc.max_draft_tokens}, schedule "
        f"`{rc.draft_schedule}`{lookup}). The output is the base model's own: greedy decoding gives the "
        "backbone's tokens, sampling the same distribution, up to the fp32 summation order of the "
        "multi-token verify passes (a pass over several tokens may add in another order than one-token "
        "steps, which can flip a near-tie). It is faster only as far as the exit path is cheaper than the "
        "backbone. `with model.river_mode(\"route\"):` runs lossy River instead, "
        "`river_mode(\"backbone\")` the unmodified model.",
        "",
    ]


def model_card(model, *, base_model: str | None = None, measurement: dict | None = None) -> str:
    """README.md text for a River folder: YAML front matter (``base_model``, ``library_name``,
    ``pipeline_tag``, ``tags``), how to install river-hf, where the weights come from (for the
    offline registry: GGUF dequantized to fp32; kept through re-conversion by ``river_source``), the
    River settings with the real width of exit layers and exit head, a lossless-mode section when
    the settings make it the default, a usage snippet, and the figures of ``measurement`` (as
    produced by ``river-hf convert --measure``) or a line saying that none were measured."""
    rc = model.river_config
    base_model = base_model or _base_model_id(model)
    settings = rc.to_dict()
    quant = settings["quantization"]
    head = settings.get("exit_head_quantization")
    lossless_row = "on by default (see below)" if rc.lossless else 'off (opt in: `model.river_mode("lossless")`)'
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
        f"# River-LLM early exit for {base_model or base_class(type(model)).__name__}",
        "",
        "The base model's own weights, plus River-LLM settings: decoding leaves the backbone layers "
        "once the state transition similarity (cosine of a layer's input and output hidden state) "
        f"exceeds τ, and runs the remaining layers as {_bits_phrase(quant)} exit copies that share the KV cache.",
        "Exit layers are rebuilt from these weights at load (seconds).",
        "",
        f"Loading it with River needs river-hf installed in the same environment: {INSTALL_HINT}.",
        "",
        *_weights_note(model),
        "| setting | value |",
        "|---|---|",
        f"| τ (tau) | {rc.tau} |",
        f"| min_layer | {rc.min_layer} |",
        f"| exit layers | {quant['name']}, {_bits_phrase(quant)} weights, {quant['compute_dtype'] or 'model dtype'} activations |",
        f"| exit head | {_exit_head_row(rc.exit_head, head)} |",
        f"| prefill | {rc.prefill} |",
        f"| backbone offload | {'layers ' + str(rc.offload_from) + '.. off the compute device' if rc.offload_from is not None else 'off'} |",
        f"| lossless mode | {lossless_row} |",
        "",
        *_lossless_section(rc),
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
        "## Serving",
        "",
        "An OpenAI-compatible server (`/v1/chat/completions`, streaming): `river-hf serve PATH_OR_REPO` "
        "(each answer carries its River statistics under `\"river\"`), or transformers' own "
        "`transformers serve PATH_OR_REPO --trust-remote-code` (River too; without `--trust-remote-code` "
        "it serves the plain base model).",
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


def _exit_head_row(name: str | None, quant: dict | None) -> str:
    if not name:
        return "none (the original LM head serves every step)"
    width = _bits_phrase(quant or {})
    what = "unquantized copy" if width == "full-precision" else f"{width} quantized copy"
    return f"{name} ({what} of the LM head, used by steps that left the backbone)"


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
def _base_class_view(model):
    """Within the block ``model`` has the architecture's own class (what ``save_pretrained`` names
    in ``architectures``) and its offloaded backbones hold their weights. Its state dict is the
    architecture's already (the River wrappers' state-dict hooks, :mod:`.layer`)."""
    _, layers = decoder_stack(model)
    river_cls = type(model)
    device_map = model.__dict__.pop("hf_device_map", None)
    try:
        with contextlib.ExitStack() as stack:
            for rl in list(layers):
                stack.enter_context(materialized(rl.backbone))
            model.__class__ = base_class(river_cls)
            yield model
    finally:
        model.__class__ = river_cls
        if device_map is not None:
            model.hf_device_map = device_map


_MISSING = object()


@contextlib.contextmanager
def _config_attributes(config, **values):
    """Within the block ``config`` has the given attributes (a value of ``_MISSING``: the attribute
    is absent); afterwards each is as before (absent again where it was absent), so a save does not
    leave River's ``auto_map`` on the model."""
    old = {k: config.__dict__.get(k, _MISSING) for k in values}
    for k, v in values.items():
        if v is _MISSING:
            config.__dict__.pop(k, None)
        else:
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

    Raises:
        RiverError: the disk (or quota) is full; the temporary folder is removed first, so nothing
            of this save is left behind and an existing folder keeps its files.
    """
    out = Path(save_directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        settings = dataclasses.replace(model.river_config, offload_dir=None).to_dict()
        base = base_class(type(model))
        auto_map = {auto_class: f"{Path(MODELING_FILE).stem}.River{base.__name__}" for auto_class in AUTO_CLASSES}
        source = _source(model)
        extra = {SOURCE_KEY: source if any(source.values()) else _MISSING,
                 "_model_name_or_path": _MISSING}  # a GGUF's label ("... AWQ"), not where these weights are
        with _base_class_view(model), _config_attributes(model.config, river=settings, auto_map=auto_map, **extra):
            base.save_pretrained(model, tmp, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / MODELING_FILE).write_text(
            _MODELING_TEMPLATE.format(arch=base.__name__, name=f"River{base.__name__}", install=INSTALL_HINT))
        (tmp / "README.md").write_text(card if card is not None else model_card(model))
        _replace_dir(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(e):
            try:
                free = f"{shutil.disk_usage(out.parent).free / 1e9:.2f} GB free there now"
            except OSError:
                free = "free space unknown"
            raise RiverError(
                f"cannot save the River folder {str(out)!r}: no space left on the disk that holds it ({free}; "
                "the folder needs about the base model's weight size); free some space or save to another disk. "
                "Nothing of this save was left behind"
            ) from None
        raise
    return out


def _disk_full(e: BaseException) -> bool:
    """Whether ``e`` says the disk or the user's quota is full: an ``OSError`` (ENOSPC, EDQUOT) or
    safetensors' ``SafetensorError``, which wraps the same I/O error in its message."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return True
    if type(e).__name__ == "SafetensorError":
        text = str(e)
        return any(m in text for m in ("No space left", "StorageFull", "Disk quota", "QuotaExceeded", "code: 28"))
    return False


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
        share_like_umask(new)
        os.replace(new, out)
        return
    if not out.is_dir():
        raise RiverError(f"{out} exists and is not a folder; choose another output path")
    share_like_umask(new)
    written = sorted(new.iterdir(), key=lambda f: (f.name == "config.json", not _is_base_weight_file(f.name)))
    names = {f.name for f in written}
    for f in out.iterdir():
        if f.is_file() and _is_base_weight_file(f.name) and f.name not in names:
            f.unlink()
    for f in written:
        os.replace(f, out / f.name)
    new.rmdir()
