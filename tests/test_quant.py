"""Weight-only kernels, their measured choice, and the exit head (tiny random models; no timing asserted)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

from river_hf import enable_river
from river_hf.eval.common import KERNEL_CHOICES
from river_hf.quant import BACKENDS, KERNELS, CastMemo, KernelTuner, get_backend, kernel_name, linear_weight_bytes
from river_hf.quant.kernels import relative_error
from river_hf.river import RiverConfig

COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny(family: str, tie: bool = False):
    torch.manual_seed(0)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}.get(family)
    if config is not None:
        config = config(**COMMON, tie_word_embeddings=tie)
    else:
        config = Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=8, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def prompt(batch: int = 1):
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (batch, 12))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :5], mask[1, :5] = 0, 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", ["torch-int8", "torch-int4", "torch-int4-g32", "quanto-int8", "quanto-int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_dense_within_its_width(name, bias):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias)
    kernel = KERNELS[name]
    q = kernel.build(linear)
    x = torch.randn(2, 3, 256)
    y = q(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.float32
    err = relative_error(linear, q)
    assert err < (0.02 if kernel.bits == 8 else 0.2), err
    assert err > 0  # it is really quantized
    assert linear_weight_bytes(q) < linear_weight_bytes(linear) * (0.3 if kernel.bits == 8 else 0.2)
    assert kernel_name(q) == name


@pytest.mark.parametrize("name", ["torch-int8", "torch-int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bias_is_added_in_the_callers_dtype_bit_for_bit(name, dtype):
    """The bias add that also casts the kernel's bf16 output (one kernel instead of two) gives the same
    bits as cast-then-add, and the caller's dtype, for fp32, bf16 and fp16 models."""
    from river_hf.quant.modules import _to_dtype_plus_bias

    torch.manual_seed(0)
    q = KERNELS[name].build(nn.Linear(256, 96).to(dtype))
    x = torch.randn(1, 2, 256).to(dtype)
    y = q(x)
    assert y.dtype == dtype
    raw = torch.randn(3, 96).bfloat16()
    for bias in (torch.randn(96).to(dtype), None):
        expected = raw.to(dtype) if bias is None else raw.to(dtype) + bias
        got = _to_dtype_plus_bias(raw, dtype, bias)
        assert got.dtype == dtype and torch.equal(got, expected)


def test_torch_int4_packs_shapes_quanto_cannot():
    """SmolLM2's hidden size 576 is not a multiple of 128: quanto falls back, torch-int4 uses groups of 64."""
    linear = nn.Linear(576, 64)
    assert KERNELS["torch-int4"].supports(linear)
    q = KERNELS["torch-int4"].build(linear)
    assert q.group_size == 64 and relative_error(linear, q) < 0.2
    assert not KERNELS["torch-int4"].supports(nn.Linear(100, 8))
    assert KERNELS["torch-int4-g32"].build(nn.Linear(256, 16)).group_size == 32
    assert not KERNELS["torch-int4"].supports(nn.Linear(256, 8))  # out_features must be a multiple of 16


def test_cast_memo_reuses_one_cast_and_sees_inplace_changes():
    memo = CastMemo()
    x = torch.randn(1, 4)
    a = memo.cast(x, torch.bfloat16)
    assert memo.cast(x, torch.bfloat16) is a  # sibling Linears share the cast
    x.add_(1.0)  # an in-place change bumps the version: cast again
    b = memo.cast(x, torch.bfloat16)
    assert b is not a and torch.allclose(b.float(), x, atol=0.05)


def test_cast_memo_works_on_inference_tensors():
    """Inside torch.inference_mode() tensors have no version counter; the memo keys on identity."""
    memo = CastMemo()
    with torch.inference_mode():
        x = torch.randn(1, 4)
        a = memo.cast(x, torch.bfloat16)
        assert memo.cast(x, torch.bfloat16) is a
        assert memo.cast(torch.randn(1, 4), torch.bfloat16) is not a


@pytest.mark.parametrize("name", ["torch-int8", "torch-int4"])
def test_exit_path_generates_inside_inference_mode(name):
    """A user's ``with torch.inference_mode(): model.generate(...)`` on the exit path gives the
    tokens of the same call under no_grad (it raised "Inference tensors do not track version
    counter" from the cast shared by sibling projections)."""
    model = enable_river(tiny("qwen2"), backend=name, progress=False)
    with model.river_mode("exit"):
        with torch.no_grad():
            expected = model.generate(**prompt(2), max_new_tokens=6, do_sample=False)
        with torch.inference_mode():
            got = model.generate(**prompt(2), max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)


def test_cli_kernel_names_are_the_backends():
    assert set(KERNEL_CHOICES) == set(BACKENDS)


def test_tuner_measures_once_and_caches_per_machine(tmp_path, monkeypatch):
    """Timings scripted (distinct, fast) on a quiet machine: a real timing on a busy test machine
    is invalid by design and would go to the prior ranking (tests/test_tuner_load.py)."""
    from river_hf.quant import autotune

    monkeypatch.setattr(autotune, "load_average", lambda: 0.1)
    monkeypatch.setattr(KernelTuner, "measure",
                        lambda self, candidates, spec, rows=1: {k.name: 10.0 * (i + 1) for i, k in enumerate(candidates)})
    cache = tmp_path / "kernels.json"
    linear = nn.Linear(128, 64)
    candidates = get_backend("int8").usable(linear)  # the int8 kernels this machine has
    tuner = KernelTuner(cache, rounds=3, stream_bytes=1 << 20)
    kernel, timings = tuner.choose(candidates, linear)
    assert kernel in candidates and set(timings) == {k.name for k in candidates}
    assert all(t > 0 for t in timings.values()) and kernel.name == min(timings, key=timings.get)
    assert tuner.measured == 1
    saved = json.loads(cache.read_text())
    assert saved["format"] == 2 and len(saved["entries"]) == 1
    entry = next(iter(saved["entries"].values()))
    assert entry["shape"] == "128x64" and entry["timings_us"] == timings and entry["kernel"] == kernel.name
    again = KernelTuner(cache, rounds=3, stream_bytes=1 << 20)
    assert again.choose(candidates, linear)[0] == kernel and again.measured == 0


