"""benchmarks/lossless_bench.py: the same kernel treatment for every method (the verify-kernel mode
enters for multi-row forwards of the main model only) and its prompt selection."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from test_river_core import tiny_model
from benchmark_scripts import load_benchmark
from river_hf.bench_harness import (lossless_settings, multi_row_kernel_hooks, parse_problems, parse_prompt_sets,
                                    split_methods)



def _bench():
    return load_benchmark("lossless_bench")


class _CountLinear(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.rows.append(args[0].numel() // args[0].shape[-1])
        return func(*args, **(kwargs or {}))


def test_multi_row_hooks_enter_the_kernel_mode_for_prefill_and_verify_passes_only():
    model = tiny_model("llama")
    mode = _CountLinear()
    handles = multi_row_kernel_hooks(model, mode)
    ids = torch.randint(3, 200, (1, 9))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
        # a verify-like forward of several tokens after the prompt
        model(out[:, :12])
    for h in handles:
        h.remove()
    linears = 4 * 7  # q, k, v, o, gate, up, down in each of the 4 layers
    # inside the mode: the 9-token prefill (its LM head on the last position only), then the
    # 12-token forward (head on every position); none of the 4 one-token decode steps
    assert mode.rows == [9] * linears + [1] + [12] * (linears + 1)
    with torch.no_grad():  # removed hooks: nothing enters any more
        model(out[:, :3])
    assert len(mode.rows) == 2 * linears + 2


def test_problem_ranges():
    assert parse_problems("100-102") == [100, 101, 102]
    assert parse_problems("0,5,7-8") == [0, 5, 7, 8]
    assert parse_prompt_sets("humaneval:100-101,gsm8k:3,5") == [
        ("humaneval", 100), ("humaneval", 101), ("gsm8k", 3), ("gsm8k", 5)]
    with pytest.raises(ValueError, match="humaneval: or gsm8k:"):
        parse_prompt_sets("100-101")


def test_lossless_variants_name_their_settings():
    names = split_methods("unmodified,lossless[draft_path=exit;draft_vocab=32768],lossless+lookup")
    assert names == ["unmodified", "lossless[draft_path=exit;draft_vocab=32768]", "lossless+lookup"]
    assert lossless_settings(names[1]) == {"draft_path": "exit", "draft_vocab": 32768}
    assert lossless_settings("lossless") == {}
    assert lossless_settings("lossless-exit") == {"prompt_lookup_tokens": 0}
    assert lossless_settings("prompt-lookup") is None
    with pytest.raises(ValueError, match="KEY=VALUE"):
        lossless_settings("lossless[draft_path]")


def test_plain_model_on_onednn_and_llama_cpp_methods(tiny_folder, tmp_path, capsys):
    """unmodified-onednn is timed like every method on the same token counts, on a copy the report
    names (lossless mode's own, shared, where it packed one); llama.cpp is refused with one argparse
    error when it cannot run (not installed, or a folder without a GGUF key), and nothing is written."""
    import json

    bench = _bench()
    out = tmp_path / "l.json"
    assert bench.main(["--model", tiny_folder, "--methods", "unmodified,lossless,unmodified-onednn",
                       "--prompts", "humaneval:0", "--new-tokens", "3", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["label"] for r in report["comparison"]["rows"]] == ["unmodified", "lossless", "unmodified-onednn"]
    assert report["onednn_copy"] in ("lossless mode's verify copy, shared", "its own copy")
    assert all(len(t[0]) == 3 for t in report["tokens"].values())
    assert report["summary"]["lossless"]["identical_completions"] == 1
    assert "unmodified-onednn: every Linear call on prepacked oneDNN" in out.with_suffix(".md").read_text()
    bad = tmp_path / "bad.json"
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", tiny_folder, "--methods", "unmodified,llama.cpp", "--prompts", "humaneval:0",
                    "--new-tokens", "3", "--repeats", "1", "--out", str(bad)])
    assert e.value.code == 2 and "llama.cpp" in capsys.readouterr().err and not bad.exists()
