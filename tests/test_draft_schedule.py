"""Lossless mode's draft-length schedules (river_hf.river.draft_schedule): the rules on scripted
round outcomes, and the exactness switch (lossless gives the plain model's tokens) under each."""

from __future__ import annotations

import pytest
import torch

from river_hf import RiverConfig, RiverError
from river_hf.river.draft_schedule import SCHEDULES, bytes_cost, expected_tokens_per_cost, make_schedule
from test_lossless import GEN, prompt, river_copy
from test_lossless_batch import left_padded
from test_river_core import tiny_model


def test_unknown_schedule_and_bad_bounds_are_refused():
    with pytest.raises(RiverError, match="draft_schedule must be one of heuristic, constant, cost"):
        make_schedule("sometimes", 4, 15)
    with pytest.raises(RiverError, match="1 <= first"):
        make_schedule("cost", 0, 15)
    with pytest.raises(RiverError, match="1 <= first"):
        make_schedule("cost", 8, 4)
    with pytest.raises(RiverError, match="draft_schedule"):
        RiverConfig(draft_schedule="sometimes")
    assert RiverConfig(draft_schedule="cost").draft_schedule == "cost"


def test_heuristic_is_transformers_plus_two_minus_one_within_bounds():
    s = make_schedule("heuristic", 4, 7)
    assert [s.update([4], [4], 4, 0.4), s.update([6], [6], 6, 0.6), s.update([2], [7], 7, 0.7)] == [6, 7, 6]
    assert s.update([6, 3], [6, 6], 6, 0.6) == 5  # a batch grows k only when every row took every draft
    low = make_schedule("heuristic", 1, 7)
    assert low.update([0], [1], 1, 0.1) == 1
    const = make_schedule("constant", 3, 9)
    assert [const.update([3], [3], 3, 0.3), const.update([0], [3], 3, 0.3)] == [3, 3]


def test_cost_schedule_takes_the_best_k_of_leviathan_et_al():
    """After each scripted round the k taken maximises (1 - a^(k+1)) / ((1 - a)(k c + 1)) over 1..most,
    a = (accepted + 1/2) / (accepted + rejections + 1), c = the drafts' cost per pass in verify passes."""
    s = make_schedule("cost", 4, 15)
    rounds = [([4], [4], 4, 0.4), ([6], [6], 6, 0.6), ([2], [9], 9, 0.9), ([0], [5], 5, 0.5)]
    acc = rej = passes = 0
    cost = 0.0
    ks = []
    for a, j, p, d in rounds:
        k = s.update(a, j, p, d)
        acc, rej, passes, cost = acc + a[0], rej + (a[0] < j[0]), passes + p, cost + d
        alpha, c = (acc + 0.5) / (acc + rej + 1), cost / passes
        assert k == max(range(1, 16), key=lambda n: expected_tokens_per_cost(alpha, n, c))
        ks.append(k)
    assert ks[1] > ks[0] > 4 and ks[3] < ks[2] < ks[1]  # full rounds raise k, rejections lower it
    sure = make_schedule("cost", 4, 15)
    for _ in range(6):  # every draft accepted, drafts cheap: k climbs to the cap
        k = sure.update([sure.k], [sure.k], sure.k, 0.01 * sure.k)
    assert k == 15
    poor = make_schedule("cost", 4, 15)
    for _ in range(6):  # nothing accepted, drafts as dear as a verify: one draft a round
        k = poor.update([0], [poor.k], poor.k, 1.0 * poor.k)
    assert k == 1
    batch = make_schedule("cost", 4, 15)  # a batch: every row's drafts and rejections count
    batch.update([4, 1], [4, 4], 4, 0.4)
    assert batch.alpha == (5 + 0.5) / (5 + 1 + 1)


def test_the_cost_is_the_draft_passes_weight_bytes_over_a_verify_pass():
    base = tiny_model("llama")
    river = river_copy(base, config=RiverConfig(lossless=True))
    L = river.river.num_layers
    full = river.river_step_bytes(L)
    assert bytes_cost(river, [L]) == 1.0
    assert bytes_cost(river, [0, 2]) == (river.river_step_bytes(0) + river.river_step_bytes(2)) / full
    assert 0.0 < bytes_cost(river, [0]) < 0.5  # every layer its 4-bit exit copy


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_schedule_gives_the_plain_models_tokens(schedule):
    """The exactness switch: lossless is the plain model's greedy output, one row and a padded batch."""
    base = tiny_model("qwen2")
    river = river_copy(base, config=RiverConfig(lossless=True, draft_tokens=2, max_draft_tokens=6,
                                                draft_schedule=schedule))
    ids = prompt(12)
    assert torch.equal(river.generate(ids, max_new_tokens=30, **GEN), base.generate(ids, max_new_tokens=30, **GEN))
    assert river.river_stats["lossless"]["drafts_per_verify"] <= 6
    ids, mask = left_padded()
    ref = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **GEN)
    assert torch.equal(river.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **GEN), ref)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_seeded_sampling_call_draws_the_same_tokens_every_time(batch):
    """k comes from the tokens alone (no clock): the same seed, the same rounds, the same tokens."""
    base = tiny_model("qwen2")
    river = river_copy(base, config=RiverConfig(lossless=True, draft_tokens=2, max_draft_tokens=8))
    ids, mask = left_padded(lengths=(12, 9, 5)[:batch])
    outs = []
    for _ in range(3):
        torch.manual_seed(7)
        outs.append(river.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=True,
                                   temperature=1.5))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_a_schedule_registered_later_is_accepted_by_the_config():
    from river_hf.river.draft_schedule import ConstantSchedule, register_schedule

    @register_schedule
    class Twice(ConstantSchedule):
        name = "test-twice"

        def update(self, accepted, judged, draft_passes, draft_cost):
            self.k = min(2 * self.k, self.most)
            return self.k

    try:
        assert RiverConfig(draft_schedule="test-twice").draft_schedule == "test-twice"
        s = make_schedule("test-twice", 2, 5)
        assert [s.update([2], [2], 2, 0.2), s.update([4], [4], 4, 0.4)] == [4, 5]
        with pytest.raises(RiverError, match="1 <= first"):
            make_schedule("test-twice", True, 5)
    finally:
        SCHEDULES.pop("test-twice")
