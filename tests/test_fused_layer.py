"""River's fused exit layer (``RiverConfig.exit_layer_impl``) against the architecture's exit copy.

On tiny random Llama, Qwen2 (q/k/v biases) and Mistral (a sliding window shorter than the prompt)
configs, with and without stacked projections: each fused layer computes what its architecture
copy computes on the same kernel modules (relative error <= 1e-3 of the output and the update, and
the same K/V written), on a left-padded batch of two (4-D masks) in the prefill and in decode steps
with the cache in use; τ > 1 stays token-identical to the plain model and lossless greedy equals it;
architectures no family supports, a failed build check and calls the layer cannot serve fall back
to the architecture copy; the setting round-trips. One trained check: the fully quantized
SmolLM2-135M generates (nearly) the same greedy tokens with either implementation.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from river_hf import RiverError, RiverForCausalLM, enable_river
from river_hf.quant.modules import linear_weight_bytes
from river_hf.river import RiverConfig, exit_modules
from river_hf.river import fused_layer
from river_hf.river.fused_layer import FAMILIES, FusedExitLayer, check_against_architecture, fused_exit_layer
from river_hf.river.fused_llama import FusedLlamaLayer

from test_river_core import COMMON, GEN, batch_inputs, tiny_config, tiny_model

NEGATIVE_TAU = "ignore:tau=-2 is negative"
CASES = ["llama", "qwen2", "mistral-window", "qwen2-eager"]


def tiny(case: str):
    """A tiny random model: the test_river_core families, a Mistral whose sliding window (8) is
    shorter than the 12-token prompt, and a Qwen2 on eager attention."""
    torch.manual_seed(0)
    if case == "mistral-window":
        model = AutoModelForCausalLM.from_config(MistralConfig(**COMMON, sliding_window=8))
    elif case == "qwen2-eager":
        model = AutoModelForCausalLM.from_config(Qwen2Config(**COMMON), attn_implementation="eager")
    else:
        return tiny_model(case)
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def river(model, impl: str, tau: float = -2.0, fuse: bool = True, backend: str = "torch-int4", min_layer: int = 1,
          **kw):
    config = RiverConfig(tau=tau, min_layer=min_layer, backend=backend, exit_head=None, fuse_projections=fuse,
                         exit_layer_impl=impl, **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "tau=-2 is negative")
        return enable_river(model, config=config, progress=False)


def fused_layers(model) -> list:
    return [layer.exit_layer for layer in model.model.layers if isinstance(layer.exit_layer, FusedExitLayer)]


def relative(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    scale = b if scale is None else scale
    return float((a.float() - b.float()).norm() / scale.float().norm())


def layer_calls(model, inputs, steps: int) -> list[tuple]:
    """``(exit layer, hidden in, kwargs with a copy of the cache as it was before the call, 2-D
    padding mask of the pass)`` of every exit-layer call of an exit-mode prefill and ``steps``
    greedy decode steps."""
    seen = []
    current = {}

    def pre(module, args, kwargs):
        kw = dict(kwargs)
        kw["cache"] = copy.deepcopy(kw["cache"])
        seen.append((module, args[0].clone(), kw, current["mask"].bool()))

    handles = [layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in fused_layers(model)]
    try:
        with torch.no_grad(), model.river_mode("exit"):
            ids, mask, cache = inputs["input_ids"], inputs["attention_mask"], None
            for _ in range(steps + 1):
                current["mask"] = mask
                out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
                cache = out.past_key_values
                ids = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    finally:
        for h in handles:
            h.remove()
    return seen


# -- the layer against its architecture copy --------------------------------------------------------


@pytest.mark.parametrize("fuse", [True, False], ids=["stacked", "separate"])
@pytest.mark.parametrize("case", CASES)
def test_each_fused_layer_computes_what_its_architecture_copy_computes(case, fuse):
    model = river(tiny(case), "fused", fuse=fuse)
    layers = fused_layers(model)
    assert len(layers) == 4 and all(isinstance(e, FusedLlamaLayer) for e in layers)
    assert all(e.check_error is not None and e.check_error <= fused_layer.CHECK_TOLERANCE for e in layers)
    calls = layer_calls(model, batch_inputs(), steps=3)
    assert len(calls) == 4 * 4 and {kw["attention_mask"] is None for _, _, kw, _ in calls} == {False}  # 4-D masks
    for layer, h, kw, mask in calls:
        idx = layer.layer_index
        arch_kw = dict(kw, cache=copy.deepcopy(kw["cache"]))
        with torch.no_grad():
            out_f = layer(h, **kw)
            out_a = layer.architecture(h, **arch_kw)
        assert out_f.shape == out_a.shape and out_f.dtype == out_a.dtype
        # real tokens only: a padding position's query sees no key, and eager and SDPA fill such a row
        # differently (its output is never read, its K/V are masked for every real query)
        real = mask[:, -h.shape[1]:]
        out_f, out_a, h = out_f[real], out_a[real], h[real]
        assert relative(out_f, out_a) <= 1e-3 and relative(out_f, out_a, out_a - h) <= 1e-3
        for name in ("keys", "values"):
            written_f, written_a = getattr(kw["cache"].layers[idx], name), getattr(arch_kw["cache"].layers[idx], name)
            assert written_f.shape == written_a.shape and written_f.dtype == written_a.dtype
            real_kv = mask[:, -written_f.shape[2]:]
            assert relative(written_f.transpose(1, 2)[real_kv], written_a.transpose(1, 2)[real_kv]) <= 1e-3


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_a_whole_exit_mode_pass_gives_the_architecture_copys_logits(case):
    fused, arch = river(tiny(case), "fused"), river(tiny(case), "architecture")
    inputs = batch_inputs()
    with torch.no_grad(), fused.river_mode("exit"), arch.river_mode("exit"):
        a, b = arch(**inputs).logits, fused(**inputs).logits
    assert relative(b, a) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_16_bit_model_gets_fused_layers_within_its_own_rounding(dtype):
    bound = fused_layer.check_tolerance(dtype)
    assert bound == 4 * torch.finfo(dtype).eps and fused_layer.check_tolerance(torch.float32) == 1e-3
    fused = river(tiny("qwen2").to(dtype), "fused")
    layers = fused_layers(fused)
    assert len(layers) == 4 and all(e.check_error <= bound for e in layers)
    arch = river(tiny("qwen2").to(dtype), "architecture")
    inputs = batch_inputs()
    with torch.no_grad(), fused.river_mode("exit"), arch.river_mode("exit"):
        a, b = arch(**inputs).logits, fused(**inputs).logits
    assert b.dtype == a.dtype == dtype and relative(b, a) <= bound


def test_the_check_compares_the_update_and_the_kv_written():
    model = river(tiny("qwen2"), "fused")
    layer = fused_layers(model)[2]
    family = FAMILIES["llama"]
    assert check_against_architecture(family, layer, layer.architecture, layer.attn_config) <= 1e-5
    spoiled = copy.deepcopy(layer)
    with torch.no_grad():
        spoiled.norms[1].weight.mul_(1.01)  # the fused layer reads the norm on the architecture copy: both change
        assert check_against_architecture(family, spoiled, spoiled.architecture, layer.attn_config) <= 1e-5
        spoiled.__dict__["norms"] = (spoiled.norms[0], copy.deepcopy(spoiled.norms[1]))
        spoiled.norms[1].weight.mul_(1.05)  # only the fused layer's norm: its MLP input is off by 5 %
        assert check_against_architecture(family, spoiled, spoiled.architecture, layer.attn_config) > 1e-3


# -- exactness switches ------------------------------------------------------------------------------


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
@pytest.mark.parametrize("case", CASES)
def test_tau_above_one_stays_token_identical_with_fused_exit_layers(case, batched):
    inputs = batch_inputs() if batched else {k: v[:1] for k, v in batch_inputs().items()}
    ref = tiny(case).generate(**inputs, **GEN)
    model = river(tiny(case), "fused", tau=1.5)
    assert len(fused_layers(model)) == 4
    assert torch.equal(model.generate(**inputs, **GEN), ref)
    assert model.river_stats["exit_fraction"] == 0.0


@pytest.mark.parametrize("case", CASES)
def test_lossless_greedy_with_fused_exit_layers_equals_the_plain_model(case):
    base = tiny(case)
    model = river(copy.deepcopy(base), "fused", min_layer=2, backend="int4")
    drafts = []
    handles = [e.register_forward_pre_hook(lambda m, a, k: drafts.append(1), with_kwargs=True)
               for e in fused_layers(model)]
    torch.manual_seed(2)
    for ids in (torch.randint(3, 256, (1, 12)), torch.randint(3, 256, (1, 20))):
        ref = base.generate(ids, max_new_tokens=30, do_sample=False)
        with model.river_mode("lossless"):
            out = model.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(out, ref)
        assert model.river_stats["lossless"]["rounds"] > 0
    for h in handles:
        h.remove()
    assert drafts, "the drafts ran no fused exit layer"


@pytest.mark.parametrize("case", ["llama", "mistral-window"])
def test_route_mode_with_rows_exiting_apart_gives_the_architecture_copys_tokens(case):
    """A batch whose rows leave the backbone at different layers (RowsCache, per-row arguments)."""
    inputs = batch_inputs()
    outs, rows = [], []
    for impl in ("architecture", "fused"):
        model = river(tiny(case), impl, tau=0.7)
        end = model.river.end

        def logged(batch, tokens, cache=None, _end=end, _router=model.river):
            rows.append(tuple(_router.row_exit_layers(batch)))
            return _end(batch, tokens, cache)

        model.river.end = logged
        outs.append(model.generate(**inputs, **GEN))
    assert torch.equal(outs[0], outs[1])
    assert any(a != b for a, b in rows), "the rows never exited at different layers"


def test_a_static_cache_gives_the_architecture_copys_tokens():
    inputs = {k: v[:1] for k, v in batch_inputs().items()}
    outs = [river(tiny("llama"), impl).generate(**inputs, **GEN, cache_implementation="static")
            for impl in ("architecture", "fused")]
    assert torch.equal(outs[0], outs[1])


# -- fallbacks ---------------------------------------------------------------------------------------


def test_an_architecture_no_family_supports_keeps_its_exit_copies():
    with pytest.warns(UserWarning, match="exit_layer_impl='fused': no fused exit layer .*gemma3_text"):
        model = river(tiny_model("gemma3"), "fused")
    assert fused_layers(model) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto: no warning
        warnings.filterwarnings("ignore", "tau=-2 is negative")
        model = river(tiny_model("gemma3"), "auto")
    assert fused_layers(model) == []
    assert not FAMILIES["llama"].supports(model.model.layers[0].exit_layer, tiny_config("gemma3"))
    assert fused_layers(river(tiny("llama"), "auto"))


def test_an_architecture_copy_is_wrapped_on_request_and_kept_for_architecture():
    model = river(tiny("mistral-window"), "architecture")
    copy_ = model.model.layers[2].exit_layer
    assert fused_exit_layer(copy_, "architecture") is copy_
    fused = fused_exit_layer(copy_, "auto", "layers.2")
    assert isinstance(fused, FusedLlamaLayer) and fused.architecture is copy_
    assert fused.check_error <= fused_layer.CHECK_TOLERANCE


def test_a_failed_build_check_keeps_the_architecture_copy(monkeypatch):
    monkeypatch.setattr(fused_layer, "check_against_architecture", lambda *a, **k: 0.5)
    with pytest.warns(UserWarning, match=r"layers\.[0-3] differs from the architecture.s exit copy by 5\.00e-01"):
        model = river(tiny("llama"), "auto")
    assert fused_layers(model) == []

    def broken(*a, **k):
        raise TypeError("update() got an unexpected keyword argument")

    monkeypatch.setattr(fused_layer, "check_against_architecture", broken)
    with pytest.warns(UserWarning, match="failed to build or its check .*TypeError"):
        assert fused_layers(river(tiny("llama"), "fused")) == []


def test_calls_the_fused_layer_cannot_serve_run_the_architecture_copy():
    model = river(tiny("llama"), "fused")
    layer = fused_layers(model)[1]
    ran = []
    handle = layer.architecture.register_forward_hook(lambda m, a, out: ran.append(1))  # a hook expects that module
    calls = layer_calls(model, {k: v[:1] for k, v in batch_inputs().items()}, steps=1)
    handle.remove()
    assert len(ran) == sum(m is layer for m, *_ in calls) == 2
    h, kw = calls[-1][1], dict(calls[-1][2], cache=None)
    sentinel = torch.zeros(1)
    layer.architecture.forward = lambda *a, **k: (ran.append(k), sentinel)[1]  # no hook: counts the calls
    ran.clear()
    with torch.no_grad():
        assert layer(h, **kw) is not sentinel and not ran  # served fused
        layer.train()
        assert layer(h, **kw) is sentinel  # training mode
        layer.eval()
        assert layer(h, **dict(kw, position_embeddings=None)) is sentinel  # no rotary tables
        cos, sin = kw["position_embeddings"]
        assert layer(h, **dict(kw, position_embeddings=(cos[..., :8], sin[..., :8]))) is sentinel  # partial rotary
    assert len(ran) == 3 and all(k["cache"] is None for k in ran)


# -- the setting and what reads exit layers -----------------------------------------------------------


def test_the_setting_is_checked_and_round_trips(tmp_path):
    import argparse

    from river_hf import cli_args
    from river_hf.river import config as river_config

    assert cli_args.EXIT_LAYER_IMPLS == river_config.EXIT_LAYER_IMPLS  # the CLI's torch-free copy
    parser = argparse.ArgumentParser()
    cli_args.add_river_arguments(parser)
    assert cli_args.river_overrides(parser.parse_args(["--exit-layer-impl", "auto"])) == {"exit_layer_impl": "auto"}
    assert "exit_layer_impl" in river_config.RIVER_SETTINGS
    assert RiverConfig().exit_layer_impl == "architecture"
    assert RiverConfig.from_dict(RiverConfig(exit_layer_impl="auto").to_dict()).exit_layer_impl == "auto"
    with pytest.raises(RiverError, match="exit_layer_impl must be one of architecture, fused, auto"):
        RiverConfig(exit_layer_impl="fast")
    model = enable_river(tiny("qwen2"), tau=2.0, exit_layer_impl="auto", backend="torch-int4", progress=False)
    assert model.river_config.exit_layer_impl == "auto" and len(fused_layers(model)) == 4
    model.save_pretrained(tmp_path / "saved")
    again = RiverForCausalLM.from_pretrained(str(tmp_path / "saved"), progress=False)
    assert again.river_config.exit_layer_impl == "auto" and len(fused_layers(again)) == 4
    plain = RiverForCausalLM.from_pretrained(str(tmp_path / "saved"), exit_layer_impl="architecture", progress=False)
    assert fused_layers(plain) == []


def test_output_hidden_states_runs_the_architecture_copies_and_records_every_layer():
    outs = []
    for impl in ("architecture", "fused"):
        model = river(tiny("llama"), impl)
        with torch.no_grad(), model.river_mode("exit"):
            outs.append(model(**batch_inputs(), output_hidden_states=True).hidden_states)
    assert len(outs[0]) == len(outs[1]) == 5
    assert all(relative(b, a) <= 1e-4 for a, b in zip(*outs))


def test_names_bytes_and_attributes_are_the_architecture_copys():
    fused, arch = river(tiny("qwen2"), "fused"), river(tiny("qwen2"), "architecture")
    assert sorted({n for n, _ in exit_modules(fused)}) == sorted({n for n, _ in exit_modules(arch)})
    assert fused._river_step_bytes == arch._river_step_bytes
    layer = fused.model.layers[1].exit_layer
    assert linear_weight_bytes(layer) == linear_weight_bytes(arch.model.layers[1].exit_layer)
    assert layer.self_attn.layer_idx == 1 and layer.get_submodule("mlp.down_proj") is layer.architecture.mlp.down_proj
    assert [r["name"] for r in fused.river_kernel_report] == [r["name"] for r in arch.river_kernel_report]


def test_a_rebuilt_exit_layer_is_fused_again():
    model = river(tiny("llama"), "fused", tau=2.0)
    with torch.no_grad():
        model.model.layers[1].backbone.mlp.up_proj.weight.mul_(1.1)
    assert model.river_refresh_exit_layers() == ["layers.1"]
    assert isinstance(model.model.layers[1].exit_layer, FusedLlamaLayer)


# -- one trained model -------------------------------------------------------------------------------


def test_fully_quantized_smollm2_generates_the_same_greedy_tokens(smollm2_path):
    """SmolLM2-135M, every layer on its exit copy (river_mode("exit")): fused against architecture
    exit layers on the same int4 kernels. They differ only by float rounding order, so the greedy
    tokens agree (the first 8 at least; the count over 24 is printed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok("The three primary colors are", return_tensors="pt").input_ids
    outs = {}
    for impl in ("architecture", "fused"):
        config = RiverConfig(tau=2.0, backend="torch-int4", exit_head="torch-int8", fuse_projections=True,
                             exit_layer_impl=impl)
        model = RiverForCausalLM.from_pretrained(smollm2_path, river_config=config, dtype=torch.float32,
                                                 progress=False)
        if impl == "fused":
            layers = fused_layers(model)
            assert len(layers) == 30 and max(e.check_error for e in layers) <= fused_layer.CHECK_TOLERANCE
        with model.river_mode("exit"):
            outs[impl] = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    same = int((outs["architecture"] == outs["fused"]).sum())
    print(f"fully quantized SmolLM2-135M: {same}/24 greedy tokens equal (fused vs architecture exit layers)")
    assert torch.equal(outs["architecture"][:8], outs["fused"][:8])
