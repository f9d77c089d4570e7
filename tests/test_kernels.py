"""SmallBatchLinear: the rerouted fp32 CPU products equal F.linear's, only 2..max_rows-row fp32
calls are rerouted, and a whole model's forward under the mode gives the stock logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from river_hf.quant.dense import SmallBatchLinear


@pytest.mark.parametrize("shape", [(2, 48), (1, 3, 48), (2, 4, 48), (64, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_rerouted_product_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    lin = torch.nn.Linear(48, 80, bias=bias)
    ref = F.linear(x, lin.weight, lin.bias)
    mode = SmallBatchLinear()
    with torch.no_grad(), mode:
        out = lin(x)
    assert mode.calls_rerouted == 1
    assert out.shape == ref.shape and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.view(-1)  # downstream .view() (attention head split) needs a contiguous result


@pytest.mark.parametrize(
    "x, weight",
    [
        (torch.randn(1, 1, 16), torch.randn(8, 16)),  # one row: already a GEMV
        (torch.randn(65, 16), torch.randn(8, 16)),  # more rows than max_rows
        (torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)),
        (torch.randn(4, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)),
    ],
    ids=["one_row", "too_many_rows", "bf16", "fp64"],
)
def test_other_calls_pass_through_unchanged(x, weight):
    ref = F.linear(x, weight)
    mode = SmallBatchLinear(max_rows=64)
    with mode:
        out = F.linear(x, weight)
    assert mode.calls_rerouted == 0
    assert torch.equal(out, ref)


def test_quantized_weights_keep_their_kernel():
    from optimum.quanto import freeze, qint8, quantize

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32))
    x = torch.randn(4, 64)
    quantize(net, weights=qint8)
    freeze(net)
    with torch.no_grad():
        ref = net(x)
        mode = SmallBatchLinear()
        with mode:
            out = net(x)
    assert mode.calls_rerouted == 0
    assert torch.equal(out, ref)


def test_whole_model_catch_up_forward_matches_stock():
    """A 5-token forward on top of a cached prefix, as R-Stitch's catch-up does: same logits and
    the same KV cache as without the mode (fp32 summation order aside)."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 12))
    outs = []
    for use_mode in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :7], cache=cache, use_cache=True)
            mode = SmallBatchLinear()
            if use_mode:
                with mode:
                    logits = model(input_ids=ids[:, 7:], cache=cache, use_cache=True).logits
                assert mode.calls_rerouted == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + lm_head
            else:
                logits = model(input_ids=ids[:, 7:], cache=cache, use_cache=True).logits
        outs.append((logits, cache.layers[1].keys.clone()))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_rows", [1, 2.5, True])
def test_max_rows_must_be_an_int_of_at_least_two(max_rows):
    with pytest.raises(ValueError, match="max_rows"):
        SmallBatchLinear(max_rows=max_rows)


