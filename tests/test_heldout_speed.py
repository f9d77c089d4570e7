"""benchmarks/heldout_speed.py: its EOS suppressor gives the same tokens as transformers'
min_new_tokens, on River's route and lossless modes too (so the timed methods stay comparable)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from benchmark_scripts import load_benchmark
from river_hf import enable_river
from test_river_core import tiny_model


def test_suppress_ids_fills_only_those_ids():
    bench = load_benchmark("heldout_speed")
    scores = torch.randn(2, 10)
    out = bench.SuppressIds([7, 3, 7])(None, scores.clone())
    assert torch.isinf(out[:, [3, 7]]).all() and (out[:, [3, 7]] < 0).all()
    keep = [i for i in range(10) if i not in (3, 7)]
    assert torch.equal(out[:, keep], scores[:, keep])


def test_suppress_ids_matches_min_new_tokens_on_every_mode():
    bench = load_benchmark("heldout_speed")
    model = enable_river(tiny_model("llama"), tau=0.5, min_layer=1, backend="int4", progress=False)
    ids = torch.randint(3, 200, (1, 7))
    eos = [int(model.generation_config.eos_token_id or 2)]
    model.generation_config.eos_token_id = eos[0]
    base = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for mode in ("backbone", "route", "lossless"):
            with model.river_mode(mode):
                ref = model.generate(ids, min_new_tokens=12, **base)
                got = model.generate(ids, logits_processor=LogitsProcessorList([bench.SuppressIds(eos)]), **base)
            assert torch.equal(ref, got), mode
            assert got.shape[1] == ids.shape[1] + 12


def test_inference_mode_benchmark_runs_both_contexts_with_the_same_tokens(tiny_folder, tmp_path):
    """benchmarks/inference_mode.py: every mode under no_grad and inference_mode, the same tokens,
    one ratio per round; bad counts are an argparse error."""
    import json

    import pytest

    bench = load_benchmark("inference_mode")
    out = tmp_path / "im.json"
    assert bench.main(["--model", tiny_folder, "--modes", "exit,lossless", "--new-tokens", "4", "--repeats", "2",
                       "--backend", "torch-int4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for mode in ("exit", "lossless"):
        r = report["modes"][mode]
        assert r["identical_tokens"] is True
        assert len(r["seconds"]["no_grad"]) == len(r["seconds"]["inference_mode"]) == 2
        assert r["speedup"]["min"] <= r["speedup"]["median"] <= r["speedup"]["max"]
    with pytest.raises(SystemExit) as e:
        bench.main(["--new-tokens", "1", "--out", str(out)])
    assert e.value.code == 2
