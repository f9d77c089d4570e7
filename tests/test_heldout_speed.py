"""benchmarks/heldout_speed.py and its harness: the EOS suppressor gives the same tokens as transformers'
min_new_tokens, on River's route and lossless modes too (so the timed methods stay comparable)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from benchmark_scripts import load_benchmark
from river_hf import enable_river
from river_hf.bench_harness import SuppressIds, gguf_tensor_bytes
from test_river_core import tiny_model


def test_suppress_ids_fills_only_those_ids():
    scores = torch.randn(2, 10)
    out = SuppressIds([7, 3, 7])(None, scores.clone())
    assert torch.isinf(out[:, [3, 7]]).all() and (out[:, [3, 7]] < 0).all()
    keep = [i for i in range(10) if i not in (3, 7)]
    assert torch.equal(out[:, keep], scores[:, keep])


def test_suppress_ids_matches_min_new_tokens_on_every_mode():
    model = enable_river(tiny_model("llama"), tau=0.5, min_layer=1, backend="int4", progress=False)
    ids = torch.randint(3, 200, (1, 7))
    eos = [int(model.generation_config.eos_token_id or 2)]
    model.generation_config.eos_token_id = eos[0]
    base = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for mode in ("backbone", "route", "lossless"):
            with model.river_mode(mode):
                ref = model.generate(ids, min_new_tokens=12, **base)
                got = model.generate(ids, logits_processor=LogitsProcessorList([SuppressIds(eos)]), **base)
            assert torch.equal(ref, got), mode
            assert got.shape[1] == ids.shape[1] + 12


def test_onednn_methods_are_refused_when_the_packed_copy_would_not_fit(tiny_folder, tmp_path, monkeypatch, capsys):
    """unmodified-onednn / river-onednn pack a second copy of the plain model's weights: the library's
    memory rule (at most PACK_MEMORY_SHARE of the available memory) refuses it with one argparse error,
    and nothing is written."""
    import pytest

    from river_hf.river import lossless

    bench = load_benchmark("heldout_speed")
    monkeypatch.setattr(lossless, "available_memory_bytes", lambda: 1000)
    out = tmp_path / "h.json"
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", tiny_folder, "--methods", "unmodified,unmodified-onednn", "--prompts", "humaneval:0",
                    "--new-tokens", "2", "--repeats", "1", "--out", str(out)])
    assert e.value.code == 2 and "packed copy" in capsys.readouterr().err
    assert not out.exists()


def test_onednn_methods_run_and_report_their_packed_copy(tiny_folder, tmp_path):
    """The plain model and River on the packed oneDNN copy are timed like every method, on the same
    token counts, and the report says how many bytes the copy took. (Their tokens equal the fp32
    model's only up to summation order, so a random tiny model's near-ties are not asserted.)"""
    import json

    bench = load_benchmark("heldout_speed")
    out = tmp_path / "h.json"
    assert bench.main(["--model", tiny_folder, "--methods", "unmodified,unmodified-onednn,river-onednn",
                       "--prompts", "humaneval:0", "--new-tokens", "3", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["label"] for r in report["comparison"]["rows"]] == ["unmodified", "unmodified-onednn", "river-onednn"]
    assert report["onednn_packed_bytes"] > 0
    assert report["onednn_copy"] in ("lossless mode's verify copy, shared", "its own copy")
    assert all(len(t[0]) == 3 for t in report["tokens"].values())


def test_llama_cpp_step_bytes_count_one_embedding_row_when_the_head_is_separate(tmp_path):
    """river_hf.bench_harness.gguf_tensor_bytes (the llama.cpp method's step bytes): a decode step reads one row of token_embd when
    the GGUF has its own output.weight (the 0.5B Q4_K_M file's 93.6 MB table had been counted whole),
    and the whole table when it is the head (tied, no output.weight)."""
    import numpy as np
    from gguf import GGUFWriter

    embd = np.ones((10, 4), np.float32)  # 10 rows of 4: 160 bytes, 16 a row
    layer = np.ones((3, 4), np.float32)  # 48 bytes

    def write(name, with_output):
        path = str(tmp_path / name)
        w = GGUFWriter(path, "llama")
        w.add_tensor("token_embd.weight", embd)
        w.add_tensor("blk.0.ffn_up.weight", layer)
        if with_output:
            w.add_tensor("output.weight", embd)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    assert gguf_tensor_bytes(write("untied.gguf", True)) == 16 + 48 + 160
    assert gguf_tensor_bytes(write("tied.gguf", False)) == 160 + 48


def test_prompt_kernel_benchmark_compares_both_kernels_on_one_model(tiny_folder, tmp_path, monkeypatch):
    """benchmarks/probes/prompt_kernel.py: with onnxruntime measured faster at 128 rows (scripted), the exit
    Linears get prompt kernels; both configurations are timed per prompt and round, the memory of the
    prompt kernels' copies is reported; a model without prompt kernels is an argparse error."""
    import json

    import pytest

    from river_hf.quant import KERNELS, KernelTuner, autotune

    if not KERNELS["ort-int4"].available("cpu"):
        pytest.skip("needs onnxruntime")
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "load_average", lambda: 0.1)
    us = {"torch-int4": 10.0, "ort-int4": 20.0}
    monkeypatch.setattr(KernelTuner, "measure", lambda self, candidates, linear, rows=1: {
        k.name: (us[k.name] if rows == 1 else 30.0 - us[k.name]) if k.name in us else 50.0 for k in candidates})
    bench = load_benchmark("probes/prompt_kernel")
    out = tmp_path / "pk.json"
    assert bench.main(["--model", tiny_folder, "--backend", "int4", "--problems", "100-101", "--rounds", "2",
                       "--check-tokens", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["prompt_kernels"] == ["ort-int4"] and report["linears_with_prompt_kernel"] == 4 * 7
    assert report["prompt_kernel_weight_bytes"] > 0 and (tmp_path / "pk.png").exists()
    assert len(report["rows"]) == 2 and all(len(r["runs"]["prompt kernel"]) == len(r["runs"]["one-row kernel"]) == 2
                                            for r in report["rows"])
    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "0")  # nothing measured: no prompt kernels
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", tiny_folder, "--backend", "int4", "--problems", "100", "--out", str(out)])
    assert e.value.code == 2


@pytest.mark.parametrize("problems", ["abc", "5-2", "100-999"])
def test_prompt_kernel_benchmark_refuses_bad_problem_ranges(problems, tmp_path):
    bench = load_benchmark("probes/prompt_kernel")
    with pytest.raises(SystemExit) as e:
        bench.main(["--problems", problems, "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and not (tmp_path / "x.json").exists()


def test_batch_runs_left_padded_batches_with_every_rows_tokens(tiny_folder, tmp_path):
    """``--batch 2`` decodes two prompts of different lengths as one left-padded generate call: every
    row gets exactly --new-tokens, the unmodified rows equal each prompt decoded alone (greedy, the
    plain model), and τ > 1 River rows equal the unmodified rows."""
    import json

    bench = load_benchmark("heldout_speed")
    out, alone = tmp_path / "b.json", tmp_path / "a.json"
    common = ["--model", tiny_folder, "--methods", "unmodified,river", "--prompts", "humaneval:0-1",
              "--new-tokens", "4", "--repeats", "1", "--set", "tau=2.0"]
    assert bench.main([*common, "--batch", "2", "--out", str(out)]) == 0
    assert bench.main([*common, "--out", str(alone)]) == 0
    batched, solo = json.loads(out.read_text()), json.loads(alone.read_text())
    assert batched["batch"] == 2 and all(len(row) == 4 for t in batched["tokens"].values() for row in t)
    assert batched["tokens"]["unmodified"] == solo["tokens"]["unmodified"]
    assert batched["tokens"]["river"] == batched["tokens"]["unmodified"]
    assert "batch 2" in (tmp_path / "b.md").read_text()


def test_kv_growth_probe_times_both_caches_with_the_same_tokens(tiny_folder, tmp_path):
    """benchmarks/probes/kv_growth.py: per mode and length, River's growing slots and transformers'
    DynamicCache are timed in alternating rounds on the same model, their tokens equal; --plot-only
    redraws the PNG; a bad --new-tokens or --modes, or --plot-only without a report, is an argparse
    error with nothing written."""
    import json

    import pytest

    bench = load_benchmark("probes/kv_growth")
    out = tmp_path / "kv.json"
    assert bench.main(["--model", tiny_folder, "--modes", "exit,lossless", "--new-tokens", "3,5", "--repeats", "1",
                       "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["same_tokens"] == {"exit 3": True, "exit 5": True, "lossless 3": True, "lossless 5": True}
    assert len(report["rows"]) == 8 and (tmp_path / "kv.png").exists()
    (tmp_path / "kv.png").unlink()
    assert bench.main(["--plot-only", "--out", str(out)]) == 0 and (tmp_path / "kv.png").exists()
    for argv in (["--new-tokens", "1"], ["--modes", "plain"], ["--plot-only"]):
        with pytest.raises(SystemExit) as e:
            bench.main([*argv, "--out", str(tmp_path / "bad.json")])
        assert e.value.code == 2 and not (tmp_path / "bad.json").exists()


def test_report_renders_a_folder_of_other_results_only(tmp_path, monkeypatch):
    """``report.py --render-only --batches ''``: a machine folder without the standard held-out runs gets
    a README listing each JSON with its command and the Markdown table beside it; no batch sizes
    without --render-only is an argparse error."""
    import json

    import pytest

    report = load_benchmark("report")
    monkeypatch.setattr(report, "ROOT", tmp_path)
    folder = tmp_path / "docs" / "results" / "m1"
    folder.mkdir(parents=True)
    (folder / "a.json").write_text(json.dumps({"command": "python benchmarks/x.py --out a.json"}))
    (folder / "a.md").write_text("`python benchmarks/x.py --out a.json`\n\n| t |\n|---|\n| 1 |\n")
    assert report.main(["--machine-label", "m1", "--render-only", "--batches", "", "--readme", ""]) == 0
    text = (folder / "README.md").read_text()
    assert text.startswith("# Results on m1") and "### a.json" in text and "| 1 |" in text
    # the README names the command that wrote it, as it was called
    assert "Written by `python benchmarks/report.py --machine-label m1 --render-only --batches '' --readme ''`" in text
    with pytest.raises(SystemExit) as e:
        report.main(["--machine-label", "m1", "--batches", ""])
    assert e.value.code == 2
