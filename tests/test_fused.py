"""Fused projections in exit layers (issue 22): q/k/v as one product, gate/up as one.

On tiny random configs of every family the architecture tests cover: τ > 1 stays token-identical;
fused exit layers compute what unfused ones compute (near-exactly with the ``copy`` kernel, up to
the kernel's rounding with int4/int8); the fully quantized model runs; the stacked shapes get
their own recorded kernel choice; an exit copy is rebuilt fused after a backbone q/k/v or gate/up
weight changes; the setting round-trips. :class:`FusedProjection`'s kept outputs are checked
against separate Linears for every call order, other inputs, in-place changes, grad modes,
threads and copies.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from river_hf import RiverError, RiverForCausalLM, enable_river
from river_hf.quant.fused import FusedProjection, ProjectionSlice, fuse_projections, fused_groups
from river_hf.river import RiverConfig

from test_river_core import FAMILIES, GEN, batch_inputs, tiny_model

NEGATIVE_TAU = "ignore:tau=-2 is negative"


def river(family: str, fuse: bool, backend: str = "torch-int4", tau: float = -2.0, min_layer: int = 1):
    config = RiverConfig(tau=tau, min_layer=min_layer, backend=backend, exit_head=None, fuse_projections=fuse)
    return enable_river(tiny_model(family), config=config, progress=False)


def exit_logits(model, inputs) -> torch.Tensor:
    with torch.no_grad(), model.river_mode("exit"):
        return model(**inputs).logits


# -- FusedProjection on its own ------------------------------------------------------------------


def three_linears(bias=(True, True, True)):
    torch.manual_seed(0)
    holder = nn.Module()
    for name, out, b in zip(("q_proj", "k_proj", "v_proj"), (16, 8, 8), bias):
        holder.add_module(name, nn.Linear(12, out, bias=b))
    return holder


@pytest.mark.parametrize("bias", [(True, True, True), (False, False, False), (True, False, True)],
                         ids=["biases", "no-bias", "mixed"])
def test_fused_slices_equal_the_separate_linears_in_any_order(bias):
    ref = three_linears(bias)
    fused = copy.deepcopy(ref)
    assert fuse_projections(fused) == ["river_fused_qkv"]
    assert all(isinstance(getattr(fused, n), ProjectionSlice) for n in ("q_proj", "k_proj", "v_proj"))
    x = torch.randn(2, 3, 12)
    with torch.no_grad():
        want = {n: getattr(ref, n)(x) for n in ("q_proj", "k_proj", "v_proj")}
        for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj"), ("k_proj", "k_proj", "q_proj")):
            for n in order:
                torch.testing.assert_close(getattr(fused, n)(x), want[n], rtol=1e-6, atol=1e-6)


def test_kept_outputs_are_used_only_for_the_same_unchanged_tensor():
    ref = three_linears()
    fused = copy.deepcopy(ref)
    fuse_projections(fused)
    calls = []
    fused.river_fused_qkv.linear.register_forward_hook(lambda m, a, o: calls.append(a[0]))
    x, y = torch.randn(1, 1, 12), torch.randn(1, 1, 12)
    with torch.no_grad():
        fused.q_proj(x), fused.k_proj(x), fused.v_proj(x)
        assert len(calls) == 1  # one product for the three slices of one input
        # another tensor (cross-attention-like): its own product, the right values
        torch.testing.assert_close(fused.q_proj(x), ref.q_proj(x))
        torch.testing.assert_close(fused.k_proj(y), ref.k_proj(y))
        torch.testing.assert_close(fused.v_proj(x), ref.v_proj(x))
        assert len(calls) == 4
        # the same tensor changed in place between two slices: recomputed
        z = torch.randn(1, 1, 12)
        fused.q_proj(z)
        z.mul_(2.0)
        torch.testing.assert_close(fused.k_proj(z), ref.k_proj(z))
        assert len(calls) == 6
    # a product kept without grad is not handed to a call with grad
    x = torch.randn(1, 1, 12)
    with torch.no_grad():
        fused.q_proj(x)
    k = fused.k_proj(x)
    assert k.requires_grad


def test_kept_outputs_do_not_cross_threads_or_copies():
    ref = three_linears()
    fused = copy.deepcopy(ref)
    fuse_projections(fused)
    x = torch.randn(1, 1, 12)
    with torch.no_grad():
        fused.q_proj(x)  # keeps k and v of x in this thread
        seen = []

        def other():
            with torch.no_grad():
                seen.append(fused.river_fused_qkv._kept.__dict__.get("entry"))
                seen.append(fused.k_proj(x))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen[0] is None  # the other thread starts with nothing kept
        torch.testing.assert_close(seen[1], ref.k_proj(x))
        clone = copy.deepcopy(fused)  # deepcopy works (threading.local is not copied) and keeps the sharing
        assert clone.q_proj.fused is clone.river_fused_qkv and clone.q_proj.fused is not fused.river_fused_qkv
        torch.testing.assert_close(clone.v_proj(x), ref.v_proj(x))
        torch.testing.assert_close(fused.v_proj(x), ref.v_proj(x))


def test_dense_slices_show_their_rows_and_quantized_ones_have_no_weight():
    ref = three_linears()
    fused = copy.deepcopy(ref)
    fuse_projections(fused)
    assert torch.equal(fused.k_proj.weight, ref.k_proj.weight) and torch.equal(fused.v_proj.bias, ref.v_proj.bias)
    from river_hf.quant import KERNELS

    fused.river_fused_qkv.linear = KERNELS["torch-int8"].build(fused.river_fused_qkv.linear)
    with pytest.raises(AttributeError):
        fused.q_proj.weight


def test_groups_need_one_input_width():
    holder = nn.Module()
    holder.gate_proj, holder.up_proj = nn.Linear(8, 16), nn.Linear(12, 16)
    assert fused_groups(holder) == []
    holder.up_proj = nn.Linear(8, 16)
    assert fused_groups(holder) == [("", ("gate_proj", "up_proj"))]


# -- in River models, every family --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tau_above_one_is_token_identical_with_fused_exit_layers(family):
    inputs = batch_inputs()
    ref = tiny_model(family).generate(**inputs, **GEN)
    model = river(family, fuse=True, tau=2.0)
    assert torch.equal(model.generate(**inputs, **GEN), ref)


@pytest.mark.filterwarnings(NEGATIVE_TAU)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_exit_layers_compute_what_unfused_ones_do(family):
    inputs = batch_inputs()
    fused, plain = river(family, True), river(family, False)
    exit_attn = fused.model.layers[0].exit_layer.self_attn
    assert isinstance(exit_attn.q_proj, ProjectionSlice) and isinstance(fused.model.layers[0].exit_layer.mlp.up_proj,
                                                                        ProjectionSlice)
    assert not isinstance(plain.model.layers[0].exit_layer.self_attn.q_proj, ProjectionSlice)
    a, b = exit_logits(fused, inputs), exit_logits(plain, inputs)
    # one quantization grid per output row either way: only the products' accumulation differs
    assert float((a - b).norm() / b.norm()) < 2e-2
    # the unquantized copy: near-exact, and exiting at every step reproduces the unmodified tokens
    ref = tiny_model(family).generate(**inputs, **GEN)
    copies = river(family, True, backend="copy")
    torch.testing.assert_close(exit_logits(copies, inputs), exit_logits(river(family, False, backend="copy"), inputs),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(copies.generate(**inputs, **GEN), ref)


@pytest.mark.filterwarnings(NEGATIVE_TAU)
def test_fully_quantized_fused_model_runs_and_records_the_stacked_shapes():
    model = river("qwen2", True, backend="int4")
    out = model.generate(**batch_inputs(), **GEN)
    assert out.shape[1] == batch_inputs()["input_ids"].shape[1] + GEN["max_new_tokens"]
    with model.river_mode("exit"):
        model.generate(**batch_inputs(), **GEN)
    assert model.river_stats["exit_fraction"] == 1.0
    # qwen2's q/k/v have biases: 128 + 64 + 64 rows; gate/up 256 + 256
    assert {"int4:128x256+bias", "int4:128x512"} <= set(model.river_config.kernel_choice)
    assert not any(k.startswith("int4:128x64") for k in model.river_config.kernel_choice)
    names = [r["name"] for r in model.river_kernel_report]
    assert "layers.0.self_attn.river_fused_qkv.linear" in names and "layers.0.mlp.river_fused_gate_up.linear" in names
    assert len([n for n in names if n.startswith("layers.0.")]) == 4  # 4 products per layer instead of 7
    # the weight bytes of a step count the stacked products once
    unfused = river("qwen2", False, backend="int4")
    assert model.river_step_bytes(0) == pytest.approx(unfused.river_step_bytes(0), rel=0.01)


@pytest.mark.filterwarnings(NEGATIVE_TAU)
@pytest.mark.parametrize("proj", ["self_attn.k_proj", "mlp.gate_proj"])
def test_backbone_weight_change_rebuilds_the_fused_copy(proj):
    model = river("llama", True, backend="copy")
    layer = model.model.layers[2]
    with torch.no_grad():
        layer.backbone.get_submodule(proj).weight.add_(0.5)
    assert model.river_refresh_exit_layers() == ["layers.2"]
    parent, name = proj.split(".")
    fused_slice = layer.exit_layer.get_submodule(parent).get_submodule(name)
    assert isinstance(fused_slice, ProjectionSlice)
    assert torch.equal(fused_slice.weight, layer.backbone.get_submodule(proj).weight)
    # and the rebuilt layer still computes what its backbone computes
    ref = tiny_model("llama")
    with torch.no_grad():
        ref.model.layers[2].get_submodule(proj).weight.add_(0.5)
    inputs = batch_inputs()
    assert torch.equal(model.generate(**inputs, **GEN), ref.generate(**inputs, **GEN))


def test_setting_is_checked_and_round_trips(tmp_path):
    assert RiverConfig.from_dict(RiverConfig(fuse_projections=True).to_dict()).fuse_projections is True
    assert RiverConfig().fuse_projections is False
    with pytest.raises(RiverError, match="fuse_projections"):
        RiverConfig(fuse_projections="yes")
    folder = tmp_path / "plain"
    tiny_model("llama").save_pretrained(folder)
    model = RiverForCausalLM.from_pretrained(str(folder), river_config=RiverConfig(tau=2.0, fuse_projections=True),
                                             progress=False)
    model.save_pretrained(tmp_path / "river")
    again = RiverForCausalLM.from_pretrained(str(tmp_path / "river"), progress=False)
    assert again.river_config.fuse_projections is True
    assert isinstance(again.model.layers[0].exit_layer.self_attn.q_proj, ProjectionSlice)


def test_fused_projection_forward_returns_every_part():
    fused = FusedProjection(nn.Linear(4, 6), (2, 4))
    parts = fused(torch.randn(3, 4))
    assert [p.shape for p in parts] == [torch.Size([3, 2]), torch.Size([3, 4])]
