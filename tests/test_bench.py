"""river-hf bench and the shared timer: JSON schema, PNG, the τ > 1 row's exactness, bad input,
unique labels, the plain reference, interleaving, STREAM, stop-cut tokens. No timings asserted
(the timer's rules are checked on scripted runs)."""

from __future__ import annotations

import json

import pytest

from river_hf.cli import main


def test_bench_json_png_and_exact_row(tiny_folder, tiny_river, tmp_path, capsys):
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
                "stream_triad_gb_s", "stream_copy_gb_s", "stream_threads", "reference_kind", "river_config",
                "checkpoint_note"):
        assert key in report
    assert report["stream_triad_gb_s"] > 0 and report["stream_copy_gb_s"] > 0
    assert report["reference_kind"].startswith("plain transformers model")
    printed = capsys.readouterr().out
    assert "STREAM triad GB/s" in printed and "reference 'unmodified': plain transformers model" in printed
    rows = {r["label"]: r for r in report["rows"]}
    assert len(rows) == len(report["rows"])  # one row per configuration, each its own label
    ref_runs = rows["unmodified"]["decode_tokens_per_s"]["runs"]
    others = len(rows) - 1
    for r in report["rows"]:
        d = r["decode_tokens_per_s"]
        # 2 rounds; the reference runs next to each of the others in each round
        assert len(d["runs"]) == 2 * (others if r["label"] == "unmodified" else 1)
        assert d["min"] <= d["median"] <= d["max"] and d["median"] > 0
        assert r["ttft_s"]["median"] > 0 and r["new_tokens"] == 2 * 3
        assert r["weight_bytes_per_token"] > 0 and r["bandwidth_gb_s"] > 0
        assert r["stream_triad_share"] == pytest.approx(r["bandwidth_gb_s"] / report["stream_triad_gb_s"])
        # each speedup is this row's run over the reference run next to it
        assert set(r["reference_runs"]) <= set(ref_runs)
        assert r["speedup"]["runs"] == pytest.approx([x / b for x, b in zip(d["runs"], r["reference_runs"])])
        assert r["verdict"] in ("reference", "faster", "slower", "not resolved")
        if r["label"] != "unmodified":
            assert 0.0 <= r["next_token_match"] <= 1.0
    assert rows["unmodified"]["verdict"] == "reference" and rows["unmodified"]["next_token_match"] is None
    L = report["num_layers"]
    full = tiny_river.river_step_bytes(L, "river")  # every backbone layer and the original head
    assert rows["unmodified"]["weight_bytes_per_token"] == full and rows["unmodified"]["mean_exit_layer"] == L
    # τ > 1 never exits: the unmodified model's tokens and its bytes
    assert rows["τ=2"]["next_token_match"] == 1.0 and rows["τ=2"]["mean_exit_layer"] == L
    assert rows["τ=2"]["weight_bytes_per_token"] == full
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


# -- the shared timer and bench's own rules, on scripted runs and a tiny model ----------------------

import torch  # noqa: E402

from river_hf import timing  # noqa: E402
from river_hf.timing import Measurement, TokenTimer, compare, measure_generate  # noqa: E402


def _run(tokens_per_s: float, tokens: int = 5) -> Measurement:
    return Measurement(new_tokens=tokens, seconds=1.0, ttft_s=0.1, decode_tokens=tokens - 1,
                       decode_s=(tokens - 1) / tokens_per_s, decode_steps=tokens - 1)


def test_compare_interleaves_the_reference_so_each_ratio_compares_neighbours():
    """The machine slows down run after run; each configuration is exactly twice as fast as the
    run before or after it. Only pairs of neighbours in time show the true 2.0."""
    calls: list[str] = []

    def config(label, factor):
        def run():
            calls.append(label)
            return _run(factor * 100.0 / len(calls))  # drift: the n-th run of the process is 1/n as fast
        return run

    configs = {"R": config("R", 1.0), "A": config("A", 1.0), "B": config("B", 1.0), "C": config("C", 1.0)}
    cmp = compare(configs, reference="R", repeats=2, warmup=False, bandwidth=False)
    assert calls == ["R", "A", "R", "B", "R", "C", "C", "R", "B", "R", "A", "R"]
    assert cmp.interleaved and "R A R B" in cmp.table()
    for row in cmp.rows:
        runs = row["decode_tokens_per_s"]["runs"]
        # every speedup is this row's run over the reference run next to it in time
        assert row["speedup"]["runs"] == pytest.approx([x / r for x, r in zip(runs, row["reference_runs"])])
        assert set(row["reference_runs"]) <= set(cmp.row("R")["decode_tokens_per_s"]["runs"])
    # neighbours: the run right after a reference run (even rounds) or right before it (odd rounds)
    order = [100.0 / (i + 1) for i in range(len(calls))]
    for label in "ABC":
        i0 = calls.index(label)
        i1 = len(calls) - 1 - calls[::-1].index(label)
        assert cmp.row(label)["reference_runs"] == pytest.approx([order[i0 - 1], order[i1 + 1]])


