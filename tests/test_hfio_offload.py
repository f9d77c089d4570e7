"""Backbone offloading (RiverConfig.offload_from): exactness at τ > 1, and what is actually offloaded.

Offloaded backbone layers run through accelerate's hooks (weights read in for the forward, then
dropped), so the arithmetic is unchanged: at τ > 1 the tokens must equal the unmodified model's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from river_hf import RiverConfig, RiverError, RiverForCausalLM, enable_river
from river_hf.river.offload import is_offloaded

GEN = dict(max_new_tokens=10, do_sample=False)


def _tiny(tmp_path, **kw):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(cfg).eval().to(**kw)
    model.generation_config.pad_token_id = 0
    folder = tmp_path / "tiny-qwen2"
    model.save_pretrained(folder)
    return model, folder


def _batch(device="cpu"):
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # left padding
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _offloaded(model):
    return [is_offloaded(layer.backbone) for layer in model.model.layers]


def test_tiny_offload_at_load_is_exact_at_tau_above_1(tmp_path):
    plain, folder = _tiny(tmp_path)
    want = plain.generate(**_batch(), **GEN)
    model = RiverForCausalLM.from_pretrained(str(folder), tau=2.0, offload_from=1, progress=False)
    assert _offloaded(model) == [False, True, True, True]
    # the offloaded backbone holds no weights between forwards
    assert model.model.layers[2].backbone.mlp.up_proj.weight.device.type == "meta"
    assert torch.equal(model.generate(**_batch(), **GEN), want)


def test_tiny_offload_in_memory_is_exact_and_matches_no_offload_when_exiting(tmp_path):
    plain, folder = _tiny(tmp_path)
    want = plain.generate(**_batch(), **GEN)
    model = enable_river(AutoModelForCausalLM.from_pretrained(folder).eval(), tau=2.0,
                         config=RiverConfig(offload_from=2, offload_dir=str(tmp_path / "off")), progress=False)
    assert _offloaded(model) == [False, False, True, True]
    assert torch.equal(model.generate(**_batch(), **GEN), want)
    # With exits happening, offload changes where weights live, not what is computed.
    ref = RiverForCausalLM.from_pretrained(str(folder), tau=0.0, min_layer=1, progress=False)
    model.set_river_tau(0.0)
    assert torch.equal(model.generate(**_batch(), **GEN), ref.generate(**_batch(), **GEN))


def test_offload_setting_survives_save_and_load(tmp_path):
    _, folder = _tiny(tmp_path)
    model = RiverForCausalLM.from_pretrained(str(folder), tau=2.0, offload_from=3, progress=False)
    out = tmp_path / "river-offload"
    model.save_pretrained(out)
    back = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, progress=False)
    assert back.river_config.offload_from == 3 and _offloaded(back) == [False, False, False, True]
    assert torch.equal(back.generate(**_batch(), **GEN), model.generate(**_batch(), **GEN))


def test_offload_from_out_of_range(tmp_path):
    _, folder = _tiny(tmp_path)
    with pytest.raises(RiverError, match="offload_from=4"):
        RiverForCausalLM.from_pretrained(str(folder), offload_from=4, progress=False)


def test_smollm2_offload_is_exact_at_tau_above_1(smollm2, smollm2_path):
    base, tok = smollm2
    tok.padding_side = "left"
    batch = tok(["def fibonacci(n):", "The capital of France is"], return_tensors="pt", padding=True)
    want = base.generate(**batch, **GEN)
    model = RiverForCausalLM.from_pretrained(smollm2_path, tau=2.0, offload_from=10, progress=False,
                                             dtype=torch.float32)
    assert sum(_offloaded(model)) == 20
    assert torch.equal(model.generate(**batch, **GEN), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_offload_keeps_backbone_in_cpu_memory_and_is_exact(tmp_path):
    plain, folder = _tiny(tmp_path, device="cuda")
    want = plain.generate(**_batch("cuda"), **GEN)
    del plain
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    full = RiverForCausalLM.from_pretrained(str(folder), tau=2.0, backend="copy", device_map="cuda", progress=False)
    assert torch.equal(full.generate(**_batch("cuda"), **GEN), want)
    full_bytes = torch.cuda.memory_allocated()
    del full
    torch.cuda.empty_cache()
    model = RiverForCausalLM.from_pretrained(str(folder), tau=2.0, backend="copy", offload_from=1,
                                             device_map="cuda", progress=False)
    assert _offloaded(model) == [False, True, True, True]
    assert model.model.layers[1].exit_layer.mlp.up_proj.weight.device.type == "cuda"
    assert torch.equal(model.generate(**_batch("cuda"), **GEN), want)
    assert torch.cuda.memory_allocated() < full_bytes
