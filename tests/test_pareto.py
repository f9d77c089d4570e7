"""river-hf pareto: the Pareto-front rule, and the command's JSON/PNG/Markdown on a tiny model
(schema, the τ > 1 point's exactness, resume, bad input). No timings asserted."""

from __future__ import annotations

import json

import pytest

from river_hf.cli import main
from river_hf.pareto import pareto_front
from test_eval import gsm8k_file  # noqa: F401  (fixture)


def test_pareto_front_keeps_the_undominated_points():
    pts = [{"decode_tokens_per_s": {"median": s}, "accuracy": a} for s, a in
           [(10, 0.9), (20, 0.8), (15, 0.7), (30, 0.0), (20, 0.8), (5, None)]]
    # (15, 0.7) is dominated by (20, 0.8); the two equal points do not dominate each other
    assert pareto_front(pts) == [True, True, False, True, True, False]


def test_pareto_command_on_a_tiny_model(tiny_folder, gsm8k_file, tmp_path):  # noqa: F811
    out = tmp_path / "pareto.json"
    argv = ["pareto", "--model", tiny_folder, "--taus", "0.5", "--strategies", "river,kv-mask,recompute",
            "--humaneval", "1", "--gsm8k", "1", "--data", gsm8k_file, "--max-new-tokens", "4", "--prompts", "1",
            "--new-tokens", "3", "--repeats", "1", "--allow-code-execution", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    names = [p["name"] for p in report["points"]]
    assert names == ["unmodified", "fully quantized", "river τ=0.5", "kv-mask τ=0.5", "recompute τ=0.5"]
    for p in report["points"]:
        assert p["decode_tokens_per_s"]["median"] > 0 and 0 <= p["humaneval"] <= 1 and 0 <= p["gsm8k"] <= 1
        assert p["accuracy"] == pytest.approx((p["humaneval"] + p["gsm8k"]) / 2)
        assert isinstance(p["pareto"], bool) and 0 <= p["next_token_match"] <= 1
    assert any(p["pareto"] for p in report["points"])
    unmodified = report["points"][0]
    assert unmodified["next_token_match"] == 1.0 and unmodified["mean_exit_layer"] == report["num_layers"]
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "| unmodified |" in (tmp_path / "pareto.md").read_text()
    assert not (tmp_path / "pareto.json.partial.json").exists()

    # --resume reuses finished accuracy points (here: all of them, from a partial file)
    partial = {p["name"]: {k: p[k] for k in ("strategy", "tau", "humaneval", "gsm8k")} for p in report["points"]}
    partial["kv-mask τ=0.5"]["humaneval"] = 0.123  # a marker: must come back unchanged
    (tmp_path / "pareto.json.partial.json").write_text(json.dumps(partial))
    assert main(argv + ["--resume"]) == 0
    again = {p["name"]: p for p in json.loads(out.read_text())["points"]}
    assert again["kv-mask τ=0.5"]["humaneval"] == 0.123


@pytest.mark.parametrize("args, message", [
    (["--strategies", "river,calm"], "unknown River strategy"),
    (["--taus", "2"], "at most 1"),
    (["--humaneval", "1"], "--allow-code-execution"),
    (["--humaneval", "0", "--gsm8k", "0"], "at least one must be positive"),
    (["--plot-only", "--out", "none.json"], "needs an existing pareto report"),
])
def test_pareto_bad_input(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["pareto", "--model", "smollm2-135m", *args]) == 2
    assert message in capsys.readouterr().err
