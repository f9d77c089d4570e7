"""Per-row exit in route mode: each row of a batch leaves the backbone on its own tokens.

Tiny random models (fp32, int8 exit copies) for the mechanics: a batched row gets its solo
River tokens while the rows exit at different layers, τ > 1 stays the plain model, padding never
votes, the row-split KV cache writes what one full-batch write would, the strategies that cannot
split rows keep one decision per batch. SmolLM2-135M for trained weights.
"""

from __future__ import annotations

import pytest
import torch
from test_river_core import tiny_config, tiny_model
from transformers import DynamicCache, StaticCache

from river_hf import RiverCache, enable_river
from river_hf.river.controllers import ExitRuleList, MinLayerRule, StateTransitionSimilarityRule
from river_hf.river.layer import RiverRouter
from river_hf.river.rows import RowsCache, splittable
from river_hf.river.stats import summarize

LENGTHS = [12, 9, 7, 5]  # real tokens per row, left-padded to 12
# τ at which the rows of the batch below exit at different layers (probed per family)
MIXED_TAU = {"llama": 0.7, "gemma3": 0.8, "qwen2": 0.7}


def padded_batch():
    torch.manual_seed(3)
    width = max(LENGTHS)
    ids = torch.randint(3, 256, (len(LENGTHS), width))
    mask = torch.ones_like(ids)
    for r, n in enumerate(LENGTHS):
        ids[r, : width - n] = 0
        mask[r, : width - n] = 0
    return ids, mask


def river(family, **kwargs):
    """River with int8 exit copies and an int8 exit head (so the two paths give different tokens)."""
    return enable_river(tiny_model(family), min_layer=1, backend="torch-int8", exit_head="torch-int8", progress=False,
                        **kwargs)


def mixed_steps(cache: RiverCache) -> list[tuple[int, ...]]:
    return [rows for rows in cache.row_exit_layers if rows is not None and len(set(rows)) > 1]


@pytest.mark.parametrize("strategy", ["river", "state-propagation"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window cache slots too
def test_each_batched_row_gets_its_solo_tokens(family, strategy):
    model = river(family, tau=MIXED_TAU[family], strategy=strategy)
    ids, mask = padded_batch()
    width, new = ids.shape[1], 8
    cache = RiverCache(config=model.config)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, cache=cache)
    mixed = mixed_steps(cache)
    assert len(mixed) >= 3, f"the rows must exit at different layers: {cache.row_exit_layers}"
    stats = model.river_stats
    assert stats["decode_rows"] == len(LENGTHS) * stats["decode_steps"] == sum(stats["exit_layer_counts"])
    assert sum(c > 0 for c in stats["exit_layer_counts"]) >= 2 and stats["exit_fraction"] > 0
    for r, n in enumerate(LENGTHS):
        solo = model.generate(input_ids=ids[r:r + 1, width - n:], max_new_tokens=new, min_new_tokens=new,
                              do_sample=False)
        assert torch.equal(out[r, width:], solo[0, n:]), f"row {r}"


def test_rows_leave_the_backbone_at_their_own_layer_in_one_pass():
    """One decode pass: the pass log and the cache give each row's exit layer, and the deepest
    one is the pass's exit layer; rows that exited read the exit head, the others the original."""
    model = river("qwen2", tau=MIXED_TAU["qwen2"])
    ids, mask = padded_batch()
    cache = RiverCache(config=model.config)
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("h", o))  # the head's input
    step = torch.full((len(LENGTHS), 1), 7)
    with torch.no_grad(), model.river.recording() as log:
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        logits = model(input_ids=step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1), cache=cache,
                       use_cache=True).logits
    hook.remove()
    batch, tokens, exit_layer, _, rows = log[-1]
    assert (batch, tokens) == (4, 1) and len(set(rows)) > 1 and exit_layer == max(rows)
    assert cache.row_exit_layers[-1] == rows and all(layer.get_seq_length() == 13 for layer in cache.layers)
    head, L = model.get_output_embeddings(), model.river.num_layers
    assert head.exit_head is not None
    with torch.no_grad():
        for r, e in enumerate(rows):
            which = head.exit_head if e < L else head.backbone
            assert torch.allclose(logits[r, -1], which(seen["h"][r:r + 1, -1:])[0, -1], atol=1e-4), f"row {r} ({e})"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tau_above_one_batch_is_the_plain_batch(family):
    ids, mask = padded_batch()
    ref = tiny_model(family).generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    model = river(family, tau=2.0)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)
    assert model.river_stats["exit_fraction"] == 0.0


def _router(tau=0.5, strategy="river"):
    rules = ExitRuleList([MinLayerRule(1), StateTransitionSimilarityRule(tau)])
    return RiverRouter(rules, num_layers=4, prefill="route", strategy=strategy)


def test_padding_never_votes_per_row():
    """Row 1's padding position turns its hidden state around (cosine -1): were it counted, row 1
    could not exit. Row 0 turns its real token (cos 0), so it stays; row 1 exits alone."""
    router = _router()
    h_in = torch.ones(2, 3, 8)
    h_out = h_in.clone()
    h_out[1, 0] = -1.0  # row 1, padding position
    h_out[0, 2, :4] = -1.0  # row 0, a real token: cosine 0 < τ
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    router.begin(mask, tokens=3, cache=DynamicCache(), batch=2)
    router.after_backbone(0, h_in, h_out)
    assert router.row_exit_layers(2) == [4, 1] and not router.exited
    # without the mask the padding position would have kept row 1 on the backbone
    router.begin(None, tokens=3, cache=DynamicCache(), batch=2)
    router.after_backbone(0, h_in, h_out)
    assert router.row_exit_layers(2) == [4, 4]


