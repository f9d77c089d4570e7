"""The kernels of other libraries (onnxruntime MatMulNBits, torch fbgemm dynamic int8, ARK woqgemm) and
river-hf's own compiled one (river-int4, AVX-512 VNNI or AVX2):
their products, River's exactness with them, the fully quantized mode, and their saved choice.

Tiny random models; nothing timed. A test of a kernel whose library is not installed here is
skipped (with the library named); the tests of what happens *without* a library run everywhere
(its absence simulated where it is installed).
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from river_hf import RiverForCausalLM, enable_river
from river_hf.quant import BACKENDS, KERNELS, KernelTuner, autotune, get_backend, kernel_name, linear_weight_bytes
from river_hf.quant import external
from river_hf.quant import kernels as kernels_module
from river_hf.quant.kernels import relative_error
from river_hf.quant.modules import int4_grid
from river_hf.river import exit_modules

NEW = ["ort-int4", "ort-int4-g32", "ort-int8", "torch-dyn-int8", "ark-int4", "ark-int8", "river-int4"]
LIBRARY = {"ort": "onnxruntime", "ark": "auto-round-lib", "torch": "torch's fbgemm quantized engine",
           "river": "an AVX-512 VNNI or AVX2 CPU and gcc"}


def need(name: str):
    """Skip unless kernel ``name`` is available here."""
    if not KERNELS[name].available("cpu"):
        pytest.skip(f"{name} needs {LIBRARY[name.split('-')[0]]}, not usable here")
    return KERNELS[name]


def tiny(family: str = "llama", tie: bool = False):
    torch.manual_seed(0)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie)
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


def grid_weight(name: str, linear: nn.Linear) -> torch.Tensor:
    """``[out, in]`` float32: the weights kernel ``name`` is meant to multiply by (its grid)."""
    w = linear.weight.detach().float()
    n, k = w.shape
    kernel = KERNELS[name]
    if name == "river-int4":  # torch-int4's grid
        q, scale, zero, g = int4_grid(w, kernel.group_size)
        return ((q.float() - 8).reshape(n, k // g, g) * scale[..., None] + zero[..., None]).reshape(n, k)
    if kernel.bits == 4:
        g = external.block_size_for(k, kernel.group_size)
        q, s, zp = external._asymmetric_int4(w, g)
        return ((q.float().reshape(n, k // g, g) - zp.float()[..., None]) * s[..., None]).reshape(n, k)
    g = k if name in ("ark-int8", "torch-dyn-int8") else external.block_size_for(k, kernel.group_size)
    q, s = external._symmetric_int8(w, g)
    return (q.float().reshape(n, k // g, g) * s[..., None]).reshape(n, k)


# -- the products ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("bias", [False, True])
def test_new_kernel_matches_dense_within_its_width(name, bias):
    kernel = need(name)
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias)
    q = kernel.build(linear)
    x = torch.randn(2, 3, 256)
    y = q(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.float32
    err = relative_error(linear, q)
    # the same bounds as torch's own kernels (tests/test_quant.py); dynamic int8 also quantizes
    # the activations per tensor, which adds about as much again
    assert 0 < err < (0.03 if kernel.bits == 8 else 0.2), err
    assert linear_weight_bytes(q) < linear_weight_bytes(linear) * (0.36 if kernel.bits == 8 else 0.2)
    assert kernel_name(q) == name
    # what the kernel adds to its own weight grid (int8 activations): small. A wrong packing
    # (nibble order, zero points, block layout) would be as far off as a random matrix.
    with torch.no_grad():
        ref = x @ grid_weight(name, linear).T + (linear.bias if bias else 0)
    assert float((y - ref).norm() / ref.norm()) < 0.03
    assert torch.equal(q(x), y)  # deterministic


@pytest.mark.parametrize("name", ["ort-int4", "ort-int4-g32", "ark-int4", "river-int4"])
def test_int4_kernels_pack_an_odd_number_of_blocks(name):
    kernel = need(name)
    torch.manual_seed(0)
    linear = nn.Linear(96, 48)  # 96 = 3 blocks of 32: the last zero-point byte is half padding
    q = kernel.build(linear)
    x = torch.randn(5, 96)
    with torch.no_grad():
        ref = x @ grid_weight(name, linear).T + linear.bias
    assert float((q(x) - ref).norm() / ref.norm()) < 0.03
    assert not kernel.supports(nn.Linear(100, 8))


@pytest.mark.parametrize("name", NEW)
def test_new_kernel_keeps_the_dtype_at_its_boundary_and_takes_empty_batches(name):
    kernel = need(name)
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    q = kernel.build(linear)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    y = q(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 64)
    assert relative_error(linear, q) < (0.04 if kernel.bits == 8 else 0.2)
    empty = q(torch.randn(0, 128, dtype=torch.bfloat16))
    assert empty.shape == (0, 64) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["ort-int4", "torch-dyn-int8", "ark-int4", "river-int4"])
def test_a_deep_copy_computes_the_same(name):
    kernel = need(name)
    q = kernel.build(nn.Linear(128, 32))
    x = torch.randn(2, 128)
    twin = copy.deepcopy(q)
    assert twin is not q and torch.equal(twin(x), q(x))


def test_matmul_nbits_model_is_what_onnxruntime_reads():
    need("ort-int4")
    import numpy as np
    import onnxruntime as ort

    # 8-bit, one block of 16, no zero points (the operator's default 128): W = (B - 128) * 0.5
    b = np.full((2, 1, 16), 130, np.uint8)  # every weight (130 - 128) * 0.5 = 1
    scales = np.full(2, 0.5, np.float32)
    model = external.matmul_nbits_model(16, 2, 8, 16, 0, b.tobytes(), scales.tobytes())
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    (inp,), (out,) = sess.get_inputs(), sess.get_outputs()
    assert (inp.name, inp.shape, out.name, out.shape) == ("A", ["M", 16], "Y", ["M", 2])
    y = sess.run(None, {"A": np.arange(16, dtype=np.float32)[None]})[0]
    assert y.tolist() == [[120.0, 120.0]]


# -- River with the new kernels ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("name", NEW)
def test_tau_above_one_is_token_identical_with_the_new_kernels(family, name):
    need(name)
    model = tiny(family)
    inputs = prompt(2)
    ref = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    enable_river(model, tau=2.0, backend=name, exit_head=name, progress=False)
    assert {k["kernel"] for k in model.river_kernels()} == {name}
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False), ref)
    assert model.river_stats["exit_fraction"] == 0.0


@pytest.mark.parametrize("name", NEW)
def test_fully_quantized_mode_runs_on_each_new_kernel(name):
    need(name)
    model = tiny("qwen2")
    ids = prompt()["input_ids"]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    enable_river(model, tau=2.0, backend=name, exit_head=name, progress=False)
    with torch.no_grad(), model.river_mode("exit"):
        logits = model(input_ids=ids).logits
        out = model.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, 18) and model.river_stats["exit_fraction"] == 1.0
    # every layer and the head on the quantized copies: near the dense logits, far from noise
    err = float((logits - ref).norm() / ref.norm())
    assert torch.isfinite(logits).all() and err < (0.1 if KERNELS[name].bits == 8 else 0.5), err
    from river_hf.river.arch import decoder_stack

    dense = sum(linear_weight_bytes(layer.backbone) for layer in decoder_stack(model)[1])
    dense += linear_weight_bytes(model.get_output_embeddings().backbone)
    assert model.river_stats["weight_bytes_per_token"] < dense * (0.4 if KERNELS[name].bits == 8 else 0.25)


def test_the_measured_choices_include_the_available_new_kernels_but_not_onnxruntime():
    linear = nn.Linear(256, 128)
    for choice, names in (("int4", ("ark-int4", "river-int4")), ("int8", ("torch-dyn-int8", "ark-int8")), ("int4-g32", ())):
        usable = {k.name for k in get_backend(choice).usable(linear)}
        assert usable >= {n for n in names if KERNELS[n].available("cpu")}
        assert usable <= {k.name for k in BACKENDS[choice].candidates}
        # onnxruntime's kernels lost inside a whole decode step (their pool shares the cores): named only
        assert not any(k.name.startswith("ort-") for k in BACKENDS[choice].candidates)
    assert get_backend("ort-int4").candidates == (KERNELS["ort-int4"],)
    # the tuner measures each of them (no timing is asserted, only that every candidate got one)
    candidates = get_backend("int4").usable(linear)
    timings = KernelTuner(False, rounds=1, stream_bytes=1 << 16).measure(candidates, linear)
    assert set(timings) == {k.name for k in candidates} and all(t > 0 for t in timings.values())


def without(monkeypatch, prefix: str) -> None:
    """Make the kernels whose names start with ``prefix`` unavailable (their library 'absent')."""
    available = kernels_module.WeightOnlyKernel.available
    monkeypatch.setattr(kernels_module.WeightOnlyKernel, "available",
                        lambda self, device="cpu": not self.name.startswith(prefix) and available(self, device))


def test_without_onnxruntime_the_choices_fall_back_to_the_other_kernels(monkeypatch):
    monkeypatch.setattr(kernels_module, "ort_works", lambda: False)  # what available() asks
    assert not any(KERNELS[n].available("cpu") for n in ("ort-int4", "ort-int4-g32", "ort-int8"))
    linear = nn.Linear(256, 128)
    assert [k.name for k in get_backend("int4-g32").usable(linear)] == ["torch-int4-g32"]
    assert not any(k.name.startswith("ort-") for k in get_backend("int4").usable(linear))
    # a shape nothing packs falls back to quanto (the last int4 candidate), as before
    assert [k.name for k in get_backend("int4").usable(nn.Linear(100, 8))] == ["quanto-int4"]


# -- the saved choice ----------------------------------------------------------------------------------


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """Measurement on, in a private cache, with scripted timings: ``ort-int4`` fastest."""
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "load_average", lambda: 0.1)
    us = {"ort-int4": 10.0, "torch-int4": 20.0}
    monkeypatch.setattr(KernelTuner, "measure", lambda self, candidates, linear, rows=1: {k.name: us.get(k.name, 50.0)
                                                                                   for k in candidates})


def exit_logits(model) -> torch.Tensor:
    with torch.no_grad(), model.river_mode("exit"):
        return model(input_ids=torch.arange(3, 15)[None]).logits


def test_a_saved_onnxruntime_choice_is_honoured_and_falls_back_without_it(tmp_path, measured, monkeypatch):
    """Folders saved when the int4 choice still measured onnxruntime's kernels name ort-int4: where it
    is available it is used again (the same tokens), elsewhere one warning and this machine's kernel."""
    need("ort-int4")
    model = enable_river(tiny("qwen2"), tau=0.9, backend="int4", exit_head="int4", progress=False)
    assert "ort-int4" not in set(model.river_config.kernel_choice.values())  # no longer a measured candidate
    folder = tmp_path / "river-folder"
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    choice = {key: "ort-int4" for key in config["river"]["kernel_choice"]}
    config["river"]["kernel_choice"] = choice
    (folder / "config.json").write_text(json.dumps(config))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every saved kernel exists here: nothing to warn about
        loaded = RiverForCausalLM.from_pretrained(str(folder), progress=False)
    assert loaded.river_config.kernel_choice == choice and {k["kernel"] for k in loaded.river_kernels()} == {"ort-int4"}
    reference = exit_logits(loaded)
    again = tmp_path / "again"
    loaded.save_pretrained(again)
    assert torch.equal(exit_logits(RiverForCausalLM.from_pretrained(str(again), progress=False)), reference)

    without(monkeypatch, "ort-")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = RiverForCausalLM.from_pretrained(str(folder), progress=False)
    ours = [str(w.message) for w in caught if "saved kernel choice" in str(w.message)]
    assert len(ours) == 1 and "saved ort-int4 (not available on this machine)" in ours[0]
    assert "ort-int4" not in {k["kernel"] for k in fallback.river_kernels()}
    assert torch.allclose(exit_logits(fallback), reference, atol=0.5)  # another int4 kernel, the same grid