def test_token_timer_counts_only_the_returned_tokens(monkeypatch):
    """A stop string that cuts the output after the streamer saw more tokens: the cut tokens are not
    counted, and the run ends at the last returned token."""
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    prompt = torch.tensor([[7, 8, 9]])

    class Cut:  # streams 6 new tokens (one per step), returns 4 (a stop string matched at the 4th)
        def generate(self, input_ids, streamer, **kwargs):
            streamer.put(input_ids[0])
            for t in range(6):
                streamer.put(torch.tensor([t]))
            streamer.end()
            return torch.cat([input_ids, torch.arange(4)[None]], dim=1)

    m = measure_generate(Cut(), {"input_ids": prompt}, max_new_tokens=6)
    # times: reset at 0, prompt put at 1, tokens at 2..7; the 4th returned token arrived at 5
    assert m.new_tokens == 4 and m.decode_tokens == 3 and m.decode_steps == 3
    assert m.ttft_s == 2.0 and m.seconds == 5.0 and m.decode_s == 3.0
    timer = TokenTimer()
    timer.arrivals = [(1.0, 1), (2.0, 3), (4.0, 3)]  # assisted decoding: several tokens per arrival
    cut = timer.measurement(returned_tokens=5)
    assert (cut.new_tokens, cut.decode_tokens, cut.decode_steps, cut.decode_s) == (5, 4, 2, 3.0)


def test_stream_bandwidth_is_copy_and_triad_at_the_run_thread_count():
    threads = torch.get_num_threads()
    s = timing.stream_bandwidth(nbytes=1 << 20, repeats=2)
    assert s["copy_gb_s"] > 0 and s["triad_gb_s"] > 0 and s["threads"] == threads
    assert s["array_bytes"] == 1 << 20 and torch.get_num_threads() == threads
    s1 = timing.stream_bandwidth(nbytes=1 << 20, repeats=1, threads=1)
    assert s1["threads"] == 1 and torch.get_num_threads() == threads  # the run's count is restored
    cmp = compare({"R": lambda: _run(10.0), "A": lambda: _run(20.0)}, reference="R", repeats=1, warmup=False,
                  bandwidth=False)
    assert cmp.stream_triad_gb_s is None and "STREAM triad GB/s" not in cmp.table()
    assert "STREAM triad GB/s" in timing.stream_line(s["triad_gb_s"], s["copy_gb_s"], s["threads"])


@pytest.fixture(scope="module")
def tiny_river(tiny_folder):
    from river_hf import RiverForCausalLM

    return RiverForCausalLM.from_pretrained(tiny_folder, progress=False, dtype=torch.float32, backend="torch-int8")


def _rules(model):
    return [(type(r).__name__, getattr(r, "tau", None)) for r in model.river.rules]


def test_plain_reference_is_the_transformers_model_on_the_same_weights(tiny_river):
    from transformers import LlamaForCausalLM

    from river_hf.bench import plain_reference
    from river_hf.river import RiverForCausalLM

    plain = plain_reference(tiny_river)
    assert type(plain) is LlamaForCausalLM and not isinstance(plain, RiverForCausalLM)
    river_ptrs = {p.data_ptr() for p in tiny_river.parameters()}
    assert all(p.data_ptr() in river_ptrs for p in plain.parameters())  # shared, not copied
    assert not any(p.is_meta for p in list(plain.parameters()) + list(plain.buffers()))
    ids = torch.tensor([[1, 5, 9, 20, 31]])
    with tiny_river.river_mode("backbone"):
        backbone = tiny_river.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False),
                       backbone)


