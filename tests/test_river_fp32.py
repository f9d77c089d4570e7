"""river-fp32 (``quant/dense_river.py``): river-hf's own product of a few fp32 rows with a dense
weight, its mode, and its place in the verify / backbone kernel choice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_backbone_kernel import _generate
from test_batch_exit import MIXED_TAU, river
from test_lossless import GEN, prompt, river_copy
from test_river_core import tiny_model

from river_hf import RiverConfig
from river_hf.quant import river_int4
from river_hf.quant.dense import PrepackedLinear, linear_mode_hooks, onednn_available
from river_hf.quant.dense_river import RiverFp32Linear, river_fp32_works
from river_hf.river import verify_kernel

pytestmark = pytest.mark.skipif(not river_fp32_works(), reason="river-int4's extension cannot run here")


@pytest.mark.parametrize("k,n", [(64, 96), (37, 13), (896, 20)])  # K and N not multiples of 8 / 4 too
def test_dense_mm_is_f_linear_up_to_summation_order_and_each_row_is_its_own(k, n):
    ext = river_int4.extension()
    gen = torch.Generator().manual_seed(k * n)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16):
        x = torch.randn(2, rows, k, generator=gen)[0]
        for b in (None, bias):
            got = ext.dense_mm(x, weight, b)
            ref = F.linear(x, weight, b)
            assert got.shape == ref.shape and got.dtype == torch.float32
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
            # a row's numbers do not depend on the call's other rows (batch-invariant by construction)
            for r in range(rows):
                assert torch.equal(ext.dense_mm(x[r:r + 1], weight, b)[0], got[r])
    with pytest.raises(RuntimeError, match="float32"):
        ext.dense_mm(torch.randn(1, k, dtype=torch.bfloat16), weight, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.dense_mm(torch.randn(1, n), weight.t(), None)


def test_the_mode_reroutes_only_its_linears_in_its_rows_and_passes_the_rest_on():
    torch.manual_seed(0)
    mine, other = torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)

    class Fallback:  # takes what the mode does not, like a PrepackedLinear for prompt rows
        calls = 0
        packed_bytes = 123

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Fallback.calls += func is F.linear
            return func(*args, **(kwargs or {}))

    mode = RiverFp32Linear([mine], min_rows=1, max_rows=4, fallback=Fallback())
    assert mode.packed_bytes == 123 and len(mode) == 1
    xs = [torch.randn(rows, 32) for rows in (1, 4)]
    with torch.no_grad():
        refs = [F.linear(x, mine.weight, mine.bias) for x in xs]
        with mode:
            outs = [mine(x) for x in xs]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(outs, refs))
    assert mode.calls_rerouted == 2 and Fallback.calls == 0
    with torch.no_grad(), mode:
        mine(torch.randn(5, 32))  # more rows than max_rows: the fallback's
        other(torch.randn(1, 32))  # a weight the mode was not given: the fallback's
    assert mode.calls_rerouted == 2 and Fallback.calls == 2
    mine.weight = torch.nn.Parameter(torch.randn(16, 32))  # replaced: used after the next refresh
    with torch.no_grad(), mode:
        mine(torch.randn(1, 32))
    assert mode.calls_rerouted == 2 and Fallback.calls == 3
    mode.refresh()
    x = torch.randn(1, 32)
    with torch.no_grad():
        ref = F.linear(x, mine.weight, mine.bias)
        with mode:
            out = mine(x)
    assert torch.allclose(out, ref, atol=1e-5) and mode.calls_rerouted == 3
    view = mode.with_rows(min_rows=2)
    assert (view.min_rows, view.max_rows, view.fallback) == (2, 4, mode.fallback) and view.calls_rerouted == 0
    with pytest.raises(ValueError, match="max_rows"):
        RiverFp32Linear([mine], min_rows=2, max_rows=1)


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch")
def test_auto_takes_river_fp32_where_it_measured_fastest(monkeypatch, tmp_path):
    """One run times F.linear, oneDNN and river-fp32 together; river-fp32 takes the rows it won
    (verify rows up to 16, one row), the packed oneDNN copy (where oneDNN beat F.linear) the rest;
    lossless stays the plain model's tokens, route mode's backbone uses the same mode."""
    winners = {}

    def measure(i, o, rows, **kw):
        return dict(winners.get(rows, {"torch": 3.0, "onednn": 2.0, "river-fp32": 1.0}))

    monkeypatch.setattr(RiverFp32Linear, "measure", staticmethod(measure))
    monkeypatch.setattr(PrepackedLinear, "measure", staticmethod(lambda i, o, rows, **kw: {"torch": 2.0, "onednn": 1.0}))
    monkeypatch.delenv("RIVER_HF_AUTOTUNE", raising=False)
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path))
    base = tiny_model("qwen2")
    model = river_copy(base, config=RiverConfig(lossless=True))
    ids = prompt(10)
    assert torch.equal(model.generate(ids, max_new_tokens=10, **GEN), base.generate(ids, max_new_tokens=10, **GEN))
    info = model.river_stats["lossless"]["verify_kernel"]
    assert info["kernel"] == "river-fp32" and info["one_row"] == "river-fp32" and info["prompt"] == "onednn-prepacked"
    assert info["packed_bytes"] > 0 and "river-fp32 measured fastest at 16 rows and one row" in info["why"]
    mode = model._river_verify_linear[0]
    assert isinstance(mode, RiverFp32Linear) and (mode.min_rows, mode.max_rows) == (1, 16)
    assert isinstance(mode.fallback, PrepackedLinear) and mode.calls_rerouted > 0
    assert [verify_kernel.kernel_at(mode, r) for r in (1, 16, 17, 128)] == ["river-fp32"] * 2 + ["onednn"] * 2

    # F.linear fastest at the verify rows, river-fp32 at one row: nothing packed, river-fp32 for one row only
    winners = {16: {"torch": 1.0, "onednn": 2.0, "river-fp32": 1.5}}
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "other"))
    model = river_copy(base, config=RiverConfig(lossless=True))
    assert torch.equal(model.generate(ids, max_new_tokens=10, **GEN), base.generate(ids, max_new_tokens=10, **GEN))
    info = model.river_stats["lossless"]["verify_kernel"]
    assert info["kernel"] == "torch" and info["one_row"] == "river-fp32" and info["packed_bytes"] == 0
    mode = model._river_verify_linear[0]
    assert (mode.min_rows, mode.max_rows, mode.fallback) == (1, 1, None)

    # route mode: the backbone layers take the one-row kernel; τ > 1 keeps the plain kernels
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "route"))
    winners = {}
    routed = river("llama", tau=MIXED_TAU["llama"])
    reference = _generate(river("llama", tau=MIXED_TAU["llama"], backbone_kernel="torch"))
    out = _generate(routed)
    info = routed.river_stats["backbone_kernel"]
    assert info["kernel"] == "river-fp32" and info["packed_bytes"] > 0 and info["max_rows"] >= 8
    for a, b in zip(out.scores, reference.scores):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    mode, info = verify_kernel.backbone_mode(river("llama", tau=2.0), "auto")
    assert mode is None and "τ > 1" in info["why"]


def test_river_fp32_by_name_is_unmeasured_and_takes_up_to_sixteen_rows():
    base = tiny_model("qwen2")
    model = river_copy(base, config=RiverConfig(lossless=True, verify_kernel="river-fp32"))
    ids = prompt(10)
    assert torch.equal(model.generate(ids, max_new_tokens=10, **GEN), base.generate(ids, max_new_tokens=10, **GEN))
    info = model.river_stats["lossless"]["verify_kernel"]
    assert info["kernel"] == "river-fp32" and info["why"] == "verify_kernel='river-fp32'" and info["timing_us"] is None
    mode = model._river_verify_linear[0]
    assert (mode.min_rows, mode.max_rows) == (1, 16) and mode.calls_rerouted > 0
    routed = river("llama", tau=MIXED_TAU["llama"], backbone_kernel="river-fp32")
    _generate(routed)
    assert routed.river_stats["backbone_kernel"]["kernel"] == "river-fp32"


def test_kernel_modes_are_entered_around_the_backbone_linears_only(monkeypatch):
    """River enters its backbone and verify kernel modes around each backbone Linear
    (``verify_kernel.backbone_hooks``): the mode sees F.linear calls only, never the layers'
    other ops, and no mode is left entered after a call, a failed forward included."""
    seen = []
    original = RiverFp32Linear.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(RiverFp32Linear, "__torch_function__", spy)
    routed = river("llama", tau=MIXED_TAU["llama"], backbone_kernel="river-fp32")
    _generate(routed)
    assert routed.river_stats["backbone_kernel"]["kernel"] == "river-fp32" and F.linear in seen
    base = tiny_model("qwen2")
    model = river_copy(base, config=RiverConfig(lossless=True, verify_kernel="river-fp32"))
    ids = prompt(10)
    assert torch.equal(model.generate(ids, max_new_tokens=10, **GEN), base.generate(ids, max_new_tokens=10, **GEN))
    assert model._river_verify_linear[0].calls_rerouted > 0
    assert set(seen) == {F.linear}

    seen.clear()
    linear = torch.nn.Linear(8, 4)
    handles = linear_mode_hooks([linear], lambda: RiverFp32Linear([linear]))
    with pytest.raises(RuntimeError):
        linear(torch.randn(2, 5))  # wrong width: F.linear raises inside the mode
    torch.ones(2).add(1)
    assert seen == [F.linear]  # the mode was exited after the failure: the add passed it by
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.allclose(linear(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-6)
    assert seen == [F.linear, F.linear]
    for handle in handles:
        handle.remove()
    linear(x)
    assert seen == [F.linear, F.linear]  # hooks removed: no mode
