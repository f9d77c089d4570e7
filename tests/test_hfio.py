"""HF-native River folders: save_pretrained → fresh process → Auto classes / pipeline, and bad input.

The real-model test saves River on SmolLM2-135M and loads the folder in a separate Python process
through ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` and through
``pipeline(..., trust_remote_code=True)``; both must give the tokens the saved model gave.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, pipeline

from river_hf import RiverError, RiverForCausalLM

SRC = str(Path(__file__).resolve().parent.parent / "src")
GEN = dict(max_new_tokens=12, do_sample=False)


def _tiny_folder(tmp_path: Path) -> Path:
    """A tiny random Llama checkpoint saved as a plain transformers folder."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.pad_token_id = 0
    out = tmp_path / "tiny"
    model.save_pretrained(out)
    return out


@pytest.fixture
def tiny_river_folder(tmp_path):
    plain = _tiny_folder(tmp_path)
    model = RiverForCausalLM.from_pretrained(str(plain), tau=0.5, backend="copy", progress=False)
    out = tmp_path / "river"
    model.save_pretrained(out)
    return out


def test_folder_layout_and_plain_load(tiny_river_folder):
    cfg = json.loads((tiny_river_folder / "config.json").read_text())
    # AutoModelForDecision: the class `transformers serve` loads first (docs/serve.md)
    assert cfg["auto_map"] == {"AutoModelForCausalLM": "modeling_river.RiverLlamaForCausalLM",
                               "AutoModelForDecision": "modeling_river.RiverLlamaForCausalLM"}
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["river"]["tau"] == 0.5 and cfg["river"]["backend"] == "copy"
    assert cfg["river"]["quantization"]["name"] == "copy"
    assert (tiny_river_folder / "modeling_river.py").is_file()
    card = (tiny_river_folder / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card and "- river-llm" in card
    assert "- early-exit" in card and "pipeline_tag: text-generation" in card and "Not measured" in card
    # Weights are stored under the base model's own names: the folder loads as the plain model.
    plain = AutoModelForCausalLM.from_pretrained(tiny_river_folder)
    assert type(plain).__name__ == "LlamaForCausalLM"
    assert not any("backbone" in k or "exit_layer" in k for k in plain.state_dict())
    assert not list(tiny_river_folder.parent.glob(".river.tmp-*")), "temporary save folder left behind"


def test_round_trip_in_process_keeps_settings(tiny_river_folder):
    model = RiverForCausalLM.from_pretrained(str(tiny_river_folder), progress=False)
    assert model.river_config.tau == 0.5 and model.river_config.backend == "copy"
    auto = AutoModelForCausalLM.from_pretrained(tiny_river_folder, trust_remote_code=True, progress=False)
    assert auto.river_config == model.river_config
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.generate(ids, **GEN), auto.generate(ids, **GEN))


def test_missing_base_weights_is_one_clear_error(tiny_river_folder):
    (tiny_river_folder / "model.safetensors").unlink()
    with pytest.raises(RiverError, match="no base model weights"):
        RiverForCausalLM.from_pretrained(str(tiny_river_folder), progress=False)
    with pytest.raises(RiverError, match="no base model weights"):
        AutoModelForCausalLM.from_pretrained(tiny_river_folder, trust_remote_code=True)


@pytest.mark.parametrize("bad", [{"tau": "fast"}, {"min_layer": 0}, {"speed": 3}, {"backend": "int3"}])
def test_invalid_river_settings_are_one_clear_error(tiny_river_folder, bad, smollm2_path):
    path = tiny_river_folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["river"].update(bad)
    path.write_text(json.dumps(cfg))
    with pytest.raises(RiverError, match="invalid River settings"):
        RiverForCausalLM.from_pretrained(str(tiny_river_folder), progress=False)
    with pytest.raises(RiverError, match="invalid River settings"):
        AutoModelForCausalLM.from_pretrained(tiny_river_folder, trust_remote_code=True)
    # pipeline() tries config.architectures' plain class after a ValueError/OSError/...: a damaged
    # River folder must not silently become the plain LlamaForCausalLM there (issue 40)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    with pytest.raises(RiverError, match="invalid River settings"):
        pipeline("text-generation", model=str(tiny_river_folder), tokenizer=tok, trust_remote_code=True)


