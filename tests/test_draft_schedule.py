"""Lossless mode's draft-length schedules (river_hf.river.draft_schedule): the rules on scripted
round outcomes, and the exactness switch (lossless gives the plain model's tokens) under each."""

from __future__ import annotations

import pytest
import torch

from river_hf import RiverConfig, RiverError
from river_hf.river.draft_schedule import SCHEDULES, bytes_cost, expected_tokens_per_cost, make_schedule, row_cost_curve
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


def test_row_cost_curve_interpolates_and_extends_its_end_segments():
    v = row_cost_curve([(16, 1.0), (1, 1.0), (64, 2.5), (32, 1.5)])  # any order in, sorted
    assert v.points == ((1, 1.0), (16, 1.0), (32, 1.5), (64, 2.5))
    assert [v(1), v(8), v(24), v(48), v(64)] == [1.0, 1.0, 1.25, 2.0, 2.5]
    assert v(128) == 4.5 and v(0) == 1.0  # past the ends: along the end segments
    assert row_cost_curve([(1, 1.0), (2, 0.0)])(10) == 0.0  # never below 0
    for bad in ([(1, 1.0)], [(1, 1.0), (1, 2.0)]):
        with pytest.raises(ValueError, match="two or more distinct"):
            row_cost_curve(bad)


def test_cost_schedule_prices_the_verify_by_its_rows():
    """With v(R) the verify's cost at R = rows x (k + 1), the k taken maximises
    (1 - a^(k+1)) / ((1 - a)(k c + v(R))): a batch of 4 whose verifies turn dear past 16 rows
    drafts shorter than one row does, or than a batch priced flat (the paper's v = 1)."""
    v = row_cost_curve([(1, 1.0), (16, 1.0), (32, 1.2), (64, 2.7), (128, 5.4)])
    outcomes = ([15] * 4, [15] * 4, 15, 0.125 * 15)  # every row accepted all 15 drafts
    one, flat, priced = make_schedule("cost", 15, 15, v), make_schedule("cost", 15, 15), make_schedule("cost", 15, 15, v)
    k_one = one.update(outcomes[0][:1], outcomes[1][:1], outcomes[2], outcomes[3])
    k_flat, k_priced = flat.update(*outcomes), priced.update(*outcomes)
    assert k_one == k_flat == 15  # one row: 16 rows cost one pass, as the flat price says
    alpha, c = (60 + 0.5) / (60 + 0 + 1), 0.125
    assert k_priced == max(range(1, 16), key=lambda n: expected_tokens_per_cost(alpha, n, c, v(4 * (n + 1))))
    assert k_priced < 15


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


def test_verify_row_costs_are_measured_once_on_the_verify_kernel_and_reported(monkeypatch, tmp_path):
    """The curve's points: the backbone's MLP shape timed at each of COST_ROWS on the kernel the
    verify mode runs that many rows on, over that kernel's one-row time; cached on the model, in
    kernels.json, and reported in river_stats; None without a tuner (RIVER_HF_AUTOTUNE=0)."""
    from river_hf.quant.dense import PrepackedLinear
    from river_hf.river import verify_kernel

    base = tiny_model("qwen2")
    river = river_copy(base, config=RiverConfig(lossless=True))
    assert verify_kernel.verify_row_costs(river, None) is None  # RIVER_HF_AUTOTUNE=0 in the tests
    timed = []

    def measure(i, o, rows, **kw):  # oneDNN: flat to 16 rows, then linear in the rows; F.linear: linear from 1
        timed.append(rows)
        return {"torch": 10.0 * rows, "onednn": 100.0 * max(1.0, rows / 16)}

    monkeypatch.setattr(PrepackedLinear, "measure", staticmethod(measure))
    monkeypatch.delenv("RIVER_HF_AUTOTUNE", raising=False)
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path))

    class Mode:  # a verify mode that reroutes 2..64 rows to oneDNN
        min_rows, max_rows = 2, 64

    v = verify_kernel.verify_row_costs(river, Mode())
    assert sorted(timed) == list(verify_kernel.COST_ROWS)
    # 1 and 128 rows on F.linear (10 us a row over 10 us), 8..64 on oneDNN (over oneDNN's 100 us at one row)
    assert v.points == ((1, 1.0), (8, 1.0), (16, 1.0), (32, 2.0), (64, 4.0), (128, 128.0))
    assert verify_kernel.verify_row_costs(river, None) is v and len(timed) == len(verify_kernel.COST_ROWS)
    other = river_copy(base, config=RiverConfig(lossless=True))  # another model: kernels.json, no timing
    assert verify_kernel.verify_row_costs(other, Mode()).points == v.points and len(timed) == len(verify_kernel.COST_ROWS)
    river.generate(prompt(), max_new_tokens=8, **GEN)
    assert river.river_stats["lossless"]["verify_row_costs"] == [list(p) for p in v.points]
