"""Lossless River on the real Qwen2.5-Coder-0.5B-Instruct, when it is already converted locally.

CI fetches only SmolLM2 (about 100 MB); Qwen2.5-Coder-0.5B is a 400 MB download, so this module
runs where ``river-hf`` has converted it before (``~/.cache/river_hf/models/qwen2.5-coder-0.5b``,
e.g. after ``river-hf generate ...`` with the default model) and is skipped elsewhere, saying so.
benchmarks/lossless_bench.py checks the same on 20 HumanEval problems.
"""

from __future__ import annotations

import pytest
import torch

from river_hf.models import cache_dir, encode_prompt

pytestmark = pytest.mark.real_model

KEY = "qwen2.5-coder-0.5b"
FOLDER = cache_dir() / "models" / KEY


@pytest.fixture(scope="module")
def qwen():
    if not (FOLDER / "config.json").is_file():
        pytest.skip(f"{KEY} is not converted on this machine ({FOLDER}); run `river-hf generate hi` once to fetch it")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from river_hf import RiverForCausalLM

    tok = AutoTokenizer.from_pretrained(FOLDER)
    base = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    river = RiverForCausalLM.from_pretrained(KEY, dtype=torch.float32, progress=False)
    return base, river, tok


def test_lossless_greedy_equals_unmodified_on_qwen(qwen):
    base, river, tok = qwen
    inputs = encode_prompt(tok, "Write a Python function that returns the n-th Fibonacci number.")
    ref = base.generate(**inputs, max_new_tokens=96, do_sample=False)
    with river.river_mode("lossless"):
        out = river.generate(**inputs, max_new_tokens=96, do_sample=False)
    assert torch.equal(out, ref)
    ll = river.river_stats["lossless"]
    assert ll["acceptance_rate"] > 0.5  # the exit path agrees with the backbone on most tokens
