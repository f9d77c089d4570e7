"""``river-hf calibrate`` on the real SmolLM2-135M: the τ it picks meets the budget on the
calibration prompts, and every faster τ of the grid does not; bad input is refused up front. On a
tiny random model: the small-sample warning, --new-tokens with --task, bytes per decode step."""

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


# -- tiny random model: the sample-size warning, --new-tokens with --task, bytes per step --------------


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM

    model = RiverForCausalLM.from_pretrained(tiny_folder, progress=False, dtype=torch.float32, backend="torch-int8",
                                             exit_head="int4")
    return model, AutoTokenizer.from_pretrained(tiny_folder)


def test_calibrate_warns_when_the_sample_is_too_small(tiny):
    from river_hf.eval.calibrate import MIN_PROMPTS, MIN_REFERENCE_TOKENS, calibrate

    model, tok = tiny
    with pytest.warns(UserWarning, match="too small to trust") as caught:
        result = calibrate(model, tok, [0.3], 0.5, prompts=["Hi"], new_tokens=16, progress=False)
    assert result["sample"]["too_small"] and result["sample"]["prompts"] == 1 < MIN_PROMPTS
    assert result["sample"]["reference_tokens"] <= 16 < MIN_REFERENCE_TOKENS
    assert "1 prompt " in str(caught[0].message)


def test_calibrate_cli_honours_new_tokens_with_a_task(tiny_folder, gsm8k_file, tmp_path, capsys):  # noqa: F811
    report = tmp_path / "report.json"
    main(["calibrate", "--model", tiny_folder, "--task", "gsm8k", "--data", gsm8k_file, "--limit", "1",
          "--taus", "0.3", "--budget", "0.01", "--new-tokens", "64", "--report", str(report), "--no-progress"])
    result = json.loads(report.read_text())
    assert result["new_tokens"] == 64
    assert all(0 < r["max_answer_tokens"] <= 64 for r in result["rows"])
    assert "too small to trust" in capsys.readouterr().err  # 1 problem: the stderr line says so


class _EveryOtherPass:
    """Exit rule for the test: every other forward pass may not leave the backbone; on the others
    the similarity rule after it decides."""

    def __init__(self):
        self.passes = 0

    def __call__(self, layer_idx, hidden_in, hidden_out, token_mask):
        if layer_idx == 0:
            self.passes += 1
            return False
        return None if self.passes % 2 else False


@pytest.mark.filterwarnings("ignore:calibration sample too small")
def test_task_bytes_are_the_mean_over_the_steps_taken(tiny, gsm8k_file):  # noqa: F811
    """Exited steps read the exit head, full-depth steps the original head: the bytes per step are
    the mean over the steps actually taken, not the bytes at the mean exit layer."""
    from river_hf.eval.calibrate import calibrate
    from river_hf.eval.tasks import run_gsm8k
    from river_hf.river.controllers import ExitRuleList, StateTransitionSimilarityRule

    model, tok = tiny
    saved = model.river.rules
    model.river.rules = ExitRuleList([_EveryOtherPass(), StateTransitionSimilarityRule(0.95)])
    try:
        result = calibrate(model, tok, [0.3], 0.01, task="gsm8k", data=gsm8k_file, limit=2, new_tokens=6,
                           progress=False)
    finally:
        model.river.rules = saved
    row = result["rows"][0]
    # the same task run again (same rule, fresh state): its per-answer exit-layer counts
    L = model.river.num_layers
    model.river.rules = ExitRuleList([_EveryOtherPass(), StateTransitionSimilarityRule(0.95)])
    try:
        run = run_gsm8k(model, tok, [2.0, 0.3], limit=2, max_new_tokens=6, data=gsm8k_file, progress=False)
    finally:
        model.river.rules = saved
    counts = [s["exit_layer_counts"] for s in run["results"][1]["samples"]]
    total = [sum(col) for col in zip(*counts)]
    assert total[L] > 0 and sum(total[:L]) > 0  # both kinds of step were taken
    expected = sum(c * model.river_step_bytes(k) for k, c in enumerate(total)) / sum(total)
    assert row["weight_bytes_per_token"] == pytest.approx(expected)
    mean = sum(k * c for k, c in enumerate(total)) / sum(total)
    lo = int(mean)
    interpolated = model.river_step_bytes(lo) + (model.river_step_bytes(min(lo + 1, L)) - model.river_step_bytes(lo)) * (mean - lo)
    assert abs(interpolated - expected) > 0.05 * expected  # the head jump: the old interpolation was wrong


def test_answers_without_a_decode_step_are_left_out_not_zero(tiny):
    from river_hf.eval.agreement import reference_continuation
    from river_hf.eval.calibrate import free_running_agreement
    from river_hf.models import encode_prompt

    model, tok = tiny
    prompts = ["Hi", "Name a colour."]
    refs = [reference_continuation(model, encode_prompt(tok, p)["input_ids"], 1)[0] for p in prompts]
    row = free_running_agreement(model, tok, prompts, 0.3, refs, 1)  # one new token: no decode step
    assert row["weight_bytes_per_token"] is None and row["prompts_without_decode_step"] == len(prompts)


def test_read_prompts_says_which_line_is_broken_json_and_which_lacks_a_prompt(tmp_path):
    import pytest

    from river_hf.errors import RiverError
    from river_hf.eval.calibrate import read_prompts

    good = tmp_path / "good.jsonl"
    good.write_text('plain text prompt\n{"prompt": "a JSON prompt"}\n\n')
    assert read_prompts(str(good)) == ["plain text prompt", "a JSON prompt"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('ok\n{"prompt": "unterminated\n')
    with pytest.raises(RiverError, match="line 2: starts with '{' but is not valid JSON"):
        read_prompts(str(broken))
    for text in ('{"text": "x"}', '{"prompt": 3}'):
        wrong = tmp_path / "wrong.jsonl"
        wrong.write_text(text + "\n")
        with pytest.raises(RiverError, match="line 1: a JSON line needs a string 'prompt' field"):
            read_prompts(str(wrong))
