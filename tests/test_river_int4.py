"""river-int4, river-hf's own 4-bit product (quant/river_int4.py, csrc/river_int4.cpp; AVX-512 VNNI or
AVX2): its packing and row blocking against torch-int4 on the same grid, its arithmetic against a float64
model of it, its availability switch, and the fused exit layer over it (two C++ calls around the cache
update). Tiny shapes and random models; nothing timed. Skipped (with the reason) on a CPU with neither
instruction set or without a compiler; the kernels shared with other libraries are covered by
tests/test_quant_kernels_extra.py too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from river_hf import RiverConfig
from river_hf.errors import RiverError
from river_hf.quant import KERNELS, get_backend, river_int4
from river_hf.quant.modules import Int4WeightOnlyLinear, int4_grid


@pytest.fixture(scope="module")
def kernel():
    if not river_int4.works():
        pytest.skip(f"river-int4 not available here: {river_int4.unavailable_reason()}")
    return KERNELS["river-int4"]


def grid_product(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``x`` times ``linear``'s weights on torch-int4's grid, in float64 (the reference)."""
    q, scale, zero, g = int4_grid(linear.weight.detach().float())
    n, k = q.shape
    w = ((q.double() - 8).reshape(n, k // g, g) * scale.double()[..., None] + zero.double()[..., None]).reshape(n, k)
    out = x.double() @ w.T
    return out + linear.bias.double() if linear.bias is not None else out


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("shape", [(256, 48), (96, 32), (4864 // 8, 112)])
def test_every_row_block_matches_the_grid_product(kernel, rows, shape):
    # rows go through the kernel in blocks of 4 (1-4, then a remainder); in_features 96 = groups of 32
    k, n = shape
    torch.manual_seed(rows)
    linear = nn.Linear(k, n)
    q = kernel.build(linear)
    x = torch.randn(rows, k)
    with torch.no_grad():
        y, ref = q(x), grid_product(linear, x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    # what int8 activations add to the grid's product: about 0.7 % on random data; a wrong nibble
    # order, block layout or correction term is off by 30 % or more
    assert float((y.double() - ref).norm() / ref.norm()) < 0.02
    # each row is what it is alone, bit for bit (no row leaks into another's block; the one-row
    # path, with its own AVX2 loop, computes the same integers and fp32 operations as the blocks of rows)
    for r in range(rows):
        assert torch.equal(q(x[r:r + 1])[0], y[r])


def kernel_model(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What csrc/river_int4.cpp computes, step by step, in float64 where it rounds nothing: fp16
    scales and zeros; per row and group of 128, ``xs = max|x| / 127`` and ``round(x * 127 / max|x|)``
    to int8 (fp32, ties to even), the group's fp32 sum; the integer dot product of the nibbles and the
    int8 row, centred by ``8 * sum(qx)``; then two fused multiply-adds per group into the fp32
    accumulator that starts at the bias."""
    q, scale, zero, g = int4_grid(linear.weight.detach().float())
    n, k = q.shape
    scale, zero = scale.half().float(), zero.half().float()
    out = torch.empty(x.shape[0], n)
    for m in range(x.shape[0]):
        acc = linear.bias.detach().float().clone() if linear.bias is not None else torch.zeros(n)
        for j in range(k // g):
            xg = x[m, j * g:(j + 1) * g].float()
            amax = xg.abs().max()
            xs = amax / 127.0
            qx = torch.round(xg * (127.0 / amax)).clamp(-127, 127).to(torch.int64)
            dot = (q[:, j * g:(j + 1) * g].to(torch.int64) * qx).sum(-1) - 8 * qx.sum()
            fma1 = (scale[:, j] * xs).double() * dot.double() + acc.double()
            acc = fma1.float()
            acc = (zero[:, j].double() * xg.sum().double() + acc.double()).float()
        out[m] = acc
    return out


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_its_arithmetic_is_the_documented_one(kernel, rows):
    # the integer dot products and their fp32 scaling, on either instruction set (AVX-512 VNNI's
    # vpdpbusd or AVX2's vpmaddubsw / vpmaddwd give the same integers): to within the last bits that
    # the group sum's summation order and the float64 model's double rounding may move; a wrong nibble,
    # lane or int16 overflow is off by 1e-3 or more
    torch.manual_seed(rows)
    linear = nn.Linear(384, 48)
    x = torch.randn(rows, 384) * 3
    with torch.no_grad():
        y, ref = kernel.build(linear)(x), kernel_model(linear, x)
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5


def test_it_quantizes_like_torch_int4(kernel):
    torch.manual_seed(0)
    linear = nn.Linear(512, 256, bias=False)
    ours, tinygemm = kernel.build(linear), Int4WeightOnlyLinear(linear)
    x = torch.randn(4, 512)
    a, b = ours(x), tinygemm(x)
    # same grid: the two differ by their activation rounding (int8 per group against bf16), not by the weights
    assert float((a - b).norm() / b.norm()) < 0.02
    # 4 bits a weight, plus an fp16 scale and zero per group of 128 (6 %), nothing per weight
    assert ours.weight_nbytes() <= 512 * 256 * 0.5 * 1.0625


def test_bf16_and_3d_inputs_keep_their_dtype_and_shape(kernel):
    linear = nn.Linear(128, 64).to(torch.bfloat16)
    q = kernel.build(linear)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    y = q(x)
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    assert torch.isfinite(y.float()).all()


def test_shapes_it_cannot_pack_are_refused(kernel):
    assert not kernel.supports(nn.Linear(128, 40))  # out_features not a multiple of 16
    assert not kernel.supports(nn.Linear(100, 32))  # in_features not a multiple of 32
    with pytest.raises(RiverError, match="divisible"):
        river_int4.RiverInt4Linear(nn.Linear(128, 40))


def test_the_switch_takes_it_out_of_the_measured_choice(kernel, monkeypatch):
    linear = nn.Linear(256, 128)
    assert "river-int4" in {k.name for k in get_backend("int4").usable(linear)}
    monkeypatch.setenv("RIVER_HF_NO_EXTENSIONS", "1")
    assert not river_int4.works() and river_int4.unavailable_reason() == "RIVER_HF_NO_EXTENSIONS=1"
    assert "river-int4" not in {k.name for k in get_backend("int4").usable(linear)}
    with pytest.raises(RiverError, match="river-int4 needs .*; here: RIVER_HF_NO_EXTENSIONS=1"):
        get_backend("river-int4").usable(linear)


def test_its_norm_silu_and_residual_arguments_are_the_separate_ops(kernel):
    """The norm and silu are River's own loops (the same functions, another float rounding order; an
    activation one rounding apart can land one int8 step apart, so up to ~1e-3 of the output); the
    residual add is torch's add, bit for bit."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    linear = nn.Linear(256, 64)
    q = kernel.build(linear)
    ext = river_int4.extension()

    def mm(x, norm=None, eps=0.0, silu_mul=False, residual=None):
        return ext.mm(x, q.packed, q.bias, q.group_size, norm, eps, silu_mul, residual)

    def close(a, b):
        return float((a - b).norm() / b.norm()) <= 1e-3

    x, w, residual = torch.randn(3, 256), torch.rand(256) + 0.5, torch.randn(3, 64)
    with torch.no_grad():
        assert close(mm(x, w, 1e-6), q(F.rms_norm(x, (256,), w, 1e-6)))
        gu = torch.randn(3, 512) * 4  # silu's tails too
        assert close(mm(gu, silu_mul=True), q(F.silu(gu[:, :256]) * gu[:, 256:]))
        assert torch.equal(mm(x, residual=residual), residual + q(x))
        both = residual + q(F.rms_norm(F.silu(gu[:, :256]) * gu[:, 256:], (256,), w, 1e-5))
        assert close(mm(gu, w, 1e-5, True, residual) - residual, both - residual)


@pytest.mark.parametrize("batch,tokens,table_rows", [(1, 1, 1), (2, 1, 2), (3, 5, 1), (2, 4, 2)])
def test_its_rotary_is_the_architectures_on_the_models_own_tables(kernel, batch, tokens, table_rows):
    """attention_in takes the model's ``cos`` / ``sin`` (``[batch or 1, tokens, head_dim]``, as its
    rotary module returns them) and gives transformers' ``apply_rotary_pos_emb`` of its own q/k
    product, bit for bit: ``q * cos + rotate_half(q) * sin`` (the first half's ``-x * sin`` as a
    subtraction, the same float); V is the product's slice, untouched."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv, d, hidden = 4, 2, 16, 64
    torch.manual_seed(1)
    q = kernel.build(nn.Linear(hidden, (heads + 2 * kv) * d))
    ext = river_int4.extension()
    x, w = torch.randn(batch * tokens, hidden), torch.rand(hidden) + 0.5
    angles = torch.rand(table_rows, tokens, d // 2) * 40
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    with torch.no_grad():
        query, keys, values = ext.attention_in(x, q.packed, q.bias, q.group_size, w, 1e-6, cos, sin, batch, tokens,
                                               heads, kv, d)
        y = ext.mm(x, q.packed, q.bias, q.group_size, w, 1e-6, False, None)
    qkv = y.view(batch, tokens, heads + 2 * kv, d).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(qkv[:, :heads], qkv[:, heads:heads + kv], cos, sin)
    assert torch.equal(query, want_q) and torch.equal(keys, want_k)
    assert torch.equal(values, qkv[:, heads + kv:])
    with pytest.raises(RuntimeError, match=r"cos / sin must be float \[batch or 1, tokens, head_dim\]"):
        ext.attention_in(x, q.packed, q.bias, q.group_size, w, 1e-6, cos.unsqueeze(1), sin.unsqueeze(1), batch,
                         tokens, heads, kv, d)


@pytest.mark.parametrize("heads,kv,d,length,batch,mask", [
    (14, 2, 64, 200, 1, None), (12, 2, 128, 37, 1, None), (4, 2, 32, 9, 2, "bool"), (4, 4, 16, 13, 3, "float"),
    (14, 2, 64, 5, 2, "bool"), (8, 1, 64, 300, 2, "float"), (2, 2, 8, 1, 1, None), (4, 2, 32, 9, 3, "bool1")])
def test_its_one_token_attention_is_sdpas_function(kernel, heads, kv, d, length, batch, mask):
    """One query token's grouped-query attention over a cache slot (the query a view of attention_in's
    q/k rows): float64 SDPA's result within fp32 rounding (no worse than fp32 SDPA), float masks added,
    bool masks kept where true, one mask row for the whole batch ("bool1")."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(heads * length + batch)
    query = torch.randn(batch, heads + kv, 1, d, generator=gen)[:, :heads]
    keys, values = torch.randn(batch, kv, length, d, generator=gen) * 3, torch.randn(batch, kv, length, d, generator=gen)
    m = None
    if mask is not None:
        keep = torch.rand(1 if mask == "bool1" else batch, 1, 1, length, generator=gen) > 0.3
        keep[..., -1] = True
        m = keep if mask.startswith("bool") else torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    ref = F.scaled_dot_product_attention(query.double(), keys.double(), values.double(),
                                         attn_mask=m if m is None or m.dtype == torch.bool else m.double(),
                                         scale=0.125, enable_gqa=True)
    fp32 = F.scaled_dot_product_attention(query, keys, values, attn_mask=m, scale=0.125, enable_gqa=True)
    got = river_int4.extension().attend_one_token(query, keys, values, m, 0.125)
    assert got.shape == (batch, heads * d) and got.dtype == torch.float32
    error = float((got.view(batch, heads, 1, d).double() - ref).norm() / ref.norm())
    assert error <= max(2 * float((fp32.double() - ref).norm() / ref.norm()), 1e-7)


def test_its_one_token_attention_refuses_other_shapes_with_one_error(kernel):
    attend = river_int4.extension().attend_one_token
    with pytest.raises(RuntimeError, match="query and keys must be 4-D"):
        attend(torch.randn(2, 1, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8), None, 0.3)
    with pytest.raises(RuntimeError, match="one-token attention needs"):
        attend(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8), None, 0.3)
    with pytest.raises(RuntimeError, match="one-token mask must be"):
        attend(torch.randn(1, 2, 1, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8), torch.zeros(1, 1, 1, 4), 0.3)


def test_its_one_token_attention_gives_a_row_that_attends_to_nothing_zeros(kernel):
    keep = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    keep[1, ..., 2] = True
    values = torch.randn(2, 1, 5, 8)
    out = river_int4.extension().attend_one_token(torch.randn(2, 2, 1, 8), torch.randn(2, 1, 5, 8), values, keep, 0.3)
    assert torch.equal(out[0], torch.zeros(16))
    assert torch.allclose(out[1], values[1, 0, 2].repeat(2))


@pytest.mark.parametrize("fuse_projections", [False, True])
def test_fused_exit_layers_over_it_pass_their_build_check_and_tau_above_one_is_exact(kernel, tiny_llama,
                                                                                      fuse_projections):
    from river_hf import enable_river
    from river_hf.river.fused_layer import FusedExitLayer
    from river_hf.river.layer import RiverLayer

    model = tiny_llama()
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    config = RiverConfig(tau=2.0, backend="river-int4", exit_head="river-int4", exit_layer_impl="fused",
                         fuse_projections=fuse_projections)
    river = enable_river(model, config=config)
    layers = [m for m in river.modules() if isinstance(m, RiverLayer)]
    assert all(isinstance(layer.exit_layer, FusedExitLayer) and layer.exit_layer.check_error <= 1e-3
               for layer in layers)
    # stacked q/k/v and gate/up on river-int4: the layer in two C++ calls around the cache update
    assert all(layer.exit_layer.int4_calls == fuse_projections for layer in layers)
    assert torch.equal(river.generate(ids, max_new_tokens=8, do_sample=False), plain)
    with river.river_mode("exit"):
        out = river.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == plain.shape
    groups = river.river_kernels()
    assert groups and {g["kernel"] for g in groups} == {"river-int4"}
    assert {g["where"] for g in groups} == {"exit layers", "exit head"}


def test_the_layer_with_int4_calls_computes_what_it_computes_without(kernel, tiny_llama):
    """The same fused layer in two C++ calls around the cache update, and as separate torch ops
    from Python: the same tokens, and logits within the build check's bound (the C++ calls' own norm,
    silu and one-token attention round in another order than torch's ops), exit mode, prompt and steps."""
    from river_hf import enable_river
    from river_hf.river.layer import RiverLayer

    config = RiverConfig(backend="river-int4", exit_head="river-int4", exit_layer_impl="fused", fuse_projections=True)
    river = enable_river(tiny_llama(), config=config)
    layers = [m.exit_layer for m in river.modules() if isinstance(m, RiverLayer)]
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(4))

    def logits(int4_calls: bool):
        for layer in layers:
            layer.int4_calls = int4_calls
        with river.river_mode("exit"), torch.no_grad():
            out = river.generate(ids, max_new_tokens=4, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True)
        return out.sequences, torch.stack(out.scores)

    (seq_a, a), (seq_b, b) = logits(True), logits(False)
    assert torch.equal(seq_a, seq_b) and float((a - b).norm() / b.norm()) <= 1e-3


def test_the_step_profile_splits_the_fused_layers_products_out_by_the_product_clock(kernel, tiny_llama):
    """With the two-call fused layer there is no product module to hook: the kernel's product clock
    adds up the products' time only while it is on, and the step profile books it as exit products
    (the categories still add up to each pass's wall time; nothing is timed against a bound)."""
    from river_hf import enable_river
    from river_hf.bench_harness import step_profile as sp

    clock = river_int4.product_clock()
    assert clock is not None  # loaded by the fixture's check
    x, packed = torch.randn(1, 256), river_int4.RiverInt4Linear(nn.Linear(256, 64)).packed
    before = clock.product_ns()
    kernel_ext = river_int4.extension()
    kernel_ext.mm(x, packed, None, 128, None, 0.0, False, None)
    assert clock.product_ns() == before  # off: nothing added
    config = RiverConfig(backend="river-int4", exit_head="river-int4", exit_layer_impl="fused", fuse_projections=True)
    river = enable_river(tiny_llama(), config=config)
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    with river.river_mode("exit"), torch.no_grad(), sp.StepProfiler(river) as prof:
        river.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    for p in prof.passes:
        assert sum(p["seconds"].values()) == pytest.approx(p["end"] - p["start"], rel=0.02)
        assert p["seconds"]["exit products"] > 0  # no product module ran: only the clock books these
    assert clock.product_ns() > before
    after = clock.product_ns()
    kernel_ext.mm(x, packed, None, 128, None, 0.0, False, None)
    assert clock.product_ns() == after  # off again after the profile


def test_on_a_padded_batch_the_fused_layer_gives_the_architectures_numbers(kernel, tiny_llama):
    """A left-padded batch brings a mask: transformers' sdpa attention then packs the query heads of
    each K/V head for one token and repeats K/V for more. The Python path hands SDPA the same inputs,
    so exit mode gives the architecture copy's logits bit for bit; the two-call path (its own one-token
    attention over the cache slot and the 4-D bool mask as they are, its own norm and silu) the same
    tokens and logits within the build check's bound (GQA: 4 query heads, 2 K/V heads)."""
    from river_hf import enable_river
    from river_hf.river.fused_layer import FusedExitLayer
    from river_hf.river.layer import RiverLayer

    config = RiverConfig(backend="river-int4", exit_head="river-int4", exit_layer_impl="fused", fuse_projections=True)
    river = enable_river(tiny_llama(), config=config)
    layers = [m.exit_layer for m in river.modules() if isinstance(m, RiverLayer)]
    ids = torch.randint(3, 256, (3, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4], ids[2, :2], mask[2, :2] = 0, 0, 0, 0  # left padding

    def logits(fused: bool, int4_calls: bool = True):
        for layer in layers:
            layer.int4_calls = int4_calls
        serves = FusedExitLayer.serves
        try:
            if not fused:
                FusedExitLayer.serves = lambda self: False  # every call runs the architecture copy
            with river.river_mode("exit"), torch.no_grad():
                out = river.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
        finally:
            FusedExitLayer.serves = serves
        return out.sequences, torch.stack(out.scores)

    seq, ref = logits(False)
    seq_f, got = logits(True, int4_calls=False)
    assert torch.equal(seq_f, seq) and torch.equal(got, ref)
    seq_f, got = logits(True, int4_calls=True)
    # one activation that the other rounding order lands one int8 step apart moves this 128-wide model's
    # logits by ~2e-3 (a real model's 896-4864-wide layers by ~3e-4); the steps after carry it on
    assert torch.equal(seq_f, seq) and float((got - ref).norm() / ref.norm()) <= 1e-2


class _CountingExtension:
    """river-int4's extension with its calls counted by name."""

    def __init__(self, ext):
        self.ext, self.calls = ext, {}

    def __getattr__(self, name):
        fn = getattr(self.ext, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)

        return counted


def _stacked(calls: dict) -> bool:
    """Whether the extension ran exit layers in one call: ``exit_stack``, or the ``ExitStackHandle`` River's
    exit-mode step (river.exit_step) makes per call and runs at every step."""
    return calls.get("exit_stack", 0) + calls.get("ExitStackHandle", 0) > 0


def _stacked_and_layer_by_layer(river, monkeypatch, mode: str, cache=None, **gen):
    """``generate`` in ``mode`` with exit stacks (``FusedLlamaLayer.stacks``) on and off (``cache``: a
    maker of each run's cache, None: generate's own): for each, the sequences, the logits, the cache's
    K/V per layer and the extension's calls by name."""
    from river_hf.river.fused_llama import FusedLlamaLayer

    runs = {}
    for stacks in (True, False):
        counting = _CountingExtension(river_int4.extension())
        with monkeypatch.context() as m:
            m.setattr(FusedLlamaLayer, "stacks", stacks)
            m.setattr(river_int4, "extension", lambda: counting)
            with river.river_mode(mode), torch.no_grad():
                out = river.generate(**gen, past_key_values=cache() if cache else None, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
        kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        runs[stacks] = (out.sequences, torch.stack(out.scores), kv, counting.calls)
    return runs[True], runs[False]


@pytest.mark.filterwarnings("ignore:tau=-2 is negative")
@pytest.mark.parametrize("mode,batch,prompt", [("exit", 1, 9), ("exit", 3, 9), ("exit", 3, 100), ("route", 1, 9),
                                                ("lossless", 1, 9)])
def test_a_decode_step_runs_the_exit_layers_after_the_exit_in_one_call_with_the_same_numbers(
        kernel, tiny_llama, monkeypatch, mode, batch, prompt):
    """After the exit, a decode step's exit layers run in one call (``exit_stack``: each layer's
    attention_in, its cache slot's update as DynamicLayer.update does it, River's one-token attention
    and the layer's tail): the same functions in the same order as the per-layer calls, so the same
    tokens, logits and KV cache bit for bit; exit mode (a left-padded batch too), route mode exiting
    after layer 1 (tau -2), lossless drafts. The cache is River's own (slots that grow in place, here
    with room for 2 positions, so the stack's writes cross allocations) or transformers'
    ``DynamicCache`` (the stack concatenates as ``DynamicLayer.update`` does): the same numbers. A
    100-token prompt in a batch of 3 gives the attention enough work for both threads."""
    from transformers import DynamicCache

    from river_hf import enable_river
    from river_hf.river.cache import GrowingLayer

    monkeypatch.setattr(GrowingLayer, "MIN_ROOM", 2)
    config = RiverConfig(tau=-2.0, min_layer=1, backend="river-int4", exit_head="river-int4",
                         exit_layer_impl="fused", fuse_projections=True, draft_tokens=3, prompt_lookup_tokens=0)
    river = enable_river(tiny_llama(), config=config)
    ids = torch.randint(3, 256, (batch, prompt), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[0, :4], mask[0, :4] = 0, 0  # left padding: a [batch, 1, 1, L] mask each step
    runs = []
    for cache in (None, lambda: DynamicCache(config=river.config)):
        (seq, logits, kv, calls), (seq_ref, logits_ref, kv_ref, calls_ref) = _stacked_and_layer_by_layer(
            river, monkeypatch, mode, cache=cache, input_ids=ids, attention_mask=mask, max_new_tokens=6)
        assert _stacked(calls) and not _stacked(calls_ref)
        assert torch.equal(seq, seq_ref) and torch.equal(logits, logits_ref)
        assert len(kv) == len(kv_ref) == 3
        assert all(torch.equal(k, k_ref) and torch.equal(v, v_ref) for (k, v), (k_ref, v_ref) in zip(kv, kv_ref))
        runs.append((seq, logits, kv))
    (seq, logits, kv), (seq_cat, logits_cat, kv_cat) = runs
    assert torch.equal(seq, seq_cat) and torch.equal(logits, logits_cat)
    assert all(torch.equal(k, k_c) and torch.equal(v, v_c) for (k, v), (k_c, v_c) in zip(kv, kv_cat))


def test_the_exit_stack_steps_aside_for_a_hook_and_for_a_cache_it_does_not_update(kernel, tiny_llama,
                                                                                   monkeypatch):
    """A forward hook on a later layer needs that layer's own output, and a static cache is updated by
    its own code: then every exit layer runs by itself (no ``exit_stack`` call), with the same tokens."""
    from transformers import StaticCache

    from river_hf import enable_river
    from river_hf.river.layer import RiverLayer

    config = RiverConfig(backend="river-int4", exit_head="river-int4", exit_layer_impl="fused", fuse_projections=True)
    river = enable_river(tiny_llama(), config=config)
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(7))
    layers = [m for m in river.modules() if isinstance(m, RiverLayer)]
    seen = []
    handle = layers[2].register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        (seq, _, _, calls), (seq_ref, _, _, _) = _stacked_and_layer_by_layer(river, monkeypatch, "exit",
                                                                            input_ids=ids, max_new_tokens=4)
    finally:
        handle.remove()
    assert not _stacked(calls) and torch.equal(seq, seq_ref)
    # the hook saw layer 2's own output in both runs (an exit stack would have handed it its input)
    assert len(seen) == 8 and all(torch.equal(a, b) for a, b in zip(seen[:4], seen[4:]))

    (seq, _, _, calls), (seq_ref, _, _, _) = _stacked_and_layer_by_layer(
        river, monkeypatch, "exit", cache=lambda: StaticCache(config=river.config, max_cache_len=32), input_ids=ids,
        max_new_tokens=4)
    assert not _stacked(calls) and torch.equal(seq, seq_ref)


def test_the_exit_stack_reads_the_live_layers_their_hooks_and_their_current_weights(kernel, tiny_llama, monkeypatch):
    """The stack is made from what the model holds at each step, not from what the build saw: a hook
    on a later exit layer (the fused layer's own check), a later exit layer's C++ calls switched off
    and a decoder layer swapped into the model's list each make every exit layer run by itself; weights put in place after a stacked step (a new
    ``packed`` buffer, as ``.to`` puts one) are the ones the next stacked step reads."""
    from river_hf import enable_river
    from river_hf.river.layer import RiverLayer

    config = RiverConfig(backend="river-int4", exit_head="river-int4", exit_layer_impl="fused", fuse_projections=True)
    river = enable_river(tiny_llama(), config=config)
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(8))
    layers = [m for m in river.modules() if isinstance(m, RiverLayer)]
    (seq0, _, _, calls), _ = _stacked_and_layer_by_layer(river, monkeypatch, "exit", input_ids=ids, max_new_tokens=4)
    assert _stacked(calls)  # the stack's arguments are now memoized

    handle = layers[2].exit_layer.register_forward_pre_hook(lambda module, args: None)
    try:
        (seq, _, _, calls), (seq_ref, _, _, _) = _stacked_and_layer_by_layer(river, monkeypatch, "exit",
                                                                            input_ids=ids, max_new_tokens=4)
    finally:
        handle.remove()
    assert not _stacked(calls) and torch.equal(seq, seq_ref) and torch.equal(seq, seq0)

    layers[2].exit_layer.int4_calls = False  # its products from Python: it cannot join the call
    try:
        (seq, _, _, calls), (seq_ref, _, _, _) = _stacked_and_layer_by_layer(river, monkeypatch, "exit",
                                                                            input_ids=ids, max_new_tokens=4)
    finally:
        layers[2].exit_layer.int4_calls = True
    assert not _stacked(calls) and torch.equal(seq, seq_ref)

    # layer 1's down product takes layer 2's packed weights (same shape): a new buffer object
    down1, down2 = layers[1].exit_layer.kernels["down"][0], layers[2].exit_layer.kernels["down"][0]
    down1.packed = down2.packed.clone()
    (seq, logits, _, calls), (seq_ref, logits_ref, _, _) = _stacked_and_layer_by_layer(
        river, monkeypatch, "exit", input_ids=ids, max_new_tokens=4)
    assert _stacked(calls) and torch.equal(seq, seq_ref) and torch.equal(logits, logits_ref)

    decoder = river.model.layers
    decoder[2] = layers[2].backbone  # the architecture's own layer back in place of its RiverLayer
    (seq, _, _, calls), (seq_ref, _, _, _) = _stacked_and_layer_by_layer(river, monkeypatch, "exit",
                                                                        input_ids=ids, max_new_tokens=4)
    assert not _stacked(calls) and torch.equal(seq, seq_ref)


def test_its_argmax_is_torchs(kernel):
    """The first index of the largest value per row; ties, -inf rows, a NaN (torch counts it as the largest)
    and rows shorter than a vector."""
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(4, 151936, generator=gen), torch.randn(3, 7, generator=gen), torch.randn(2, 33, generator=gen)]
    tied = torch.zeros(2, 100)
    tied[0, [17, 40, 90]] = 5.0
    tied[1] = float("-inf")
    nan = torch.randn(2, 50, generator=gen)
    nan[0, 31], nan[0, 3], nan[1, 48] = float("nan"), float("nan"), float("nan")
    for x in rows + [tied, nan, torch.randn(5, 40, generator=gen)[:, ::2]]:
        assert torch.equal(river_int4.argmax(x), torch.argmax(x, dim=-1))
