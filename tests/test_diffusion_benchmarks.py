"""The dLLM-Cache benchmark scripts run end to end on the tiny model and write what their docs say
(the timings themselves are not checked: speed is measured by running them, not by tests)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _keep_threads():
    # the scripts call torch.set_num_threads (--threads); later tests compare against child processes
    # running at the default thread count, so the count is restored
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_settings_parse_and_name():
    bench = _script("diffusion_bench")
    assert bench.parse_settings("50,7,0.25;50,7,0.25,off") == [(50, 7, 0.25, "auto"), (50, 7, 0.25, "off")]
    assert bench.setting_name((50, 7, 0.25, "off")) == "Kp=50,Kr=7,rho=0.25,small-batch off"
    assert bench.setting_name((50, 7, 0.25, "auto")) == "Kp=50,Kr=7,rho=0.25"
    with pytest.raises(SystemExit):
        bench.parse_settings("50,7,0.25,maybe")


def test_bench_writes_rounds_and_step_kinds(tmp_path):
    bench = _script("diffusion_bench")
    out = tmp_path / "b"
    argv = ["--size", "tiny", "--prompt-length", "8", "--gen-length", "16", "--steps", "16", "--block-length", "8",
            "--settings", "4,2,0.25;4,2,0.25,off", "--repeats", "3", "--bandwidth-gb-s", "20", "--out", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["complete"] and [r["name"] for r in doc["runs"]] == [
        "uncached", "Kp=4,Kr=2,rho=0.25", "Kp=4,Kr=2,rho=0.25,small-batch off"]
    for run in doc["runs"]:
        assert len(run["seconds_runs"]) == 3 and run["step_seconds_median"]
    assert doc["runs"][2]["small_batch_linear_used"] is False
    assert "meets_flops_share" in doc["runs"][1]
    assert "Where the time goes" in out.with_suffix(".md").read_text() and out.with_suffix(".png").stat().st_size


def test_profile_splits_step_kinds(tmp_path):
    prof = _script("diffusion_profile")
    out = tmp_path / "p.json"
    assert prof.main(["--size", "tiny", "--prompt-length", "8", "--gen-length", "16", "--head-rows", "4",
                      "--threads", "1", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["steps"]) == {"uncached", "full", "verify", "response"}
    assert set(doc["steps"]["uncached"]["gemm"]) == {"24"}  # every product over P + G rows
    assert set(doc["steps"]["verify"]["gemm"]) == {"4", "16"}  # rho * G selected rows, V over G rows
    assert all(s["head_ms"] > 0 for s in doc["steps"].values())
