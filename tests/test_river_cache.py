"""River's KV cache slots that grow in place (``river_hf.river.cache.GrowingLayer``): the same keys and
values as transformers' ``DynamicLayer`` through every operation generation does to a slot, and the
room reused between allocations."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from river_hf import RiverCache, RiverForCausalLM, enable_river
from river_hf.river.cache import GrowingLayer


def _kv(batch: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, tokens, 8, generator=g), torch.randn(batch, 2, tokens, 8, generator=g)


def test_a_growing_slot_holds_what_dynamic_layer_holds_and_reuses_its_room(monkeypatch):
    """Prefill, decode steps past several allocations, a crop (lossless rejects drafts), a multi-token
    update (a verify), a row selection (a finished row dropped): after each, keys and values equal
    ``DynamicLayer``'s; between allocations the buffers stay the same objects."""
    monkeypatch.setattr(GrowingLayer, "MIN_ROOM", 4)
    grow, ref = GrowingLayer(), DynamicLayer()

    def both(k, v):
        out, want = grow.update(k, v), ref.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(out, want))
        assert torch.equal(grow.keys, ref.keys) and torch.equal(grow.values, ref.values)
        return out

    both(*_kv(3, 5, 0))
    buffers, allocations = grow.room[0], 1
    for step in range(40):
        both(*_kv(3, 1, step + 1))
        if grow.room[0] is not buffers:
            buffers, allocations = grow.room[0], allocations + 1
    assert 2 <= allocations <= 10  # room of max(4, n // 4) positions: a handful of allocations, not 41
    grow.crop(-3)
    ref.crop(-3)
    assert grow.get_seq_length() == ref.get_seq_length() == 42
    before = grow.room[0]
    keys, _ = both(*_kv(3, 4, 99))
    assert grow.room[0] is before and keys.data_ptr() == before.data_ptr()  # the cropped prefix's room reused
    rows = torch.tensor([0, 2])
    grow.batch_select_indices(rows)
    ref.batch_select_indices(rows)
    both(*_kv(2, 1, 100))
    assert grow.room[0].shape[0] == 2  # a new allocation for the two rows


def test_make_room_and_grown_are_an_update_written_by_the_caller():
    """The exit stack's protocol: ``make_room(1)`` gives buffers whose first positions are the slot, the
    caller writes the new position after them and hands back the longer views (``grown``)."""
    grow, ref = GrowingLayer(), DynamicLayer()
    for layer in (grow, ref):
        layer.update(*_kv(1, 3, 0))
    k, v = _kv(1, 1, 1)
    kbuf, vbuf = grow.make_room(1)
    kbuf[:, :, 3:4].copy_(k)
    vbuf[:, :, 3:4].copy_(v)
    grow.grown(kbuf.narrow(2, 0, 4), vbuf.narrow(2, 0, 4))
    ref.update(k, v)
    assert torch.equal(grow.keys, ref.keys) and torch.equal(grow.values, ref.values)
    assert grow.make_room(1)[0] is kbuf  # still room: the same buffer


def test_river_cache_grows_its_full_attention_slots_in_place():
    """Full-attention slots are GrowingLayers, sliding-window slots transformers' own; a cache made
    without a config replicates GrowingLayers."""
    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    cache = RiverCache(config=config)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, GrowingLayer]
    lazy = RiverCache()
    lazy.update(*_kv(1, 2, 0), 0)
    assert type(lazy.layers[0]) is GrowingLayer


@pytest.mark.parametrize("mode", ["route", "exit", "lossless"])
def test_generation_across_reallocations_matches_transformers_dynamic_cache(monkeypatch, mode):
    """With room for 2 positions, a 40-token generation allocates again and again; River's tokens are
    those of the same call on transformers' own ``DynamicCache`` (tau > 1 in route mode: the plain
    model's tokens)."""
    from transformers import DynamicCache

    monkeypatch.setattr(GrowingLayer, "MIN_ROOM", 2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    plain = AutoModelForCausalLM.from_config(config).eval()
    plain.generation_config.pad_token_id = 0
    river = enable_river(AutoModelForCausalLM.from_config(config).eval(), tau=2.0 if mode == "route" else 0.5,
                         backend="copy")
    river.load_state_dict(plain.state_dict(), strict=False)
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    gen = dict(input_ids=ids, max_new_tokens=40, do_sample=False)
    with river.river_mode(mode), torch.no_grad():
        grown = river.generate(**gen)
        concatenated = river.generate(**gen, past_key_values=DynamicCache(config=config))
    assert torch.equal(grown, concatenated)
    if mode == "route":
        with torch.no_grad():
            assert torch.equal(grown, plain.generate(**gen))
    assert isinstance(river, RiverForCausalLM)
