"""R-Stitch exactness switches on the real Qwen2.5-Coder pair (0.5B SLM, 1.5B LLM; shared tokenizer,
embedding rows padded to 151936). Skipped when the converted model
folders are not in the river-hf cache (``river-hf`` fetches them on first use of the keys)."""

from __future__ import annotations

import pytest
import torch

from river_hf.models import cache_dir
from river_hf.stitch import LLM, SLM, generate, normalized_entropy

pytestmark = pytest.mark.real_model

KEYS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
PROMPTS = ["Write a Python function that reverses a string.", "What does `len([1, 2, 3])` return?"]
N = 8


def _folder(key):
    return cache_dir() / "models" / key


@pytest.fixture(scope="module")
def qwen_pair():
    missing = [k for k in KEYS if not (_folder(k) / "config.json").is_file()]
    if missing:
        pytest.skip(f"converted model folders missing: {missing} (run `river-hf` with these keys once)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_folder(KEYS[0]))
    slm = AutoModelForCausalLM.from_pretrained(_folder(KEYS[0]), dtype=torch.float32).eval()
    llm = AutoModelForCausalLM.from_pretrained(_folder(KEYS[1]), dtype=torch.float32).eval()
    # the GGUF-converted tokenizer lists the padded rows as tokens too (len 151936 == vocab_size), so
    # here the cut is a no-op; the tiny padded pairs in test_stitch.py exercise the cut itself
    return slm, llm, tok


def _ids(tok, prompt):
    return tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_exactness_switches(qwen_pair, prompt):
    slm, llm, tok = qwen_pair
    ids = _ids(tok, prompt)
    kw = dict(max_new_tokens=N, do_sample=False, tokenizer=tok, assistant_tokenizer=tok)
    ref_llm = llm.generate(ids, max_new_tokens=N, do_sample=False)
    assert generate(slm, llm, ids, tau=-1.0, **kw).tolist() == ref_llm.tolist()
    ref_slm = slm.generate(ids, max_new_tokens=N, do_sample=False)
    assert generate(slm, llm, ids, tau=1.0, **kw).tolist() == ref_slm.tolist()


def test_real_pair_mid_tau_mixes_and_each_token_is_its_source_models_choice(qwen_pair):
    slm, llm, tok = qwen_pair
    ids = _ids(tok, PROMPTS[0])
    n = 12
    out = generate(slm, llm, ids, tau=0.02, max_new_tokens=n, tokenizer=tok, assistant_tokenizer=tok,
                   return_dict_in_generate=True)
    src = out.sources[0].tolist()
    assert SLM in src and LLM in src, f"tau=0.02 should mix both models, got {src}"
    V = len(tok)
    seq = out.sequences
    p = ids.shape[1]
    with torch.no_grad():
        for i, s in enumerate(src):  # re-score without any cache: the kept token is the source's argmax
            model = slm if s == SLM else llm
            logits = model(input_ids=seq[:, : p + i]).logits[:, -1, :V]
            assert int(logits.argmax(-1)) == int(seq[0, p + i])
            h = float(normalized_entropy(logits)[0])
            assert h == pytest.approx(float(out.entropies[0, i]), abs=1e-3)
            if s == SLM:
                assert h <= 0.02 + 1e-3