def test_a_folder_naming_onnxruntime_loads_without_it(tmp_path, monkeypatch):
    """Runs with or without onnxruntime installed: a saved choice of ort-int4 on a machine where it
    is not available warns once and uses this machine's int4 kernel."""
    without(monkeypatch, "ort-")
    model = enable_river(tiny("llama"), tau=0.9, backend="int4", exit_head="int4", progress=False)
    folder = tmp_path / "river-folder"
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["river"]["kernel_choice"] = {key: "ort-int4" for key in config["river"]["kernel_choice"]}
    (folder / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = RiverForCausalLM.from_pretrained(str(folder), progress=False)
    ours = [str(w.message) for w in caught if "saved kernel choice" in str(w.message)]
    assert len(ours) == 1 and "not available on this machine" in ours[0] and "using torch-int4" in ours[0]
    assert set(loaded.river_config.kernel_choice.values()) == {"torch-int4"}


def test_remeasure_drops_an_entry_whose_kernel_is_gone(tmp_path, monkeypatch, capsys):
    from river_hf.cli import main
    from river_hf.quant.autotune import read_cache

    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "load_average", lambda: 0.1)
    monkeypatch.setattr(KernelTuner, "measure", lambda self, candidates, linear, rows=1: {k.name: 10.0 for k in candidates})
    cache = tmp_path / "cache" / "kernels.json"
    both = [KERNELS["torch-int4"], KERNELS["ort-int4"]]
    KernelTuner().choose(both, nn.Linear(128, 64))
    KernelTuner().choose(both[:1] + [KERNELS["quanto-int4"]], nn.Linear(128, 64))
    without(monkeypatch, "ort-")
    assert main(["kernels", "--remeasure", "128x64"]) == 0
    capsys.readouterr()
    left = [e["candidates"] for e in read_cache(cache)[0].values()]
    assert left == [["quanto-int4", "torch-int4"]]  # measured again; the ort entry dropped


