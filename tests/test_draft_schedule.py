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


def test_cost_schedule_survival_is_the_product_limit_estimate_shrunk_to_iid():
    """S(j) multiplies 1 - (rejected_j + (1 - a)) / (reached_j + 1) over the positions (one
    pseudo-row of the i.i.d. model each), a = (accepted + 1/2) / (accepted + rejections + 1); with
    no round seen it is the i.i.d. model, S(j) = a^j, whose tokens are Leviathan et al.'s."""
    fresh = make_schedule("cost", 4, 15)
    assert fresh.survival(5) == pytest.approx([0.5 ** j for j in range(1, 6)])
    assert 1 + sum(fresh.survival(5)) == pytest.approx(expected_tokens_per_cost(0.5, 5, 0.0))
    s = make_schedule("cost", 4, 15)
    k = s.update([2, 4], [4, 4], 4, 0.5)  # a batch of 2: row 0 rejected its draft 3, row 1 took all 4
    assert (s.reached, s.rejected) == ([2, 2, 2, 1], [0, 0, 1, 0])
    a = (6 + 0.5) / (6 + 1 + 1)
    q = 1 - a
    want, surv = [], 1.0
    for r in [1 - q / 3, 1 - q / 3, 1 - (1 + q) / 3, 1 - q / 2] + [a] * 11:
        surv *= r
        want.append(surv)
    assert s.survival(15) == pytest.approx(want)
    c = 0.5 / 4  # the drafts' cost per pass; no verify cost given: one pass whatever the rows
    assert k == max(range(1, 16), key=lambda n: (1 + sum(want[:n])) / (n * c + 1))


def test_cost_schedule_follows_runs_of_acceptance_and_rejection():
    sure = make_schedule("cost", 4, 15)
    for _ in range(3):  # every draft accepted, drafts cheap: k climbs to the cap
        k = sure.update([sure.k], [sure.k], sure.k, 0.01 * sure.k)
    assert k == 15
    poor = make_schedule("cost", 4, 15)
    for _ in range(6):  # nothing accepted, drafts as dear as a verify: one draft a round
        k = poor.update([0], [poor.k], poor.k, 1.0 * poor.k)
    assert k == 1
    early = make_schedule("cost", 15, 15)
    for _ in range(4):  # every round rejects its 5th draft: k stops near there, not at the cap
        k = early.update([4], [early.k], early.k, 0.125 * early.k)
    assert 4 <= k <= 6


#: a verify pass's cost by its rows as measured on a 2-core machine (a one-row pass = 1)
MEASURED = ((1, 1.0), (8, 1.02), (16, 1.40), (32, 2.35), (64, 4.23), (128, 8.30))


def test_cost_schedule_prices_the_verify_by_its_rows():
    """One row that took all 15 drafts keeps k = 15 though its 16-row verify costs 1.4 one-row
    passes; a batch of 4 that rejects drafts drafts shorter when its verify is priced at 4 (k + 1)
    rows than when every verify is priced as one pass (cost-flat, the paper's)."""
    v = row_cost_curve(MEASURED)
    one = make_schedule("cost", 15, 15, v)
    assert one.update([15], [15], 15, 0.125 * 15) == 15
    outcomes = ([15, 6, 15, 9], [15] * 4, 15, 0.125 * 15)  # acceptance 45/60
    priced, flat = make_schedule("cost", 15, 15, v), make_schedule("cost-flat", 15, 15, v)
    k_priced, k_flat = priced.update(*outcomes), flat.update(*outcomes)
    assert k_priced < k_flat and flat.verify_cost(64) == 1.0


def test_row_cost_curve_interpolates_and_extends_its_end_segments():
    v = row_cost_curve([(16, 1.0), (1, 1.0), (64, 2.5), (32, 1.5)])  # any order in, sorted
    assert v.points == ((1, 1.0), (16, 1.0), (32, 1.5), (64, 2.5))
    assert [v(1), v(8), v(24), v(48), v(64)] == [1.0, 1.0, 1.25, 2.0, 2.5]
    assert v(128) == 4.5 and v(0) == 1.0  # past the ends: along the end segments
    assert row_cost_curve([(1, 1.0), (2, 0.0)])(10) == 0.0  # never below 0
    for bad in ([(1, 1.0)], [(1, 1.0), (1, 2.0)]):
        with pytest.raises(ValueError, match="two or more distinct"):
            row_cost_curve(bad)


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
    verify mode runs that many rows on, over the fastest one-row time of the mode's kernels
    (F.linear included); cached on the model, in kernels.json, and reported in river_stats; None
    without a tuner (RIVER_HF_AUTOTUNE=0)."""
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
    monkeypatch.setattr(verify_kernel, "river_fp32_works", lambda: False)  # F.linear against oneDNN only
    monkeypatch.delenv("RIVER_HF_AUTOTUNE", raising=False)
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path))

    class Mode:  # a verify mode that reroutes 2..64 rows to oneDNN
        min_rows, max_rows = 2, 64

    v = verify_kernel.verify_row_costs(river, Mode())
    assert sorted(timed) == list(verify_kernel.COST_ROWS)
    # 1 and 128 rows on F.linear (10 us a row), 8..64 on oneDNN; all over F.linear's 10 us at one row,
    # the fastest one-row pass here (not over oneDNN's own 100 us: a verify's cost against the drafts')
    assert v.points == ((1, 1.0), (8, 10.0), (16, 10.0), (32, 20.0), (64, 40.0), (128, 128.0))
    assert verify_kernel.verify_row_costs(river, None) is v and len(timed) == len(verify_kernel.COST_ROWS)
    other = river_copy(base, config=RiverConfig(lossless=True))  # another model: kernels.json, no timing
    assert verify_kernel.verify_row_costs(other, Mode()).points == v.points and len(timed) == len(verify_kernel.COST_ROWS)
    river.generate(prompt(), max_new_tokens=8, **GEN)
    assert river.river_stats["lossless"]["verify_row_costs"] == [list(p) for p in v.points]


def test_verify_row_costs_count_a_verify_past_the_grid_in_one_row_grid_passes(monkeypatch, tmp_path):
    """With river-grid taking 1..4 rows at a third of oneDNN's one-row time, a verify of 8 rows on
    oneDNN costs three one-row passes (the unit the drafts' bytes_cost is in), not one."""
    from river_hf.quant.dense_river import RiverFp32Linear
    from river_hf.quant.grid import GridLinear
    from river_hf.river import verify_kernel

    def measure(i, o, rows, **kw):
        return {"torch": 90.0 * rows, "onednn": 90.0 * max(1.0, rows / 16), "river-fp32": 90.0 * rows,
                "river-grid": 30.0 * rows}

    monkeypatch.setattr(RiverFp32Linear, "measure", staticmethod(measure))
    monkeypatch.setattr(verify_kernel, "river_fp32_works", lambda: True)
    monkeypatch.delenv("RIVER_HF_AUTOTUNE", raising=False)
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path))

    class OneDNN:  # the verify mode under the grid: 2..64 rows on oneDNN
        min_rows, max_rows = 2, 64

    grid = GridLinear({}, min_rows=1, max_rows=4, fallback=OneDNN())
    v = verify_kernel.verify_row_costs(river_copy(tiny_model("qwen2"), config=RiverConfig(lossless=True)), grid)
    assert v.points == ((1, 1.0), (8, 3.0), (16, 3.0), (32, 6.0), (64, 12.0), (128, 384.0))
