"""``river-hf calibrate`` on the real SmolLM2-135M: the τ it picks meets the budget on the
calibration prompts, and every faster τ of the grid does not; bad input is refused up front."""

from __future__ import annotations

import json

import pytest
import torch

from river_hf.cli import main

pytestmark = pytest.mark.real_model

PROMPTS = ["Write a Python function that adds two numbers.", "What is the capital of France?",
           "Name three colours of the rainbow."]


def test_calibrate_picks_the_fastest_tau_within_budget(smollm2_path, tmp_path):
    from transformers import AutoTokenizer

    from river_hf import RiverConfig, RiverForCausalLM
    from river_hf.eval.agreement import reference_continuation
    from river_hf.eval.calibrate import free_running_agreement
    from river_hf.models import encode_prompt

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out, report = tmp_path / "river.json", tmp_path / "report.json"
    budget = 0.9
    rc = main(["calibrate", "--model", smollm2_path, "--budget", str(budget), "--taus", "0.995,0.98,0.9,0.5",
               "--prompts", str(prompts), "--new-tokens", "16", "--backend", "torch-int8", "--out", str(out),
               "--report", str(report), "--no-progress"])
    assert rc == 0
    result = json.loads(report.read_text())
    chosen = result["chosen"]
    assert chosen["agreement"] >= budget
    faster = [r for r in result["rows"] if r["weight_bytes_per_token"] < chosen["weight_bytes_per_token"]]
    assert all(r["agreement"] < budget for r in faster)

    # the settings file loads, and its τ reproduces the agreement on the calibration prompts
    config = RiverConfig.from_file(out)
    assert config.tau == chosen["tau"] and config.backend == "torch-int8"
    model = RiverForCausalLM.from_pretrained(smollm2_path, river_config=config, progress=False, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    refs = [reference_continuation(model, encode_prompt(tok, p)["input_ids"], 16)[0] for p in PROMPTS]
    again = free_running_agreement(model, tok, PROMPTS, config.tau, refs, 16)
    assert again["agreement"] >= budget


@pytest.mark.parametrize("argv, message", [
    (["--budget", "1.5"], "--budget must be in"),
    (["--taus", "0.9,2"], "every τ must be at most 1"),
    (["--prompts", "/nonexistent.txt"], "no such file"),
    (["--task", "humaneval"], "--allow-code-execution"),
])
def test_calibrate_refuses_bad_input_before_loading(argv, message, capsys):
    assert main(["calibrate", "--model", "smollm2-135m", *argv]) == 2
    assert message in capsys.readouterr().err