@pytest.mark.parametrize("name, needs", [("ark-int4", "auto-round-lib"), ("ort-int8", "onnxruntime")])
def test_a_named_kernel_whose_library_is_missing_is_one_clear_error(monkeypatch, name, needs):
    from river_hf import RiverError

    without(monkeypatch, name.split("-")[0] + "-")
    with pytest.raises(RiverError, match=needs):
        enable_river(tiny("llama"), tau=0.9, backend=name, exit_head=name, progress=False)


# -- prompt kernels --------------------------------------------------------------------------------


class _Counted(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear, self.calls = linear, []
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):
        self.calls.append(x.numel() // self.in_features)
        return self.linear(x)


def test_prompt_rows_linear_sends_large_calls_to_the_prompt_kernel():
    from river_hf.quant.modules import PromptRowsLinear

    torch.manual_seed(0)
    base = nn.Linear(64, 32)
    decode, prompt_ = _Counted(base), _Counted(base)
    both = PromptRowsLinear(decode, prompt_, min_rows=16)
    for shape in [(1, 1, 64), (2, 1, 64), (1, 15, 64), (1, 16, 64), (3, 40, 64)]:
        assert both(torch.randn(*shape)).shape == (*shape[:-1], 32)
    assert decode.calls == [1, 2, 15] and prompt_.calls == [16, 120]
    q = KERNELS["torch-int4"].build(nn.Linear(128, 64))
    wrapped = PromptRowsLinear(q, KERNELS["torch-int8"].build(nn.Linear(128, 64)), 16)
    assert linear_weight_bytes(wrapped) == linear_weight_bytes(q)  # a decode step reads only the decode copy
    assert kernel_name(wrapped) == "torch-int4"


def test_prompt_kernel_is_added_where_it_measures_faster_and_serves_only_prompts(measured):
    """Scripted timings make ort-int4 faster at 128 rows: each exit Linear it packs gets it as its prompt
    kernel; a 20-token prompt pass in exit mode runs on it, the decode steps on the one-row kernel, and
    the backbone (tau > 1) still gives the plain model's tokens."""
    need("ort-int4")
    from river_hf.quant.autotune import read_cache
    from river_hf.quant.modules import PromptRowsLinear

    plain = tiny("qwen2")
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = plain.generate(ids, max_new_tokens=5, do_sample=False)
    off = enable_river(tiny("qwen2"), tau=2.0, backend="int4", progress=False)
    assert not any(isinstance(m, PromptRowsLinear) for _, m in exit_modules(off))  # off by default
    from river_hf.river import RiverConfig

    model = enable_river(plain, config=RiverConfig(tau=2.0, backend="int4", prompt_kernel=True), progress=False)
    wrapped = [m for _, m in exit_modules(model) if isinstance(m, PromptRowsLinear)]
    assert len(wrapped) == 3 * 7  # every exit Linear of the 3 layers (all pack on onnxruntime here)
    rows = [r for r in model.river_kernel_report if r.get("prompt_kernel")]
    assert len(rows) == 21 and all(r["prompt_kernel"] == "ort-int4" and r["prompt_relative_error"] < 0.2 for r in rows)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), expected)  # tau > 1: the backbone
    for m in wrapped:
        m.decode, m.prompt = _Counted(m.decode), _Counted(m.prompt)
    with torch.no_grad(), model.river_mode("exit"):
        model.generate(ids, max_new_tokens=4, do_sample=False)
    assert all(m.prompt.calls == [20] and m.decode.calls == [1, 1, 1] for m in wrapped)
    entries, invalid, _ = read_cache(autotune.KernelTuner().cache_file)
    assert not invalid and any(e.get("rows") == 128 and "ort-int4" in e["timings_us"] for e in entries.values())