def test_damaged_cache_is_measured_again(tmp_path, monkeypatch):
    """A cache that is not JSON is not trusted: the shape is measured (the timing function runs)
    and the file then holds a valid entry with the new timings."""
    cache = tmp_path / "kernels.json"
    linear = nn.Linear(128, 64)
    choice = get_backend("int8")
    calls = []

    def scripted(self, candidates, spec, rows=1):
        calls.append((spec.in_features, spec.out_features))
        return {k.name: 10.0 + i for i, k in enumerate(candidates)}

    monkeypatch.setattr(KernelTuner, "measure", scripted)
    from river_hf.quant import autotune

    monkeypatch.setattr(autotune, "load_average", lambda: 0.1)  # quiet: the timings are valid
    cache.write_text("not json")
    tuner = KernelTuner(cache)
    kernel, timings = tuner.choose(choice.candidates, linear)
    assert calls == [(128, 64)] and tuner.measured == 1
    assert kernel is choice.candidates[0] and timings == {k.name: 10.0 + i for i, k in enumerate(choice.candidates)}
    saved = json.loads(cache.read_text())
    assert saved["format"] == 2 and [e["timings_us"] for e in saved["entries"].values()] == [timings]
    assert KernelTuner(cache).choose(choice.candidates, linear)[1] == timings and len(calls) == 1  # trusted now


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("backend, head", [("int8", "int4"), ("int4", "int8"), ("int4-g32", "int4-g32"),
                                           ("torch-int8", None)])
@pytest.mark.parametrize("batch", [1, 2])
def test_tau_above_one_is_exact_with_every_exit_head_and_kernel(family, backend, head, batch):
    model = tiny(family)
    inputs = prompt(batch)
    ref = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    enable_river(model, tau=2.0, backend=backend, exit_head=head, progress=False)
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False), ref)
    assert model.river_stats["exit_fraction"] == 0.0


def test_exit_head_serves_exited_steps_and_tied_embeddings_stay_tied():
    model = tiny("llama", tie=True)
    emb = model.get_input_embeddings().weight
    assert model.lm_head.weight is emb
    inputs = prompt()
    with torch.no_grad():
        ref_logits = model(**inputs).logits
    enable_river(model, tau=2.0, backend="copy", exit_head="int4", progress=False)
    assert model.get_output_embeddings().weight is emb and model.get_input_embeddings().weight is emb
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, ref_logits)  # backbone path: the original head
        with model.river_mode("exit"):  # copy exit layers = backbone math; only the head is quantized
            exit_logits = model(**inputs).logits
    assert not torch.equal(exit_logits, ref_logits)
    rel = float((exit_logits - ref_logits).norm() / ref_logits.norm())
    assert 0 < rel < 0.2
    heads = [k for k in model.river_kernels() if k["where"] == "exit head"]
    assert len(heads) == 1 and heads[0]["kernel"] == "torch-int4"
    # Exited steps read the exit head's bytes, backbone steps the original head's.
    L = model.river.num_layers
    assert model.river_step_bytes(0) < model.river_step_bytes(L)
    # the baselines read no exit layers after the exit, state propagation only their K/V projections
    assert model.river_step_bytes(1, "skipdecode") < model.river_step_bytes(1, "state-propagation") \
        < model.river_step_bytes(1, "river")


def test_prefill_backbone_keeps_the_prompt_on_the_backbone():
    model = tiny("llama")
    with pytest.warns(UserWarning, match="negative"):  # legal, but every step then exits after min_layer
        enable_river(model, tau=-1.0, backend="copy", prefill="backbone", progress=False)
    model.generate(**prompt(), max_new_tokens=4, do_sample=False)
    s = model.river_stats
    assert s["prefill_exit_layer"] == model.river.num_layers  # the prompt ran on the backbone
    assert s["exit_fraction"] == 1.0  # decode steps still exit
    model.river.prefill = "route"
    model.generate(**prompt(), max_new_tokens=4, do_sample=False)
    assert model.river_stats["prefill_exit_layer"] < model.river.num_layers
    assert model.river_stats["prefill_seconds"] > 0 and model.river_stats["decode_tokens_per_s"] > 0


def test_config_round_trip_and_bad_settings():
    rc = RiverConfig(tau=0.9, backend="int8", exit_head="int4", prefill="backbone")
    d = json.loads(json.dumps(rc.to_dict()))
    assert d["exit_head_quantization"]["bits"] == 4 and d["quantization"]["candidates"] == [
        k.name for k in BACKENDS["int8"].candidates]
    back = RiverConfig.from_dict(d)
    assert (back.tau, back.backend, back.exit_head, back.prefill) == (0.9, "int8", "int4", "backbone")
    assert back.build_rules().to_list() == rc.build_rules().to_list()
    from river_hf import RiverError

    with pytest.raises(RiverError, match="prefill"):
        RiverConfig(prefill="sometimes")
    with pytest.raises(RiverError, match="unknown quantization backend"):
        RiverConfig(exit_head="int3")
