"""The dLLM-Cache benchmark scripts run end to end on the tiny model and write what their docs say
(the timings themselves are not checked: speed is measured by running them, not by tests)."""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_scripts import load_benchmark
from river_hf.bench_harness.diffusion_settings import parse_settings, report_line, setting_name



@pytest.fixture(autouse=True)
def _keep_threads():
    # the scripts call torch.set_num_threads (--threads); later tests compare against child processes
    # running at the default thread count, so the count is restored
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def _script(name):
    return load_benchmark(name)


def test_bench_settings_parse_and_name():
    assert parse_settings("50,7,0.25;50,7,0.25,off") == [(50, 7, 0.25, "auto"), (50, 7, 0.25, "off")]
    assert setting_name((50, 7, 0.25, "off")) == "Kp=50,Kr=7,rho=0.25,small-batch off"
    assert setting_name((50, 7, 0.25, "auto")) == "Kp=50,Kr=7,rho=0.25"
    with pytest.raises(SystemExit):
        parse_settings("50,7,0.25,maybe")


def test_bench_writes_rounds_and_step_kinds(tmp_path):
    bench = _script("diffusion_bench")
    out = tmp_path / "b"
    argv = ["--size", "tiny", "--prompt-length", "8", "--gen-length", "16", "--steps", "16", "--block-length", "8",
            "--settings", "4,2,0.25;4,2,0.25,off", "--repeats", "3", "--bandwidth-gb-s", "20", "--out", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["complete"] and [r["name"] for r in doc["runs"]] == [
        "uncached", "Kp=4,Kr=2,rho=0.25", "Kp=4,Kr=2,rho=0.25,small-batch off"]
    for run in doc["runs"]:  # uncached runs next to each of the 2 settings (the timer's interleaved order)
        assert len(run["seconds_runs"]) == 3 * (2 if run["name"] == "uncached" else 1) and run["step_seconds_median"]
        assert run["repeats"] == 3
    assert doc["runs"][2]["small_batch_linear_used"] is False
    assert "meets_flops_share" in doc["runs"][1]
    assert "Where the time goes" in out.with_suffix(".md").read_text() and out.with_suffix(".png").stat().st_size


def test_profile_splits_step_kinds(tmp_path):
    prof = _script("probes/diffusion_profile")
    out = tmp_path / "p.json"
    assert prof.main(["--size", "tiny", "--prompt-length", "8", "--gen-length", "16", "--head-rows", "4",
                      "--threads", "1", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["steps"]) == {"uncached", "full", "verify", "response"}
    assert set(doc["steps"]["uncached"]["gemm"]) == {"24"}  # every product over P + G rows
    assert set(doc["steps"]["verify"]["gemm"]) == {"4", "16"}  # rho * G selected rows, V over G rows
    assert all(s["head_ms"] > 0 for s in doc["steps"].values())


def _hand_flops(prompt, gen, steps, block, kp, kr, rho):
    """FLOPs of one generation on the tiny LLaDA-layout model, counted by hand: (uncached, cached).

    Tiny: vocab 256, d_model 64, 2 blocks, 4 query heads and 2 K/V heads of 16, SwiGLU 128, untied
    head. A Linear costs 2 x weights per row; attention 2 x (QK^T) + 2 x (AV) = 4 x queries x keys x
    heads x head_dim; the LM head runs on the block's still-masked positions only."""
    d, hd, heads, kv_heads, ffn_dim, vocab, layers = 64, 16, 4, 2, 128, 256, 2
    q = o = 2 * d * heads * hd
    k = v = 2 * d * kv_heads * hd
    ffn = 3 * 2 * d * ffn_dim  # gate, up, down
    t = prompt + gen
    att = lambda nq, nk: 4 * nq * nk * heads * hd  # noqa: E731
    full = t * (q + k + v + o + ffn) + att(t, t)
    sel = max(1, int(gen * rho))  # V-verify's recomputed response rows

    def cached(step):
        prompt_refresh, response_refresh = step % kp == 0, step % kr == 0
        if prompt_refresh and response_refresh:
            return full
        spent, rows = 0, 0
        if prompt_refresh:
            spent, rows = spent + prompt * (q + k + v), rows + prompt
        if response_refresh:
            spent, rows = spent + gen * (q + k + v), rows + gen
        else:  # V-verify: V for every response row, Q and K for the selected ones
            spent, rows = spent + gen * v + sel * (q + k), rows + sel
        return spent + rows * (o + ffn) + att(rows, t)

    per_block = steps * block // gen
    per_step = block // per_block  # tokens committed per step
    head_rows = (gen // block) * sum(block - i * per_step for i in range(per_block))
    head = head_rows * 2 * d * vocab
    uncached = layers * steps * full + head
    return uncached, layers * sum(cached(s) for s in range(steps)) + head, layers * steps * full


def test_bench_whole_model_flops_ratio_matches_hand_count(tmp_path):
    """The whole-model FLOPs ratio (layers with attention + the LM head where it runs) in the JSON,
    the table and the verdict lines equals the hand count; Kp=3, Kr=2 reaches all four step kinds.
    The timing comes from river_hf.timing.compare, recorded with the command."""
    from river_hf.diffusion.modeling import SIZES

    assert SIZES["tiny"] == dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
    bench = _script("diffusion_bench")
    out = tmp_path / "w"
    argv = ["--size", "tiny", "--prompt-length", "8", "--gen-length", "16", "--steps", "16", "--block-length", "8",
            "--settings", "3,2,0.25", "--repeats", "3", "--bandwidth-gb-s", "20", "--out", str(out)]
    assert bench.main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    uncached, cached, layers_full = _hand_flops(8, 16, 16, 8, 3, 2, 0.25)
    unc, run = doc["runs"]
    assert run["refresh_counts"] == {"full": 3, "prompt": 3, "response": 5, "verify": 5}
    assert unc["model_flops"] == uncached and run["model_flops"] == cached
    assert run["model_flops_ratio"] == pytest.approx(uncached / cached, rel=1e-12)
    assert run["flops_ratio"] == pytest.approx(layers_full / (cached - (uncached - layers_full)), rel=1e-12)
    assert 1 < run["model_flops_ratio"] < run["flops_ratio"]  # the head is spent cached or not
    assert run["model_overhead_share"] == pytest.approx(1 - run["speedup"] / run["model_flops_ratio"])
    assert run["meets_model_flops_share"] in ("yes", "no", "not resolved")
    # the timer's per-round speedups are the reported ones
    timer_row = next(r for r in doc["timer"]["rows"] if r["label"] == run["name"])
    assert run["speedup_runs"] == timer_row["speedup"]["runs"] and len(run["speedup_runs"]) == 3
    assert [run["speedup_range"][0], run["speedup_range"][1]] == [min(run["speedup_runs"]), max(run["speedup_runs"])]
    assert doc["setup"]["timing_protocol"]["timer"] == "river_hf.timing.compare" and doc["timer"]["interleaved"]
    assert run["speedup_rule"] == "timer: per neighbouring pair"
    assert "--settings 3,2,0.25" in doc["command"]
    md = out.with_suffix(".md").read_text()
    assert "whole-model FLOPs ratio" in md and f"| {run['model_flops_ratio']:.2f}x (" in md
    line = report_line(run, 4.0)
    assert f"whole-model FLOPs ratio {run['model_flops_ratio']:.2f}x" in line and "share of whole-model FLOPs ratio" in line