def test_prompt_kernel_off_or_slower_adds_nothing(measured, monkeypatch):
    need("ort-int4")
    from river_hf.quant.modules import PromptRowsLinear
    from river_hf.river import RiverConfig

    off = enable_river(tiny("qwen2"), config=RiverConfig(tau=0.9, backend="int4", prompt_kernel=False), progress=False)
    assert not any(isinstance(m, PromptRowsLinear) for _, m in exit_modules(off))
    us = {"ort-int4": 90.0, "torch-int4": 20.0}
    monkeypatch.setattr(KernelTuner, "measure", lambda self, candidates, linear, rows=1: {k.name: us.get(k.name, 50.0)
                                                                                   for k in candidates})
    slower = enable_river(tiny("qwen2"), config=RiverConfig(tau=0.9, backend="int4", prompt_kernel=True), progress=False)
    assert not any(isinstance(m, PromptRowsLinear) for _, m in exit_modules(slower))
    with pytest.raises(Exception, match="prompt_kernel must be true or false"):
        RiverConfig(prompt_kernel="yes")


def test_prompt_kernel_choice_is_saved_and_reused_without_measuring(tmp_path, measured, monkeypatch):
    """The prompt-kernel choice goes into kernel_choice (key ``...@128rows``): a saved folder loads with
    the same prompt kernels even with measurement off, and river_kernels() shows them."""
    need("ort-int4")
    from river_hf.quant.kernels import prompt_key
    from river_hf.quant.modules import PromptRowsLinear
    from river_hf.river import RiverConfig

    model = enable_river(tiny("qwen2"), config=RiverConfig(tau=0.9, backend="int4", prompt_kernel=True), progress=False)
    saved = model.river_config.kernel_choice
    assert saved[prompt_key("int4", nn.Linear(128, 128))] == "ort-int4"
    groups = model.river_kernels()
    assert all(g["prompt_kernel"] == "ort-int4" and g["prompt_relative_error"] < 0.2 for g in groups
               if g["where"] == "exit layers")
    folder = tmp_path / "river-folder"
    model.save_pretrained(folder)
    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = RiverForCausalLM.from_pretrained(str(folder), progress=False)
    assert sum(isinstance(m, PromptRowsLinear) for _, m in exit_modules(loaded)) == 3 * 7
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), model.river_mode("exit"), loaded.river_mode("exit"):
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                           loaded.generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("case", ["fixed kernel", "no tuner", "no onnxruntime"])
def test_prompt_kernel_that_cannot_apply_warns_why(case, measured, monkeypatch):
    from river_hf.quant.modules import PromptRowsLinear
    from river_hf.river import RiverConfig

    backend = "torch-int4" if case == "fixed kernel" else "int4"
    if case == "no tuner":
        monkeypatch.setenv("RIVER_HF_AUTOTUNE", "0")
    if case == "no onnxruntime":
        without(monkeypatch, "ort-")
    expected = {"fixed kernel": "not a measured choice", "no tuner": "nothing was measured",
                "no onnxruntime": "onnxruntime is not installed"}[case]
    with pytest.warns(UserWarning, match=f"prompt_kernel=True has no effect: .*{expected}"):
        model = enable_river(tiny("qwen2"), config=RiverConfig(tau=0.9, backend=backend, prompt_kernel=True),
                             progress=False)
    assert not any(isinstance(m, PromptRowsLinear) for _, m in exit_modules(model))