def test_cli_convert_bad_input_exits_2_with_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    res = subprocess.run([sys.executable, "-m", "river_hf.cli", "convert", str(empty), str(tmp_path / "out")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC})
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "no base model weights" in res.stderr
    assert not (tmp_path / "out").exists()


def test_cli_convert_tau_not_a_number(tmp_path):
    from river_hf.cli import main

    assert main(["convert", str(_tiny_folder(tmp_path)), str(tmp_path / "out"), "--tau", "abc"]) == 2
    assert not (tmp_path / "out").exists()


def test_cli_convert_measure_writes_measured_card(tmp_path, smollm2_path):
    from river_hf.cli import main

    out = tmp_path / "smol-river"
    assert main(["convert", smollm2_path, str(out), "--tau", "0.9", "--measure", "--measure-tokens", "3"]) == 0
    card = (out / "README.md").read_text()
    assert "Not measured" not in card and "tokens/s, River" in card and "next-token match" in card
    cfg = json.loads((out / "config.json").read_text())
    assert (out / "tokenizer.json").is_file() and cfg["river"]["tau"] == 0.9
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "GGUF Q4_1 file dequantized" in card
    assert "_model_name_or_path" not in cfg  # the GGUF's own label ("... Instruct") is not carried over


CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    folder, prompt = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt")
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, progress=False)
    auto = model.generate(**ids, max_new_tokens=12, do_sample=False)[0].tolist()
    pipe = pipeline("text-generation", model=folder, trust_remote_code=True)
    out = pipe(prompt, max_new_tokens=12, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    print("RESULT " + json.dumps({"auto": auto, "pipeline": list(map(int, out)), "class": type(model).__name__,
                                  "pipe_class": type(pipe.model).__name__, "tau": model.river_config.tau,
                                  "exit_fraction": model.river_stats["exit_fraction"]}))
    """
)


def test_smollm2_save_then_fresh_process_auto_and_pipeline(tmp_path, smollm2_path, smollm2):
    _, tok = smollm2
    prompt = "def fibonacci(n):"
    model = RiverForCausalLM.from_pretrained(smollm2_path, tau=0.9, progress=False, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt")
    want = model.generate(**ids, **GEN)[0].tolist()
    out = tmp_path / "smollm2-river"
    model.save_pretrained(out, tokenizer=tok)

    env = {**os.environ, "PYTHONPATH": SRC, "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    res = subprocess.run([sys.executable, "-c", CHILD, str(out), prompt], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads([line for line in res.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert got["class"] == got["pipe_class"] == "RiverLlamaForCausalLM"
    assert got["tau"] == 0.9
    assert got["auto"] == want
    assert got["pipeline"] == want


def _replace_dir_with_umask_022(new, out):
    from river_hf.river.serialization import _replace_dir

    umask = os.umask(0o022)
    try:
        _replace_dir(new, out)
    finally:
        os.umask(umask)


def test_save_into_existing_folder_keeps_what_is_not_ours(tmp_path):
    """Saving over a folder replaces River's files and stale base-weight shards only: .git,
    subfolders, adapters and notes stay; new files get ordinary umask modes (not mkdtemp's 0700)."""
    out = tmp_path / "model"
    (out / ".git").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / "subdir").mkdir()
    (out / "subdir" / "notes.txt").write_text("keep me")
    (out / "adapter_model.safetensors").write_text("adapter")
    (out / "model-00001-of-00002.safetensors").write_text("old shard")
    (out / "config.json").write_text("{}")
    new = Path(tempfile.mkdtemp(dir=tmp_path))
    (new / "model.safetensors").write_text("new weights")
    (new / "config.json").write_text('{"river": {}}')
    _replace_dir_with_umask_022(new, out)
    assert (out / ".git" / "HEAD").read_text().startswith("ref:")
    assert (out / "subdir" / "notes.txt").read_text() == "keep me"
    assert (out / "adapter_model.safetensors").exists()
    assert not (out / "model-00001-of-00002.safetensors").exists()
    assert (out / "model.safetensors").read_text() == "new weights"
    assert json.loads((out / "config.json").read_text()) == {"river": {}}
    assert not new.exists()
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644

    fresh = tmp_path / "fresh"
    new = Path(tempfile.mkdtemp(dir=tmp_path))
    (new / "config.json").write_text("{}")
    _replace_dir_with_umask_022(new, fresh)
    assert fresh.stat().st_mode & 0o777 == 0o755


# -- issue 14: one from_pretrained path, pipeline, card -------------------------------------------


def _config_less_folder(tmp_path: Path) -> Path:
    """A folder with weights but a config.json that names no model_type."""
    plain = _tiny_folder(tmp_path)
    cfg = json.loads((plain / "config.json").read_text())
    del cfg["model_type"]
    (plain / "config.json").write_text(json.dumps(cfg))
    return plain


def test_config_errors_are_one_river_error_on_every_entry_point(tmp_path):
    from river_hf.river.modeling import river_class

    folder = _config_less_folder(tmp_path)
    with pytest.raises(RiverError, match="cannot read the model config"):
        RiverForCausalLM.from_pretrained(str(folder), progress=False)
    with pytest.raises(RiverError, match="cannot read the model config"):
        river_class("LlamaForCausalLM").from_pretrained(str(folder), progress=False)


def test_hub_arguments_reach_the_config(tmp_path, monkeypatch):
    import river_hf.river.modeling as modeling

    seen = []
    real = modeling.AutoConfig.from_pretrained

    def spy(source, **kwargs):
        seen.append(kwargs)
        return real(source, **kwargs)

    monkeypatch.setattr(modeling.AutoConfig, "from_pretrained", spy)
    folder = _tiny_folder(tmp_path)
    model = RiverForCausalLM.from_pretrained(str(folder), tau=2.0, revision="main", token="hf_x",
                                             trust_remote_code=False, progress=False)
    assert seen == [{"revision": "main", "token": "hf_x", "trust_remote_code": False}]
    assert model.river_config.tau == 2.0


def test_pipeline_does_not_say_the_river_model_is_unsupported(tiny_folder):
    import logging

    from transformers import AutoTokenizer, pipeline

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.pipelines.base")
    logger.addHandler(handler)
    try:
        model = RiverForCausalLM.from_pretrained(tiny_folder, tau=2.0, progress=False)
        pipe = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_folder))
        out = pipe("def f(x):", max_new_tokens=3, do_sample=False, river_tau=2.0)
    finally:
        logger.removeHandler(handler)
    assert out[0]["generated_text"].startswith("def f(x):")
    assert not [r for r in records if "is not supported" in r.getMessage()]
    # the Auto classes still map Llama configs to the plain class
    assert type(AutoModelForCausalLM.from_pretrained(tiny_folder)).__name__ == "LlamaForCausalLM"