def test_run_bench_labels_reference_agreement_and_tau(tiny_river, tiny_folder, monkeypatch):
    """Every configuration keeps its own row (no two share a label), the reference is the plain
    model and says so, the model's τ is what it was, and a missing agreement row is None."""
    from river_hf import RiverForCausalLM
    from river_hf.bench import _exit_label, format_rows, run_bench

    # same exit layers, the original head vs a 4-bit exit head: two configurations, two labels
    other = RiverForCausalLM.from_pretrained(tiny_folder, progress=False, dtype=torch.float32, backend="torch-int8",
                                             exit_head="torch-int8")
    assert _exit_label(tiny_river) != _exit_label(other)
    tau_before, rules_before = tiny_river.river_config.tau, _rules(tiny_river)
    ids = [torch.tensor([[1, 5, 9, 20, 31]])]
    taus = [0.5, 0.5000001]  # print alike with :g
    # a caller's label may clash with a built-in one: it is numbered, not dropped
    rows, info = run_bench(tiny_river, ids, taus, new_tokens=3, repeats=1, progress=False, bandwidth=False,
                           extra_models={_exit_label(tiny_river): other})
    labels = [r["label"] for r in rows]
    assert len(labels) == len(set(labels)) == 2 + 1 + len(taus)
    assert labels[0] == "unmodified" and rows[0]["mode"] == "plain"
    assert info["reference_kind"].startswith("plain transformers model (LlamaForCausalLM")
    assert "plain transformers model" in format_rows(rows, info, 1)
    assert tiny_river.river_config.tau == tau_before and _rules(tiny_river) == rules_before
    L = tiny_river.river.num_layers
    assert rows[0]["weight_bytes_per_token"] == tiny_river.river_step_bytes(L, "river")
    assert rows[0]["mean_exit_layer"] == L and rows[0]["agreement"] == "reference"
    assert rows[0]["next_token_match"] is None
    for r in rows[1:]:
        assert r["agreement"] == "measured" and 0 <= r["next_token_match"] <= 1
    # no agreement row at all: every non-reference row says "missing", none claims a match
    import river_hf.eval.tasks as tasks

    monkeypatch.setattr(tasks, "agreement_over_prompts", lambda *a, references=None, **k: ([], references))
    rows, info = run_bench(tiny_river, ids, [0.5], new_tokens=3, repeats=1, progress=False, bandwidth=False,
                           reference="backbone")
    assert rows[0]["mode"] == "backbone" and "backbone mode" in info["reference_kind"]
    assert all(r["next_token_match"] is None and r["mean_kl"] is None for r in rows)
    assert [r["agreement"] for r in rows[1:]] == ["missing"] * (len(rows) - 1)
    assert "n/a" in format_rows(rows, info, 1)


def test_markdown_rows_and_bar_figure_share_one_layout_for_the_benchmarks(tmp_path):
    """The benchmark scripts' tables and bar charts come from one helper: the reference row says so,
    the others carry their per-pair speedup, and extra columns follow in order."""
    from river_hf.files import save_figure
    from river_hf.timing import bandwidth_cell, bar_figure, markdown_rows

    runs = {"R": 10.0, "A": 20.0}
    cmp = compare({k: (lambda v=v: _run(v)) for k, v in runs.items()}, reference="R", repeats=1, warmup=False,
                  bandwidth=False).to_dict()
    lines = markdown_rows(cmp, {"note": lambda r: r["label"].lower(), "GB/s": lambda r: bandwidth_cell(r, 30.0)})
    assert lines[0].startswith("| method | end-to-end tok/s |") and lines[0].endswith("| note | GB/s |")
    assert lines[1].count("---") == 8
    ref, a = lines[2].split(" | "), lines[3].split(" | ")
    assert ref[0] == "| R" and ref[4] == "reference" and ref[6] == "r"
    assert a[0] == "| A" and a[4] == "2.00 (2.00-2.00)" and a[6] == "a"
    assert bandwidth_cell({"bandwidth_gb_s": 12.0}, 30.0) == "12.0 (40 %)"
    assert bandwidth_cell({"bandwidth_gb_s": None}, 30.0) == ""
    fig = bar_figure(cmp["rows"], "title", metric="decode_tokens_per_s", tick=str.lower)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["r", "a"]
    assert [round(p.get_height(), 6) for p in fig.axes[0].patches] == [10.0, 20.0]
    save_figure(fig, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_spread_is_the_one_median_min_max_form():
    """river_hf.timing.spread: compare's rows and the benchmarks with their own loops share it
    (``runs=False``: without the values, as those benchmarks' JSON has always been)."""
    from river_hf.timing import spread

    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert spread([4.0, 1.0], runs=False) == {"median": 2.5, "min": 1.0, "max": 4.0}
    with pytest.raises(ValueError):
        spread([])
