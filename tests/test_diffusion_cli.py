"""``river-hf diffuse`` on tiny random test models and on a saved model folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from river_hf.cli import main

SMALL = ["--steps", "8", "--gen-length", "8", "--block-length", "4", "--prompt-length", "6"]


def test_diffuse_json_compare(capsys):
    assert main(["diffuse", "--model", "tiny-llama", *SMALL, "--kp", "1", "--kr", "1", "--compare", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == 8 and len(out["prompt_ids"]) == 6
    assert out["agreement"] == 1.0  # Kp = Kr = 1 is exact
    assert out["stats"]["refresh_counts"]["full"] == 8


def test_diffuse_small_batch_linear_flag(capsys):
    argv = ["diffuse", "--model", "tiny-llada", *SMALL, "--kp", "4", "--kr", "2", "--json", "--small-batch-linear"]
    assert main([*argv, "on"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["cache"]["small_batch_linear"] is True and stats["small_batch_linear_calls"] > 0
    assert main([*argv, "off"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["small_batch_linear_used"] is False and "small_batch_linear_calls" not in stats
    with pytest.raises(SystemExit) as err:
        main([*argv, "yes"])
    assert err.value.code == 2


def test_diffuse_text_output_and_folder(tmp_path, capsys):
    from river_hf.diffusion import build_test_model

    build_test_model("llada", "tiny", seed=7).save_pretrained(tmp_path)
    assert main(["diffuse", "--model", str(tmp_path), *SMALL, "--prompt-ids", "1,2,3", "--no-cache"]) == 0
    text = capsys.readouterr().out
    assert "tokens:" in text and "cache: none" in text and "8 steps" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no-such-model"], "neither a test model"),
        (["--steps", "7"], "multiple of the number of blocks"),
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", "999999"], "within"),
        (["--prompt", "hello"], "needs a tokenizer"),
        (["--ratio", "2"], "ratio"),
        (["--temperature", "nan"], "--temperature"),
        (["--mask-id", "-3"], "--mask-id"),
        (["--mask-id", "99999999"], "outside this model's vocabulary"),
        (["--kr", "0"], "--kr"),
        (["--no-cache", "--compare"], "drop --no-cache"),
    ],
)
def test_diffuse_bad_input(argv, message, capsys):
    assert main(["diffuse", *SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("river-hf: error:") and message in err and err.count("\n") == 1


def test_diffuse_subprocess_help_and_error():
    env = {**os.environ, "PYTHONPATH": "src"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "river_hf.cli", "diffuse", "--help"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and "--ratio" in r.stdout
    r = subprocess.run([sys.executable, "-m", "river_hf.cli", "diffuse", "--model", "/no/such/dir"], cwd=root,
                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "river-hf: error:" in r.stderr


def test_diffuse_on_a_causal_lm_folder_is_one_line_before_any_load(tmp_path, capfd):
    """A folder holding a plain causal LM is refused from its config, before transformers loads it
    (no load report, no progress bar): stderr (at the file-descriptor level) is the one error line."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    capfd.readouterr()
    for extra in ([], ["--mask-id", "127"]):
        assert main(["diffuse", "--model", str(tmp_path), *SMALL, *extra, "--no-cache", "--json"]) == 2
        err = capfd.readouterr().err
        assert err.startswith("river-hf: error:") and err.count("\n") == 1, err
        assert "'llama' model (LlamaForCausalLM), not a masked-diffusion LM" in err


def test_diffuse_folder_without_mask_id_is_refused_before_loading(tmp_path, capfd):
    from river_hf.diffusion import build_test_model

    model = build_test_model("llada", "tiny", seed=7)
    model.config.mask_token_id = None
    model.save_pretrained(tmp_path)
    capfd.readouterr()
    assert main(["diffuse", "--model", str(tmp_path), *SMALL, "--no-cache"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("river-hf: error:") and err.count("\n") == 1 and "pass --mask-id" in err, err