def test_a_row_without_a_real_token_holds_no_row_back():
    router = _router()
    h_in = torch.ones(2, 1, 8)
    h_out = -h_in
    h_out[0] = h_in[0]
    router.begin(torch.tensor([[1, 1], [1, 0]]), tokens=1, cache=DynamicCache(), batch=2)
    router.after_backbone(0, h_in, h_out)
    assert router.exited and router.row_exit_layers(2) == [1, 1]


@pytest.mark.parametrize("layer_kind", ["full", "sliding"])
def test_rows_cache_writes_what_one_full_batch_write_would(layer_kind):
    config = tiny_config("gemma3")  # layer 0 sliding (window 8), layer 1 full
    idx = 0 if layer_kind == "sliding" else 1
    torch.manual_seed(0)
    past = torch.randn(4, 2, 10, 32), torch.randn(4, 2, 10, 32)
    new = torch.randn(4, 2, 1, 32), torch.randn(4, 2, 1, 32)
    ref, split = DynamicCache(config=config), DynamicCache(config=config)
    for cache in (ref, split):
        cache.update(*past, idx)
    ref_k, ref_v = ref.update(*new, idx)
    written: dict = {}
    for rows in (torch.tensor([0, 2]), torch.tensor([1, 3])):
        k, v = RowsCache(split, rows, 4, written).update(new[0][rows], new[1][rows], idx)
        assert torch.equal(k, ref_k[rows]) and torch.equal(v, ref_v[rows])
    assert torch.equal(split.layers[idx].keys, ref.layers[idx].keys)
    assert torch.equal(split.layers[idx].values, ref.layers[idx].values)
    assert split.get_seq_length(idx) == ref.get_seq_length(idx)


@pytest.mark.parametrize("strategy", ["skipdecode", "kv-mask", "recompute"])
def test_strategies_that_cannot_split_rows_exit_as_one_batch(strategy):
    model = river("llama", tau=MIXED_TAU["llama"], strategy=strategy)
    ids, mask = padded_batch()
    cache = RiverCache(config=model.config)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache=cache)
    assert cache.row_exit_layers and all(rows is None for rows in cache.row_exit_layers)
    assert not model.river.strategy.per_row


def test_a_static_cache_keeps_one_decision_per_batch():
    assert not splittable(StaticCache(config=tiny_config("llama"), max_cache_len=32))
    assert splittable(RiverCache(config=tiny_config("gemma3"))) and splittable(None)
    model = river("llama", tau=MIXED_TAU["llama"])
    ids, mask = padded_batch()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         cache_implementation="static")
    assert out.shape == (4, 18)
    with torch.no_grad(), model.river.recording() as log:
        model(input_ids=ids, attention_mask=mask, cache=StaticCache(config=model.config, max_cache_len=32),
              use_cache=True)
    assert len(set(log[-1][4])) == 1


def test_mixed_pass_bytes_are_the_union_of_the_rows_paths():
    """A pass whose rows exited at 1 and L reads backbone 0..L-1, exit layers 1..L-1 and both heads."""
    L, bb, ex, head, ex_head = 4, [10, 20, 30, 40], [1, 2, 3, 4], 1000, 100
    river_bytes = [sum(bb[:k]) + sum(ex[k:]) + (ex_head if k < L else head) for k in range(L + 1)]
    skip = [sum(bb[:k]) + (ex_head if k < L else head) for k in range(L + 1)]
    step_bytes = {"river": river_bytes, "skipdecode": skip}
    log = [(2, 5, 4, 0.0, (4, 4)), (2, 1, 4, 1.0, (1, 4)), (2, 1, 3, 2.0, (1, 3)), (2, 1, 2, 3.0)]
    stats = summarize(log, num_layers=L, mode="route", strategy="river", step_bytes=step_bytes)
    expected = [sum(bb) + sum(ex[1:]) + head + ex_head, sum(bb[:3]) + sum(ex[1:]) + ex_head, river_bytes[2]]
    assert stats["weight_bytes_per_token"] == sum(expected) / 6
    assert stats["exit_layer_counts"] == [0, 2, 2, 1, 1] and stats["decode_steps"] == 3
    assert stats["mean_exit_layer"] == (1 + 4 + 1 + 3 + 2 + 2) / 6


@pytest.mark.real_model
def test_smollm2_rows_exit_on_their_own_and_tau_above_one_is_plain(smollm2, river_smollm2_batch):
    base, tok = smollm2
    model = river_smollm2_batch
    tok.padding_side = "left"
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write one short sentence about the sea, the wind and the sky.", "What is 12 times 7?"]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (batch["attention_mask"] == 0).any()
    model.set_river_tau(2.0)
    ref = base.generate(**batch, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(**batch, max_new_tokens=12, do_sample=False), ref)
    model.set_river_tau(0.9)
    cache = RiverCache(config=model.config)
    out = model.generate(**batch, max_new_tokens=12, min_new_tokens=12, do_sample=False, cache=cache)
    assert mixed_steps(cache), "the rows must exit at different layers"
    width = batch["input_ids"].shape[1]
    same = 0
    for r, text in enumerate(texts):
        one = tok(text, return_tensors="pt", add_special_tokens=False)
        solo = model.generate(**one, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        same += torch.equal(out[r, width:], solo[0, one["input_ids"].shape[1]:])
    # batched products sum in another order than solo ones, which can flip a near-τ decision or a
    # near-tie token; most rows still get exactly their solo tokens
    assert same >= 3


@pytest.fixture(scope="module")
def river_smollm2_batch(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return enable_river(model, tau=2.0, progress=False)