def test_save_leaves_no_river_auto_map_on_the_model(tmp_path):
    model = RiverForCausalLM.from_pretrained(str(_tiny_folder(tmp_path)), tau=0.5, progress=False)
    model.save_pretrained(tmp_path / "river")
    assert getattr(model.config, "auto_map", None) is None and getattr(model.config, "river", None) is None


def test_card_and_modeling_file_say_how_to_install_and_where_weights_come_from(tiny_river_folder):
    from river_hf import RiverConfig
    from river_hf.river.serialization import model_card

    card = (tiny_river_folder / "README.md").read_text()
    code = (tiny_river_folder / "modeling_river.py").read_text()
    for text in (card, code):
        assert "pip install river-hf" not in text
        assert "not published on PyPI" in text and "bash scripts/setup.sh" in text
        assert "pip install <path to the river-hf checkout>" in text and "URL>" not in text and "git+" not in text
    assert "GGUF" not in card  # a random tiny model: no claim about its weights
    model = RiverForCausalLM.from_pretrained(str(tiny_river_folder), progress=False)
    model.config._name_or_path = "/cache/models/qwen2.5-coder-0.5b"
    card = model_card(model)
    assert "GGUF Q4_K_M file dequantized to fp32" in card and "re-quantize" in card
    assert "Q4_K_M" in RiverConfig.__doc__ and "dequantized to fp32" in RiverConfig.__doc__


def test_auto_from_config_of_a_river_folder_builds_a_river_model(tiny_river_folder):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_river_folder)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    assert isinstance(model, RiverForCausalLM) and model.river_config.tau == 0.5


