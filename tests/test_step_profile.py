"""benchmarks/step_profile.py's attribution (river_hf.bench_harness.step_profile) on a tiny River
model: every module gets a category, the categories of a pass add up to the pass's wall time, River's routing and the exit layers'
products are seen where they run, and the hooks are gone afterwards (no speed is asserted)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from river_hf import enable_river
from river_hf.bench_harness import step_profile as sp
from river_hf.river import RiverConfig

from test_river_core import batch_inputs, tiny_model


@pytest.mark.filterwarnings("ignore:tau=-2 is negative")
def test_profiler_partitions_each_pass_and_cleans_up():
    model = enable_river(tiny_model("qwen2"), config=RiverConfig(tau=-2.0, min_layer=1, backend="torch-int4",
                                                                     fuse_projections=True),
                         progress=False)
    cats = sp.categories(model)
    exit_attn = model.model.layers[1].exit_layer.self_attn
    assert cats[id(model.model.layers[1])] == "routing"
    assert cats[id(exit_attn)] == "attention"
    assert cats[id(exit_attn.river_fused_qkv)] == "exit products"
    assert cats[id(model.model.layers[0].backbone.self_attn.q_proj)] == "backbone products"
    assert cats[id(model.lm_head)] == "head"
    inputs = {k: v[:1] for k, v in batch_inputs().items()}
    with torch.no_grad(), sp.StepProfiler(model) as prof:
        model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert len(prof.passes) == 4 and [p["tokens"] for p in prof.passes] == [12, 1, 1, 1]
    for p in prof.passes:
        assert sum(p["seconds"].values()) == pytest.approx(p["end"] - p["start"], rel=0.02)
        assert p["seconds"]["routing"] > 0 and p["seconds"]["exit products"] > 0
    assert all(p["gap"] > 0 for p in prof.passes[1:])
    rows = sp.step_rows(prof.passes, "river")
    assert set(rows["river"]["ms"]) == set(sp.CATEGORIES) and rows["river"]["passes"] == 3
    # hooks removed, router methods back to the class's
    assert not nn.modules.module._global_forward_hooks and "begin" not in vars(model.river)


@pytest.mark.parametrize("kernel", ["ark-int4", "ort-int4", "torch-dyn-int8"])
def test_other_libraries_kernels_count_as_exit_products(kernel):
    from river_hf.quant import KERNELS

    if not KERNELS[kernel].available("cpu"):
        pytest.skip(f"{kernel} is not available here")
    model = enable_river(tiny_model("llama"), config=RiverConfig(tau=0.5, min_layer=1, backend=kernel, exit_head=kernel),
                         progress=False)
    cats = sp.categories(model)
    exit_mlp = model.model.layers[1].exit_layer.mlp
    assert type(exit_mlp.down_proj).__name__ in ("ArkWoqLinear", "OrtMatMulNBitsLinear", "DynamicInt8Linear")
    assert cats[id(exit_mlp.down_proj)] == "exit products"


def test_river_exit_mode_steps_report_to_the_profiler():
    """River's exit-mode step (river.exit_step.ExitStep) calls no forward of the model: it reports its steps
    to the profiler, which sees each one's exit stack, routing and head, and lets it go afterwards."""
    from river_hf.quant import river_int4
    from river_hf.river.exit_step import ExitStep

    from test_exit_step import _inputs, _river

    if not river_int4.works():
        pytest.skip(f"river-int4 is not available here: {river_int4.unavailable_reason()}")
    model = _river("qwen2")  # the fused exit layers' one-call stack (tiny_model's layers do not join in one)
    steps = []
    real = ExitStep.__call__
    inputs = _inputs(1)
    with torch.no_grad(), model.river_mode("exit"), pytest.MonkeyPatch.context() as m, sp.StepProfiler(model) as prof:
        m.setattr(ExitStep, "__call__", lambda self, *a: steps.append(1) or real(self, *a))
        model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert len(steps) == 3 and [p["tokens"] for p in prof.passes] == [9, 1, 1, 1]
    for p in prof.passes[1:]:
        assert sum(p["seconds"].values()) == pytest.approx(p["end"] - p["start"], rel=0.02)
        assert min(p["seconds"][c] for c in ("routing", "exit products", "head", "forward glue")) > 0
    assert ExitStep.observer is None and not nn.modules.module._global_forward_hooks
