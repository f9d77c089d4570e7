"""The `river-hf` command line: the main job on the real SmolLM2, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "river_hf.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.real_model
def test_generate_json_with_compare(smollm2_path):
    res = run_cli("generate", "What is the capital of France?", "--model", "smollm2-135m", "--tau", "2",
                  "--max-new-tokens", "8", "--compare", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert "Paris" in out["text"]
    assert out["token_match_rate"] == 1.0  # τ > 1: identical to the unmodified model
    assert out["stats"]["tokens_per_s"] > 0 and out["baseline"]["stats"]["tokens_per_s"] > 0
    assert out["river_config"]["tau"] == 2.0
    # --compare times both side by side: equal token counts, repeats, median and min-max speedup, a verdict.
    sp = out["speedup"]
    assert len(sp["runs"]) == 3 and sp["min"] <= sp["median"] <= sp["max"]
    assert out["verdict"] in ("faster", "slower", "not resolved")
    rows = {r["label"]: r for r in out["comparison"]["rows"]}
    assert rows["River"]["new_tokens"] == rows["unmodified"]["new_tokens"] == out["timed_new_tokens"]
    assert out["comparison"]["bandwidth_limit_gb_s"] > 0
    assert out["exit_fraction"] == out["stats"]["exit_fraction"]  # River's own answer, not a timed backbone run


@pytest.mark.real_model
def test_generate_lossless_compare_gives_the_unmodified_tokens(smollm2_path):
    res = run_cli("generate", "Name three colours.", "--model", "smollm2-135m", "--tau", "0.5",
                  "--lossless", "--draft-tokens", "3", "--max-new-tokens", "16", "--compare", "--repeats", "1", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["token_match_rate"] == 1.0 and out["text"] == out["baseline"]["text"]
    ll = out["stats"]["lossless"]
    assert out["stats"]["mode"] == "lossless" and ll["drafted"] > 0 and 0 <= ll["acceptance_rate"] <= 1
    assert out["river_config"]["draft_tokens"] == 3
    assert {r["label"] for r in out["comparison"]["rows"]} == {"River lossless", "unmodified"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--draft-tokens", "3"], "add --lossless"),
        (["generate", "   "], "prompt is empty"),
        (["generate", "hi", "--tau", "fast"], "--tau must be a number"),
        (["generate", "hi", "--model", "no-such-model"], "unknown model"),
        (["generate", "hi", "--max-new-tokens", "0"], "at least 1"),
        (["generate", "hi", "--device", "xyz"], "--device must be"),
        (["generate", "hi", "--model", "smollm2-135m", "--backend", "foo"], "unknown quantization backend"),
        (["generate", "hi", "--model", "smollm2-135m", "--exit-head", "int3"], "unknown quantization backend"),
        (["generate", "hi", "--prefill", "sometimes"], "invalid choice"),
        (["generate", "hi", "--repeats", "0"], "expected a positive integer"),
        (["bench", "--prompts", "0"], "expected a positive integer"),
        (["generate", "hi", "--model", "smollm2-135m", "--max-new-tokens", "100000000"], "does not fit"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    res = run_cli(*args, timeout=120)
    assert res.returncode == 2
    lines = [l for l in res.stderr.strip().splitlines() if l]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr


def test_help_lists_generate():
    res = run_cli("--help", timeout=60)
    assert res.returncode == 0 and "generate" in res.stdout


def test_convert_refuses_a_folder_that_is_not_river(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    res = run_cli("convert", "smollm2-135m", str(tmp_path), timeout=120)
    assert res.returncode == 2 and "not a River folder" in res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_package_imports_lazily_and_exposes_subpackages():
    """`import river_hf` (what every CLI call does first) must not import torch; public names and
    the method subpackages load on first access."""
    code = (
        "import sys, river_hf\n"
        "assert 'torch' not in sys.modules, 'import river_hf pulled in torch'\n"
        "assert callable(river_hf.stitch.generate) and callable(river_hf.diffusion.generate)\n"
        "assert river_hf.RiverForCausalLM.__name__ == 'RiverForCausalLM'\n"
        "assert {'stitch', 'diffusion', 'RiverConfig'} <= set(dir(river_hf))\n"
        "try:\n    river_hf.no_such_name\nexcept AttributeError:\n    print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