def test_a_lossless_folder_defaults_to_lossless(tmp_path):
    """RiverConfig.lossless is saved with the folder; the Auto class (what pipeline(...,
    trust_remote_code=True) loads) then decodes in lossless mode, the unmodified model's tokens,
    without being told."""
    from river_hf import RiverConfig

    plain = _tiny_folder(tmp_path)
    with pytest.warns(UserWarning, match="negative"):
        model = RiverForCausalLM.from_pretrained(str(plain), river_config=RiverConfig(tau=-2.0, min_layer=2, backend="int4",
                                                                                      lossless=True), progress=False)
    out = tmp_path / "river-lossless"
    model.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["river"]["lossless"] is True
    with pytest.warns(UserWarning, match="negative"):  # the saved τ is -2: every draft exits
        auto = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, progress=False)
    assert auto.river.mode == "lossless"
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    ref = AutoModelForCausalLM.from_pretrained(plain).generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(auto.generate(ids, max_new_tokens=20, do_sample=False), ref)
    assert auto.river_stats["mode"] == "lossless" and auto.river_stats["lossless"]["drafted"] > 0


# -- issue 21: the card says what is true ---------------------------------------------------------


def test_card_follows_the_real_bits_and_describes_lossless_mode(tiny_river_folder):
    import dataclasses

    from river_hf.river.serialization import model_card

    card = (tiny_river_folder / "README.md").read_text()  # backend "copy": no quantization at all
    assert "full-precision exit copies" in card and "4-bit" not in card and "Lossless mode" not in card
    model = RiverForCausalLM.from_pretrained(str(tiny_river_folder), progress=False)
    model.river_config = dataclasses.replace(model.river_config, backend="int8", exit_head="int8")
    card = model_card(model)
    assert "as 8-bit exit copies" in card and "8-bit weights" in card and "8-bit quantized copy of the LM head" in card
    assert "4-bit" not in card
    model.river_config = dataclasses.replace(model.river_config, backend="int4", exit_head="copy", lossless=True)
    card = model_card(model)
    assert "as 4-bit exit copies" in card and "unquantized copy of the LM head" in card
    assert "## Lossless mode" in card and "`lossless: true`" in card
    assert "fp32 summation order of the multi-token verify passes" in card and "backbone's tokens" in card


def test_converting_a_river_folder_again_keeps_base_model_title_and_gguf_note(tmp_path):
    """A folder named after a registry key (as resolve makes) carries its provenance in config.json, so a
    River folder converted again keeps base_model, the title and the GGUF note; the GGUF's own label
    (_model_name_or_path) does not travel."""
    plain = _tiny_folder(tmp_path)
    registry_like = plain.rename(tmp_path / "qwen2.5-coder-0.5b")
    model = RiverForCausalLM.from_pretrained(str(registry_like), backend="copy", exit_head=None, progress=False)
    model.config._model_name_or_path = "Qwen2.5 Coder 0.5B Instruct AWQ"  # what a GGUF conversion left there
    first = model.save_pretrained(tmp_path / "river-1")
    assert model.config._model_name_or_path == "Qwen2.5 Coder 0.5B Instruct AWQ"  # the model itself unchanged
    again = RiverForCausalLM.from_pretrained(str(first), progress=False)
    second = again.save_pretrained(tmp_path / "river-2")
    for folder in (first, second):
        card = (folder / "README.md").read_text()
        assert "base_model: Qwen/Qwen2.5-Coder-0.5B-Instruct" in card, folder
        assert "# River-LLM early exit for Qwen/Qwen2.5-Coder-0.5B-Instruct" in card
        assert "GGUF Q4_K_M file dequantized to fp32" in card and "RiverLlamaForCausalLM" not in card
        cfg = json.loads((folder / "config.json").read_text())
        assert "_model_name_or_path" not in cfg
        assert cfg["river_source"] == {"base_model": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "model_key": "qwen2.5-coder-0.5b"}
    # a model of unknown origin: no claim, and the title names the plain architecture
    unknown = RiverForCausalLM.from_pretrained(str(_tiny_folder(tmp_path / "other")), backend="copy", progress=False)
    folder = RiverForCausalLM.from_pretrained(str(unknown.save_pretrained(tmp_path / "river-3")),
                                              progress=False).save_pretrained(tmp_path / "river-4")
    card = (folder / "README.md").read_text()
    assert "# River-LLM early exit for LlamaForCausalLM" in card and "GGUF" not in card
    assert "river_source" not in json.loads((folder / "config.json").read_text())
