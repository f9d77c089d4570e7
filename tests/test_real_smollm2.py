"""River on the real SmolLM2-135M-Instruct (behaviour that depends on trained weights)."""

from __future__ import annotations

import pytest
import torch

from river_hf import enable_river
from river_hf.eval.agreement import next_token_agreement
from river_hf.models import encode_prompt

pytestmark = pytest.mark.real_model

QUESTIONS = ["What is the capital of France?", "Write one short sentence about the sea, the wind and the sky."]


@pytest.fixture(scope="module")
def river_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return enable_river(model, tau=2.0, progress=False)


def _batch(tok):
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def test_tau_above_one_matches_unmodified_single_and_batched(smollm2, river_smollm2):
    base, tok = smollm2
    single = encode_prompt(tok, QUESTIONS[0])
    batch = _batch(tok)
    assert (batch["attention_mask"] == 0).any(), "the batch must exercise left padding"
    river_smollm2.set_river_tau(2.0)
    for inputs in (single, batch):
        ref = base.generate(**inputs, max_new_tokens=24, do_sample=False)
        out = river_smollm2.generate(**inputs, max_new_tokens=24, do_sample=False)
        assert torch.equal(out, ref)
        assert river_smollm2.river_stats["exit_fraction"] == 0.0


def test_agreement_is_perfect_above_one(river_smollm2, smollm2):
    _, tok = smollm2
    river_smollm2.set_river_tau(2.0)
    agg = next_token_agreement(river_smollm2, encode_prompt(tok, QUESTIONS[1])["input_ids"], max_new_tokens=12)
    assert agg["match_rate"] == 1.0 and agg["mean_kl"] < 1e-6
    assert agg["mean_exit_layer"] == agg["num_layers"]


def test_exiting_model_still_answers_paris(river_smollm2, smollm2):
    """With real exits (most steps leave the backbone), the exit path keeps the answer right."""
    _, tok = smollm2
    river_smollm2.set_river_tau(0.9)
    out = river_smollm2.generate(**encode_prompt(tok, QUESTIONS[0]), max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0], skip_special_tokens=True)
    stats = river_smollm2.river_stats
    assert "Paris" in text
    assert stats["exit_fraction"] > 0.5 and stats["mean_exit_layer"] < stats["num_layers"]


def test_pipeline_runs_river(river_smollm2, smollm2):
    from transformers import pipeline

    _, tok = smollm2
    river_smollm2.set_river_tau(2.0)
    pipe = pipeline("text-generation", model=river_smollm2, tokenizer=tok)
    out = pipe([{"role": "user", "content": QUESTIONS[0]}], max_new_tokens=8, do_sample=False)
    assert "Paris" in out[0]["generated_text"][-1]["content"]
    assert river_smollm2.river_stats["new_tokens"] > 0


def test_lossless_is_the_unmodified_model_on_real_weights(smollm2, river_smollm2):
    """Real exits (τ 0.5: most drafts leave the backbone early), greedy, run to the model's own EOS,
    which then arrives inside a draft; the tokens must be the unmodified model's."""
    base, tok = smollm2
    river_smollm2.set_river_tau(0.5)
    for question in QUESTIONS:
        inputs = encode_prompt(tok, question)
        ref = base.generate(**inputs, max_new_tokens=80, do_sample=False)
        with river_smollm2.river_mode("lossless"):
            out = river_smollm2.generate(**inputs, max_new_tokens=80, do_sample=False)
        assert torch.equal(out, ref)
        ll = river_smollm2.river_stats["lossless"]
        assert ll["drafted"] > 0 and ll["accepted"] > 0
    assert out[0, -1].item() == tok.eos_token_id, "the answer must end at the model's EOS inside the window"


def test_lossless_honours_stop_strings(smollm2, river_smollm2):
    """A stop string completed in the middle of a verified round stops there, as it does for the
    unmodified model."""
    base, tok = smollm2
    river_smollm2.set_river_tau(0.5)
    inputs = encode_prompt(tok, "Write a Python function is_prime(n).")
    gen = dict(max_new_tokens=40, do_sample=False, stop_strings=["def "], tokenizer=tok)
    ref = base.generate(**inputs, **gen)
    with river_smollm2.river_mode("lossless"):
        out = river_smollm2.generate(**inputs, **gen)
    assert ref.shape[1] < inputs["input_ids"].shape[1] + 40, "the stop string must fire for the test to mean something"
    assert torch.equal(out, ref)