def test_prompt_kernel_is_a_keyword_of_enable_river(measured):
    need("ort-int4")
    from river_hf.quant.modules import PromptRowsLinear

    model = enable_river(tiny("qwen2"), tau=0.9, backend="int4", prompt_kernel=True, progress=False)
    assert model.river_config.prompt_kernel is True
    assert sum(isinstance(m, PromptRowsLinear) for _, m in exit_modules(model)) == 3 * 7


def test_prompt_kernel_copies_are_not_built_when_memory_is_short(measured, monkeypatch):
    """Lossless mode's rule for its packed copy bounds the prompt kernels' copies too: over half the
    available memory, one warning and none built; the setting itself is kept (a saved folder still asks)."""
    need("ort-int4")
    from river_hf.quant.modules import PromptRowsLinear
    from river_hf.river import lossless

    monkeypatch.setattr(lossless, "available_memory_bytes", lambda: 1000)
    with pytest.warns(UserWarning, match="prompt kernels' copies would need .* not built"):
        model = enable_river(tiny("qwen2"), tau=0.9, backend="int4", prompt_kernel=True, progress=False)
    assert not any(isinstance(m, PromptRowsLinear) for _, m in exit_modules(model))
    assert model.river_config.prompt_kernel is True
    monkeypatch.setattr(lossless, "available_memory_bytes", lambda: 1 << 40)
    fits = enable_river(tiny("qwen2"), tau=0.9, backend="int4", prompt_kernel=True, progress=False)
    assert sum(isinstance(m, PromptRowsLinear) for _, m in exit_modules(fits)) == 3 * 7
