"""dLLM-Cache and the masked-diffusion loop on tiny random bidirectional models (both layouts).

First test of every change: Kp = Kr = 1 reproduces uncached generation token for token.
"""

from __future__ import annotations

import pytest
import torch

from river_hf.diffusion import (
    DLLMCacheConfig,
    attach_cache,
    build_test_model,
    generate,
    num_transfer_tokens,
    select_response_tokens,
)
from river_hf.diffusion.cache import CachedLayer
from river_hf.errors import RiverError

LAYOUTS = ["llada", "llama"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # the machine is shared; one thread is faster for these tiny matmuls and keeps runs stable
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def models():
    return {layout: build_test_model(layout, "tiny", seed=1) for layout in LAYOUTS}


def _prompts(batched: bool, vocab_limit: int = 250):
    g = torch.Generator().manual_seed(3)
    if not batched:
        return torch.randint(0, vocab_limit, (1, 10), generator=g), None
    ids = torch.randint(0, vocab_limit, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :7] = 0
    ids[mask == 0] = 0  # pad id: a real token id, so only the mask keeps it out
    return ids, mask


KW = dict(steps=16, gen_length=16, block_length=8)


def _gen(model, ids, mask, cache=None, **kw):
    """The generated sequences ``[B, P + G]``."""
    return _gen_out(model, ids, mask, cache, **kw).sequences


def _gen_out(model, ids, mask, cache=None, **kw):
    """The whole :class:`DiffusionGenerationOutput` (stats included)."""
    kw = {**KW, "return_stats": True, **kw}
    return generate(model, ids, mask_id=model.config.mask_token_id, attention_mask=mask, cache=cache, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batched", [False, True])
def test_exactness_switch_kp_kr_1(models, layout, batched):
    """Kp = Kr = 1 (every step a full refresh) gives the uncached tokens exactly."""
    model = models[layout]
    ids, mask = _prompts(batched)
    ref = _gen(model, ids, mask)
    for ratio in (0.0, 0.25):
        out = _gen(model, ids, mask, DLLMCacheConfig(1, 1, ratio))
        assert torch.equal(out, ref)
    assert not (ref[:, 10:] == model.config.mask_token_id).any()  # every position was denoised


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_paths_recompute_exactly(models, layout):
    """Kp = 1 and rho = 1 (prompt refresh + V-verify of *all* response tokens, never a response refresh):
    the decomposed cached path recomputes everything and matches uncached generation (batched, padded)."""
    model = models[layout]
    ids, mask = _prompts(True)
    ref = _gen(model, ids, mask)
    out = _gen_out(model, ids, mask, DLLMCacheConfig(1, 1000, 1.0))
    assert out.stats["refresh_counts"]["prompt"] == KW["steps"] - 1  # the decomposed path really ran
    assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_branch_reproduces_full_forward_on_unchanged_input(models, layout):
    """With the same input at every step nothing is stale, so V-verify, prompt-only and response-only
    refresh steps must all give the logits of the full forward (checks each branch's arithmetic)."""
    model = models[layout]
    ids, mask = _prompts(True)
    b = ids.shape[0]
    x = torch.cat([ids, torch.full((b, 6), model.config.mask_token_id)], 1)
    x[:, 12] = 5
    full_mask = torch.cat([mask, torch.ones(b, 6, dtype=mask.dtype)], 1)
    with torch.inference_mode():
        ref = model(input_ids=x, attention_mask=full_mask).logits
        with attach_cache(model, DLLMCacheConfig(2, 3, 0.5), ids.shape[1], full_mask.bool()) as fc:
            kinds = []
            for _ in range(6):  # steps 0..5: full, verify, prompt, response, prompt, verify
                fc.next_step()
                kinds.append((fc.refresh_prompt, fc.refresh_response))
                out = model(input_ids=x, attention_mask=full_mask).logits
                real = full_mask.bool()
                torch.testing.assert_close(out[real], ref[real], rtol=1e-4, atol=1e-4)
    assert set(kinds) == {(True, True), (False, False), (True, False), (False, True)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_buffers_hold_rotated_keys_and_are_written_in_place(models, layout, monkeypatch):
    """Each layer keeps one buffer per feature over all positions, written in place across steps of
    every kind, and the K buffer holds the keys *after* rotary: the very keys the model's own
    attention receives (recorded from its scaled_dot_product_attention call)."""
    import torch.nn.functional as F

    model = models[layout]
    ids, mask = _prompts(True)
    b = ids.shape[0]
    x = torch.cat([ids, torch.full((b, 6), model.config.mask_token_id)], 1)
    full_mask = torch.cat([mask, torch.ones(b, 6, dtype=mask.dtype)], 1)
    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, *a, **kw: seen.append(k) or sdpa(q, k, *a, **kw))
    with torch.inference_mode():
        model(input_ids=x, attention_mask=full_mask)
        model_keys = list(seen)  # [B, heads, T, D] per layer (KV heads possibly repeated for GQA)
        with attach_cache(model, DLLMCacheConfig(2, 3, 0.5), ids.shape[1], full_mask.bool()) as fc:
            fc.next_step()
            model(input_ids=x, attention_mask=full_mask)
            buffers = {i: (st, [t.data_ptr() for t in (st.k, st.v, st.attn, st.ffn)]) for i, st in fc.layers.items()}
            for _ in range(5):  # verify, prompt, response, prompt, verify
                fc.next_step()
                model(input_ids=x, attention_mask=full_mask)
    assert fc.refresh_counts == {"full": 1, "prompt": 2, "response": 1, "verify": 2}
    assert len(buffers) == len(model_keys)
    for i, (st, ptrs) in buffers.items():
        assert fc.layers[i] is st and [t.data_ptr() for t in (st.k, st.v, st.attn, st.ffn)] == ptrs
        assert st.k.shape == (b, x.shape[1], st.k.shape[2], st.k.shape[3])
        keys = model_keys[i][:, :: model_keys[i].shape[1] // st.k.shape[2]]
        torch.testing.assert_close(st.k.transpose(1, 2), keys, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_small_batch_linear_option(models, layout):
    """small_batch_linear=True: Kp = Kr = 1 stays token-exact (full refreshes never use the mode), and on
    decomposed steps the rerouted Linear calls give the full forward's logits up to fp32 rounding."""
    model = models[layout]
    for batched in (False, True):
        ids, mask = _prompts(batched)
        out = _gen_out(model, ids, mask, DLLMCacheConfig(1, 1, 0.25, small_batch_linear=True))
        assert torch.equal(out.sequences, _gen(model, ids, mask))
        assert out.stats["small_batch_linear_calls"] == 0
    ids, mask = _prompts(True)
    x = torch.cat([ids, torch.full((3, 6), model.config.mask_token_id)], 1)
    full_mask = torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], 1)
    real = full_mask.bool()
    with torch.inference_mode():
        ref = model(input_ids=x, attention_mask=full_mask).logits
        with attach_cache(model, DLLMCacheConfig(2, 3, 0.5, small_batch_linear=True), 10, real) as fc:
            for _ in range(6):  # full, verify, prompt, response, prompt, verify
                fc.next_step()
                out = model(input_ids=x, attention_mask=full_mask).logits
                torch.testing.assert_close(out[real], ref[real], rtol=1e-4, atol=1e-4)
    assert fc.linear_mode.calls_rerouted > 0
    with pytest.raises(RiverError):
        DLLMCacheConfig(small_batch_linear="yes")


def test_small_batch_linear_auto_decides_by_measurement(models, monkeypatch, tmp_path):
    """"auto": the faster orientation of the measurement at the V-verify row count is used, measured once
    per shape and row count through the one kernel tuner (kept in its kernels.json); off (nothing
    measured) for non-fp32 weights, row counts the mode never reroutes, or RIVER_HF_AUTOTUNE=0."""
    from river_hf.diffusion import cache as cache_mod
    from river_hf.quant.dense import SmallBatchLinear

    model = models["llada"]
    layers = list(model.model.transformer["blocks"])
    auto = DLLMCacheConfig(small_batch_linear="auto")
    calls = []

    def fake(winner):
        def measure(i, o, rows, **kw):
            calls.append((i, o, rows))
            return {"torch": 2.0, "small-batch": 1.0} if winner == "small-batch" else {"torch": 1.0, "small-batch": 2.0}
        return measure

    from river_hf.quant.autotune import read_cache

    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "1")
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "first"))
    monkeypatch.setattr(SmallBatchLinear, "measure", staticmethod(fake("small-batch")))
    used, timing = cache_mod.choose_partial_kernel(layers, auto, 4)
    biggest = max((m for m in layers[0].modules() if isinstance(m, torch.nn.Linear)), key=lambda m: m.weight.numel())
    assert used and timing["rows"] == 4 and timing["shape"] == [biggest.in_features, biggest.out_features]
    assert cache_mod.choose_partial_kernel(layers, auto, 4)[0] and len(calls) == 1  # remembered (in kernels.json)
    (entry,) = read_cache(tmp_path / "first" / "kernels.json")[0].values()
    assert entry["rows"] == 4 and entry["kernel"] == "small-batch" and entry["candidates"] == ["small-batch", "torch"]
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "second"))  # a machine that never measured it
    monkeypatch.setattr(SmallBatchLinear, "measure", staticmethod(fake("torch")))
    used, timing = cache_mod.choose_partial_kernel(layers, auto, 4)
    assert not used and timing["us_per_call"] == {"torch": 1.0, "small-batch": 2.0}
    n = len(calls)
    for rows in (None, 1, 65):
        assert cache_mod.choose_partial_kernel(layers, auto, rows) == (False, None)
    assert cache_mod.choose_partial_kernel(layers, DLLMCacheConfig(small_batch_linear=True), None) == (True, None)
    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "0")
    assert cache_mod.choose_partial_kernel(layers, auto, 8) == (False, None)
    assert len(calls) == n
    # in generate: the row count is batch * floor(G * rho), and the stats say what was decided
    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "1")
    monkeypatch.setattr(SmallBatchLinear, "measure", staticmethod(fake("small-batch")))
    ids, mask = _prompts(True)
    out = _gen_out(model, ids, mask, DLLMCacheConfig(4, 2, 0.25, small_batch_linear="auto"))
    assert calls[-1][2] == 3 * int(KW["gen_length"] * 0.25)
    assert out.stats["small_batch_linear_used"] and out.stats["small_batch_linear_calls"] > 0
    assert out.stats["small_batch_linear_timing"]["us_per_call"] == {"torch": 2.0, "small-batch": 1.0}


