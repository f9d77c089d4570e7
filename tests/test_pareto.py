"""river-hf pareto: the Pareto-front rule, and the command's JSON/PNG/Markdown on a tiny model
(schema, the τ > 1 point's exactness, resume, bad input). No timings asserted."""

from __future__ import annotations

import json

import pytest

from river_hf.cli import main
from river_hf.pareto import pareto_front


def _undominated(points) -> list[bool]:
    """The front by brute force, from the definition: no other point at least as fast and as
    accurate and strictly better in one; points without both figures are never on it."""
    xy = [(p["decode_tokens_per_s"]["median"] if isinstance(p["decode_tokens_per_s"], dict) else p["decode_tokens_per_s"],
           p.get("accuracy")) for p in points]
    out = []
    for i, (x, y) in enumerate(xy):
        if x is None or y is None:
            out.append(False)
            continue
        out.append(not any(j != i and qx is not None and qy is not None and qx >= x and qy >= y and (qx, qy) != (x, y)
                           for j, (qx, qy) in enumerate(xy)))
    return out


def test_pareto_front_keeps_the_undominated_points():
    import random

    rng = random.Random(0)
    for _ in range(50):  # random point sets with ties and missing scores
        pts = [{"decode_tokens_per_s": {"median": rng.choice([5, 10, 15, 20, 30])},
                "accuracy": rng.choice([None, 0.0, 0.7, 0.8, 0.9])} for _ in range(rng.randint(1, 8))]
        assert pareto_front(pts) == _undominated(pts)
    # two equal points do not dominate each other; a point without a score is never on the front
    pts = [{"decode_tokens_per_s": {"median": 20}, "accuracy": 0.8}] * 2 + [{"decode_tokens_per_s": {"median": 99},
                                                                             "accuracy": None}]
    assert pareto_front(pts) == [True, True, False]


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
        assert p["humaneval"] == pytest.approx(sum(p["humaneval_passed"]) / len(p["humaneval_passed"]))
        assert p["gsm8k"] == pytest.approx(sum(p["gsm8k_correct"]) / len(p["gsm8k_correct"]))
        if p["name"] != "unmodified":
            assert 0 <= p["next_token_match"] <= 1
    assert [p["pareto"] for p in report["points"]] == _undominated(report["points"])
    unmodified = report["points"][0]
    # the reference has no agreement figure of its own; its exit layer is measured (every layer ran)
    assert unmodified["agreement"] == "reference" and unmodified["next_token_match"] is None
    assert unmodified["mean_exit_layer"] == report["num_layers"]
    assert report["reference_kind"].startswith("plain transformers model")
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "pareto.md").read_text()
    assert "| unmodified |" in md and "plain transformers model" in md and "% of STREAM triad" in md
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