def test_out_argument_and_cpu_autocast_pass_through():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    out = torch.empty(4, 8)
    with SmallBatchLinear() as mode:
        result = F.linear(x, w, None, out=out)
    assert result is out and mode.calls_rerouted == 0
    torch.testing.assert_close(out, F.linear(x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.linear(x, w)
        with SmallBatchLinear() as mode:
            got = F.linear(x, w)
    assert mode.calls_rerouted == 0 and got.dtype == torch.bfloat16 and torch.equal(got, ref)


def test_mixed_dtype_bias_is_left_to_f_linear_and_grad_flows():
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    mode = SmallBatchLinear()
    with pytest.raises(RuntimeError), mode:  # F.linear refuses a bf16 bias with fp32 weights; so must the mode
        F.linear(x, w, torch.randn(5, dtype=torch.bfloat16))
    assert mode.calls_rerouted == 0
    w1 = torch.randn(1, 4, requires_grad=True)  # one output feature: the transposed product is already contiguous
    ref_grad = torch.autograd.grad(F.linear(x, w1).pow(2).sum(), w1)[0]
    with SmallBatchLinear() as mode:
        grad = torch.autograd.grad(F.linear(x, w1).pow(2).sum(), w1)[0]
    assert mode.calls_rerouted == 1
    torch.testing.assert_close(grad, ref_grad)


def test_small_batch_linear_measure_times_both_orientations():
    from river_hf.quant.dense import SmallBatchLinear

    timing = SmallBatchLinear.measure(64, 96, 8, stream_bytes=1 << 20, rounds=2)
    assert set(timing) == {"torch", "small-batch"} and all(v > 0 for v in timing.values())


def test_weight_fingerprint_samples_inside_any_weight():
    """The sampled positions must lie inside the weight for every size; a float32 linspace put the
    last one past the end of Qwen2.5-0.5B's 151936x896 LM head (136,134,656 elements)."""
    from river_hf.quant.dense import WeightFingerprint

    for n in (1, 2, 255, 256, 257, 16_777_219, 136_134_656):
        w = torch.zeros(n, dtype=torch.uint8)
        fp = WeightFingerprint(w)
        assert int(fp.index[-1]) == n - 1 and int(fp.index[0]) == 0 and fp.matches(w)
        assert fp.index.numel() == min(n, 256) and bool((fp.index[1:] > fp.index[:-1]).all())
    w = torch.zeros(1000)
    fp = WeightFingerprint(w)
    w.data[999] = 1.0  # through .data: the version counter does not see it, the sample does
    assert not fp.matches(w)


def test_prepacked_min_rows_one_reroutes_one_row_calls_and_bad_values_are_refused():
    """PrepackedLinear(min_rows=1) also takes one-row products (the plain model's decode steps) onto the
    packed oneDNN copy, equal to F.linear up to summation order; the default keeps them on F.linear."""
    from river_hf.quant.dense import PrepackedLinear, onednn_available

    if not onednn_available():
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80)
    x = torch.randn(1, 1, 48)
    ref = F.linear(x, lin.weight, lin.bias)
    for min_rows, rerouted in ((1, 1), (2, 0)):
        mode = PrepackedLinear([lin], max_rows=8, min_rows=min_rows)
        with torch.no_grad(), mode:
            out = lin(x)
        assert mode.calls_rerouted == rerouted and out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for bad in (0, 3, True, 1.0):
        with pytest.raises(ValueError, match="min_rows"):
            PrepackedLinear([lin], min_rows=bad)


def test_prepacked_with_rows_shares_the_packed_copies_and_changes_only_the_row_bounds():
    """with_rows: a second mode over the same packed tensors (no memory added) that reroutes the
    row counts it is given; the original keeps its own bounds; bad bounds are refused."""
    from river_hf.quant.dense import PrepackedLinear, onednn_available

    if not onednn_available():
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 80)
    verify = PrepackedLinear([lin], max_rows=4)  # min_rows 2: one-row calls stay on F.linear
    wide = verify.with_rows(min_rows=1, max_rows=64)
    assert (wide.min_rows, wide.max_rows, verify.min_rows, verify.max_rows) == (1, 64, 2, 4)
    assert wide.packed_bytes == verify.packed_bytes > 0
    assert all(wide._packed[k].packed is verify._packed[k].packed for k in verify._packed)  # the same tensors
    for rows in (1, 3, 20):
        x = torch.randn(rows, 48)
        ref = F.linear(x, lin.weight, lin.bias)
        for mode in (verify, wide):
            before = mode.calls_rerouted
            with torch.no_grad(), mode:
                out = lin(x)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            expected = mode.min_rows <= rows <= mode.max_rows
            assert mode.calls_rerouted - before == int(expected)
    with pytest.raises(ValueError, match="min_rows"):
        verify.with_rows(min_rows=0)
    with pytest.raises(ValueError, match="max_rows"):
        verify.with_rows(max_rows=1)