def test_small_batch_linear_is_off_by_default(models):
    out = _gen_out(models["llada"], *_prompts(False), DLLMCacheConfig(4, 2, 0.25))
    assert out.stats["small_batch_linear_used"] is False and "small_batch_linear_timing" not in out.stats


def test_step_seconds_by_kind(models):
    out = _gen_out(models["llada"], *_prompts(False), DLLMCacheConfig(4, 2, 0.25))
    counts = out.stats["refresh_counts"]
    assert set(out.stats["step_seconds"]) == {k for k, n in counts.items() if n}
    assert all(v > 0 for v in out.stats["step_seconds"].values())
    assert sum(out.stats["step_seconds"].values()) <= out.stats["seconds"]
    assert set(_gen_out(models["llada"], *_prompts(False)).stats["step_seconds"]) == {"full"}


def test_v_verify_selection_unit():
    """The rho fraction with the lowest cosine similarity between fresh and cached V is selected."""
    torch.manual_seed(0)
    cached = torch.randn(2, 12, 2, 4)
    fresh = cached.clone()
    changed = [[1, 7, 10], [0, 3, 11]]
    for row, idx in enumerate(changed):
        fresh[row, idx] = -fresh[row, idx] + 0.1 * torch.arange(len(idx)).view(-1, 1, 1)
    sel = select_response_tokens(fresh, cached, 0.25)  # floor(12 * 0.25) = 3 per row
    assert sel.shape == (2, 3)
    for row in range(2):
        assert sorted(sel[row].tolist()) == changed[row]
    assert select_response_tokens(fresh, cached, 0.0).shape == (2, 0)
    assert select_response_tokens(fresh, cached, 0.01).shape == (2, 1)  # at least one when rho > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v_verify_picks_changed_tokens_in_model(models, layout, monkeypatch):
    """After committing tokens at two response positions, layer 0's V-verify selects exactly those
    (layer 0's V depends only on each position's own token)."""
    import river_hf.diffusion.cache as cache_mod

    model = models[layout]
    ids, _ = _prompts(False)
    p, r = ids.shape[1], 8
    x = torch.cat([ids, torch.full((1, r), model.config.mask_token_id)], 1)
    seen = []
    real = cache_mod.select_response_tokens
    monkeypatch.setattr(cache_mod, "select_response_tokens", lambda *a: seen.append(real(*a)) or seen[-1])
    with torch.inference_mode(), attach_cache(model, DLLMCacheConfig(100, 100, 0.25), p, None) as fc:
        fc.next_step()
        model(input_ids=x)
        x[0, p + 2], x[0, p + 5] = 7, 9
        fc.next_step()
        model(input_ids=x)
    n_layers = len(seen)
    assert n_layers == (model.config.num_hidden_layers if layout == "llama" else model.config.n_layers)
    assert sorted(seen[0][0].tolist()) == [2, 5]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache", [None, DLLMCacheConfig(5, 3, 0.25)])
