"""river-hf bench: JSON schema, PNG, the τ > 1 row's exactness, bad input. No timings asserted."""

from __future__ import annotations

import json

import pytest

from river_hf.cli import main


def test_bench_json_png_and_exact_row(tiny_folder, tmp_path):
    out = tmp_path / "bench.json"
    evaljson = tmp_path / "eval.json"
    evaljson.write_text(json.dumps({"task": "gsm8k", "metric": "exact_match",
                                    "results": [{"tau": 2.0, "exact_match": 0.5}, {"tau": 0.5, "exact_match": 0.25}]}))
    assert main(["bench", "--model", tiny_folder, "--taus", "2,0.5", "--new-tokens", "3", "--prompts", "2",
                 "--repeats", "2", "--eval-json", str(evaljson), "--out", str(out), "--no-progress"]) == 0
    report = json.loads(out.read_text())
    png = tmp_path / report["png"]
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = [r["label"] for r in report["rows"]]
    assert labels[0] == "unmodified" and labels[-2:] == ["τ=2", "τ=0.5"]
    assert "fully int4" in labels  # the fully 4-bit copy (the tiny model's exit layers are quanto)
    for key in ("model", "taus", "new_tokens", "prompts", "repeats", "versions", "wall_s", "device", "kernels",
                "bandwidth_limit_gb_s", "river_config", "checkpoint_note"):
        assert key in report
    assert report["bandwidth_limit_gb_s"] > 0
    rows = {r["label"]: r for r in report["rows"]}
    for r in report["rows"]:
        d = r["decode_tokens_per_s"]
        assert len(d["runs"]) == 2 and d["min"] <= d["median"] <= d["max"] and d["median"] > 0
        assert r["ttft_s"]["median"] > 0 and r["new_tokens"] == 2 * 3
        assert r["weight_bytes_per_token"] > 0 and r["bandwidth_gb_s"] > 0 and 0 < r["bandwidth_share"]
        assert 0.0 <= r["next_token_match"] <= 1.0
        assert r["verdict"] in ("reference", "faster", "slower", "not resolved")
    assert rows["unmodified"]["speedup"]["runs"] == [1.0, 1.0] and rows["unmodified"]["verdict"] == "reference"
    assert rows["τ=2"]["next_token_match"] == 1.0 and rows["τ=2"]["mean_exit_layer"] == 4.0
    assert rows["fully int4"]["mean_exit_layer"] == 0.0
    # The fully 4-bit model reads fewer weight bytes per step than the unmodified one.
    assert rows["fully int4"]["weight_bytes_per_token"] < rows["unmodified"]["weight_bytes_per_token"]

    # --plot-only redraws from the report, merging reports of the same task into one panel.
    other = tmp_path / "eval2.json"
    other.write_text(json.dumps({"task": "gsm8k", "metric": "exact_match", "results": [{"tau": 0.5, "exact_match": 0.3}]}))
    png.unlink()
    assert main(["bench", "--plot-only", "--out", str(out), "--eval-json", str(evaljson), "--eval-json", str(other)]) == 0
    assert png.is_file()
    assert json.loads(out.read_text())["rows"] == report["rows"]


@pytest.mark.parametrize("args, message", [
    (["--taus", "2,x"], "tau must be a number"),
    (["--out", "bench.txt"], ".json"),
    (["--eval-json", "missing.json"], "not a river-hf eval report"),
    (["--plot-only", "--out", "none.json"], "needs an existing bench report"),
    (["--prompts", "1000"], "HumanEval has 164 prompts"),
])
def test_bench_bad_input(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