def test_padding_is_masked(models, layout, cache):
    """A left-padded row of a batch generates what the same prompt generates alone (uncached and cached:
    the cached attention applies the key padding mask)."""
    model = models[layout]
    ids, mask = _prompts(True)
    batch = _gen(model, ids, mask, cache)
    for row in range(ids.shape[0]):
        start = int((mask[row] == 0).sum())
        alone = _gen(model, ids[row : row + 1, start:], None, cache)
        assert torch.equal(batch[row, start:], alone[0])


def test_padding_mask_matters(models):
    """Sanity check of the test above: without the mask the padded row's tokens change."""
    model = models["llada"]
    ids, mask = _prompts(True)
    with_mask = _gen(model, ids, mask, DLLMCacheConfig(5, 3, 0.25))
    without = _gen(model, ids, None, DLLMCacheConfig(5, 3, 0.25))
    assert not torch.equal(with_mask[2], without[2])


def _reference_generate(model, ids, mask, steps, gen_length, block_length, shift=False):
    """LLaDA's greedy low-confidence loop written plainly: logits for every position of the sequence,
    the block's masked positions compete, committed tokens are never touched."""
    mask_id = model.config.mask_token_id
    b, p = ids.shape
    x = torch.full((b, p + gen_length), mask_id, dtype=torch.long)
    x[:, :p] = ids
    full = None if mask is None else torch.cat([mask, torch.ones(b, gen_length, dtype=torch.long)], 1)
    per_block = steps // (gen_length // block_length)
    with torch.inference_mode():
        for lo in range(p, p + gen_length, block_length):
            n = num_transfer_tokens(x[:, lo : lo + block_length] == mask_id, per_block)
            for i in range(per_block):
                logits = model(input_ids=x, attention_mask=full).logits
                if shift:
                    logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
                logits[..., mask_id] = float("-inf")
                x0 = logits.argmax(-1)
                conf = torch.softmax(logits.double(), -1).gather(-1, x0[..., None])[..., 0]
                conf[:, : lo] = conf[:, lo + block_length :] = float("-inf")
                conf[x != mask_id] = float("-inf")
                for row in range(b):
                    idx = torch.topk(conf[row], int(n[row, i])).indices
                    x[row, idx] = x0[row, idx]
    return x


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_at_masked_positions_only_match_the_plain_loop(models, layout):
    """generate computes the LM head only at the block's still-masked positions: the same tokens as the
    plain loop over logits for every position (batched with padding; Dream's shift too)."""
    ids, mask = _prompts(True)
    model = models[layout]
    assert torch.equal(_gen(model, ids, mask), _reference_generate(model, ids, mask, **KW))
    rows = []  # LM head rows per step, one prompt: the block's masked count (8, 7, ..., 1: one commit per step)
    hook = model.get_output_embeddings().register_forward_hook(lambda mod, args, out: rows.append(out.shape[1]))
    try:
        _gen(model, ids[:1], None)
    finally:
        hook.remove()
    assert rows == list(range(KW["block_length"], 0, -1)) * (KW["gen_length"] // KW["block_length"])
    dream = build_test_model("llama", "tiny", seed=2, dream=True)
    assert torch.equal(_gen(dream, ids, mask), _reference_generate(dream, ids, mask, **KW, shift=True))


def test_dream_shift_and_sampling_exactness():
    """Dream mode (logits shifted by one), temperature and random remasking: Kp = Kr = 1 stays exact."""
    model = build_test_model("llama", "tiny", seed=2, dream=True)
    ids, mask = _prompts(True)
    for kw in ({"temperature": 0.7}, {"remasking": "random"}):
        ref = _gen(model, ids, mask, generator=torch.Generator().manual_seed(5), **kw)
        out = _gen(model, ids, mask, DLLMCacheConfig(1, 1, 0.25), generator=torch.Generator().manual_seed(5), **kw)
        assert torch.equal(out, ref)
    plain = _gen(model, ids, mask, shift_logits=False)
    assert not torch.equal(plain, _gen(model, ids, mask))  # the shift is applied


def test_cache_reduces_flops_and_restores_layers(models):
    model = models["llada"]
    ids, mask = _prompts(True)
    before = list(model.state_dict())
    full = _gen_out(model, ids, mask, DLLMCacheConfig(1, 1, 0.25)).stats
    st = _gen_out(model, ids, mask, DLLMCacheConfig(8, 4, 0.25)).stats
    unc = _gen_out(model, ids, mask).stats
    assert full["flops_ratio"] == 1.0 and full["layer_flops"] == unc["layer_flops"]
    assert st["layer_flops_full"] == unc["layer_flops"] and st["flops_ratio"] > 1.5
    assert st["refresh_counts"] == {"full": 2, "prompt": 0, "response": 2, "verify": 12}
    assert list(model.state_dict()) == before
    assert not any(isinstance(m, CachedLayer) for m in model.modules())

    def boom(module, args, kwargs):
        raise RuntimeError("boom")

    hook = model.register_forward_pre_hook(boom, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="boom"):  # an error inside generate also restores the layers
            _gen(model, ids, mask, DLLMCacheConfig(2, 2, 0.25))
    finally:
        hook.remove()
    assert not any(isinstance(m, CachedLayer) for m in model.modules())


@pytest.mark.parametrize("cache", [None, DLLMCacheConfig(4, 2, 0.25)])
def test_generate_returns_a_model_output(models, cache):
    """generate returns a transformers ModelOutput: ``sequences`` always, ``stats`` only when asked."""
    from transformers.utils import ModelOutput

    from river_hf.diffusion import DiffusionGenerationOutput

    model = models["llada"]
    ids, mask = _prompts(True)
    plain = _gen_out(model, ids, mask, cache, return_stats=False)
    assert isinstance(plain, DiffusionGenerationOutput) and isinstance(plain, ModelOutput)
    assert plain.stats is None and list(plain.keys()) == ["sequences"]
    assert plain.sequences.dtype == torch.long and plain.sequences.shape == (3, 10 + KW["gen_length"])
    full = _gen_out(model, ids, mask, cache)
    assert torch.equal(full["sequences"], plain.sequences) and full.stats["steps"] == KW["steps"]
    assert ("refresh_counts" in full.stats) == (cache is not None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mask_id_defaults_to_the_models_own(layout):
    """Without mask_id, generate uses config.mask_token_id, else generation_config.mask_token_id, and
    raises a RiverError naming mask_id when neither has one; an id outside the vocabulary is refused."""
    model = build_test_model(layout, "tiny", seed=1)
    ids, mask = _prompts(True)
    own = model.config.mask_token_id
    explicit = _gen(model, ids, mask)  # passes mask_id=config.mask_token_id
    default = generate(model, ids, attention_mask=mask, **KW).sequences
    assert torch.equal(default, explicit)
    from transformers import GenerationConfig

    model.config.mask_token_id = None
    model.generation_config = GenerationConfig(mask_token_id=own)  # where Dream keeps it
    assert torch.equal(generate(model, ids, attention_mask=mask, **KW).sequences, explicit)
    model.generation_config.mask_token_id = None
    with pytest.raises(RiverError, match="pass mask_id="):
        generate(model, ids, attention_mask=mask, **KW)
    with pytest.raises(RiverError, match="outside the vocabulary"):
        generate(model, ids, attention_mask=mask, mask_id=model.config.vocab_size, **KW)


def test_num_transfer_tokens():
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :7] = True
    mask[1] = True
    n = num_transfer_tokens(mask, 3)
    assert n.tolist() == [[3, 2, 2], [3, 3, 2]]


@pytest.mark.parametrize(
    "kw",
    [
        dict(gen_length=15),  # not a multiple of block_length
        dict(steps=15),  # not a multiple of the number of blocks
        dict(steps=32, gen_length=16, block_length=8),  # more steps per block than tokens
        dict(remasking="top_p"),
        dict(temperature=-1.0),
    ],
)
def test_bad_arguments(models, kw):
    ids, mask = _prompts(False)
    with pytest.raises(RiverError):
        _gen(models["llada"], ids, mask, **kw)


def test_bad_masks_and_config(models):
    ids, _ = _prompts(True)
    with pytest.raises(RiverError):
        _gen(models["llada"], ids, torch.ones(3, 4, dtype=torch.long))
    zero = torch.ones_like(ids)
    zero[0] = 0
    with pytest.raises(RiverError):
        _gen(models["llada"], ids, zero)
    for bad in (dict(prompt_interval=0), dict(response_interval=1.5), dict(ratio=1.5)):
        with pytest.raises(RiverError):
            DLLMCacheConfig(**bad)
    right = torch.ones_like(ids)
    right[1, -3:] = 0  # right padding: the answer would not follow the prompt
    with pytest.raises(RiverError, match="pad prompts on the left"):
        _gen(models["llada"], ids, right)
    with pytest.raises(RiverError, match="token ids in"):
        _gen(models["llada"], ids + models["llada"].config.vocab_size, None)
    with pytest.raises(RiverError, match="on / off are True / False"):
        DLLMCacheConfig(small_batch_linear="on")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_auto_classes_round_trip(layout, tmp_path):
    from transformers import AutoConfig, AutoModelForMaskedLM

    model = build_test_model(layout, "tiny", seed=4)
    model.save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert type(cfg) is type(model.config)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(0, 200, (1, 6))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
        assert model(input_ids=ids).logits.shape == (1, 6, model.config.vocab_size)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_before_next_step_is_a_clear_error(models, layout):
    """Calling the model inside attach_cache before the first next_step() names the missing call."""
    model = models[layout]
    ids, _ = _prompts(False)
    with torch.inference_mode(), attach_cache(model, DLLMCacheConfig(), ids.shape[1] - 4, None) as fc:
        with pytest.raises(RiverError, match=r"next_step\(\)"):
            model(input_ids=ids)
        fc.next_step()
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
