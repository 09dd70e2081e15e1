"""The weights' layout chosen again while serving: what the layout in place loses on the steps run, against
what a change costs (rent or buy); the change made one weight at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmserve.runtime import matmul_forms
from mmserve.runtime.matmul_forms import MatmulForms, onednn_packing_available
from mmserve.runtime.weight_layout import LayoutPolicy, WeightLayout, step_costs, weight_layout

# Shaped as one CPU timed them (docs/benchmarks.md): packed loses at 1-2 rows, wins at 8, ties on a chunk.
COSTS = {2: {1: (5.0, 7.0), 2: (6.0, 8.0), 8: (11.0, 8.0), 256: (35.0, 34.0)},
         1: {1: (8.0, 9.0), 8: (20.0, 10.0), 256: (70.0, 70.0)}}


def test_a_step_is_priced_at_the_nearest_timed_threads_interpolated_between_timed_rows() -> None:
    assert step_costs(COSTS, 2, 1) == (5.0, 7.0)
    assert step_costs(COSTS, 4, 8) == (11.0, 8.0)  # 4 threads: the nearest timed count, 2
    assert step_costs(COSTS, 2, 5) == pytest.approx((8.5, 8.0))  # halfway from 2 to 8 rows
    assert step_costs(COSTS, 2, 132) == pytest.approx((23.0, 21.0))  # halfway from 8 to 256
    assert step_costs(COSTS, 2, 512) == (70.0, 68.0)  # past the largest timed: by rows
    assert step_costs(COSTS, 1, 1) == (8.0, 9.0)


def policy(change_s: float = 5.0, timed_share: float = 1.0) -> LayoutPolicy:
    return LayoutPolicy(COSTS, timed_share=timed_share, change_s={True: change_s, False: change_s}, close=0.05)


def test_a_step_loses_what_the_layout_in_place_takes_beyond_close_of_the_other() -> None:
    p = policy()
    assert p.excess(1, 2, packed_now=True) == pytest.approx(7.0 - 5.0 * 1.05)
    assert p.excess(1, 2, packed_now=False) == pytest.approx(5.0 - 7.0 * 1.05)  # plain wins: negative
    assert p.excess(256, 2, packed_now=False) < 0  # plain 3% slower on a chunk: within close, it takes back
    # timings of a quarter of the weights' bytes: a step reads them all, and loses 4x as much
    assert policy(timed_share=0.25).excess(1, 2, packed_now=True) == pytest.approx(4 * (7.0 - 5.25))


def test_the_layout_changes_once_staying_has_lost_what_a_change_that_way_costs() -> None:
    p = LayoutPolicy(COSTS, timed_share=1.0, change_s={True: 100.0, False: 5.0}, close=0.05)
    for _ in range(2):
        p.observe(1, 2, packed_now=True)  # a lone client's decodes on packed weights: 1.75 lost each
    assert not p.due(packed_now=True)
    p.observe(1, 2, packed_now=True)
    assert p.due(packed_now=True) and p.loss == pytest.approx(5.25)  # 5.25 >= 5, the cost of going plain
    assert not p.due(packed_now=False)  # going packed would cost 100
    p.freeze()
    assert not p.due(packed_now=True)


def test_steps_the_layout_wins_take_back_from_the_loss_but_never_below_zero() -> None:
    p = policy()
    p.observe(1, 2, packed_now=True)
    p.observe(1, 2, packed_now=True)  # 3.5 lost
    p.observe(8, 2, packed_now=True)  # packed wins by 11 x 1.05 - 8 = 3.55: back to 0, not below
    assert p.loss == 0.0 and not p.due(packed_now=True)
    for _ in range(5):
        p.observe(8, 2, packed_now=True)
    assert p.loss == 0.0  # a loaded server's steps keep the packed weights
    for _ in range(3):
        p.observe(1, 2, packed_now=True)
    assert p.due(packed_now=True)  # the last steps' losses count in full


def test_a_mix_near_the_balance_changes_nothing() -> None:
    p = policy(change_s=6.0)
    for _ in range(100):  # 3 decodes of 1 row for 2 of 8: 37 ms either way; a run of 1-row steps loses 5.25
        for rows in (1, 1, 1, 8, 8):
            p.observe(rows, 2, packed_now=True)
            assert not p.due(packed_now=True)


def test_the_policy_refuses_without_timings_of_both_layouts() -> None:
    no_timings: list[dict[int, dict[int, tuple[float, float]]]] = [{}, {2: {}}]
    for costs in no_timings:
        with pytest.raises(ValueError, match="timings"):
            LayoutPolicy(costs, timed_share=1.0, change_s={True: 1.0, False: 1.0}, close=0.05)


class Weights:
    """Stands in for a model: which of its weights are packed, and the packing set for re-laid ones."""

    def __init__(self, n: int, packed: bool, fail_at: int | None = None) -> None:
        self.packed, self.rows, self.fail_at = [packed] * n, 64 if packed else None, fail_at
        self.relaid: list[int] = []

    def packing(self, rows: int | None) -> None:
        self.rows = rows

    def relayout(self, index: int) -> None:
        if index == self.fail_at:
            raise RuntimeError("no memory for the new copy")
        self.packed[index] = self.rows is not None
        self.relaid.append(index)


def driver(n: int, packed: bool, fail_at: int | None = None) -> tuple[WeightLayout, Weights]:
    weights = Weights(n, packed, fail_at)
    layout = WeightLayout(policy(), num_weights=n, packed=packed, pack_rows=64, packing=weights.packing,
                          relayout=weights.relayout)
    return layout, weights


def step(layout: WeightLayout, rows: int) -> None:
    """What the decoder does around a step: re-lay one weight before it, price it after."""
    layout.relay_one()
    layout.observe(rows, 2)


def test_a_new_layout_is_taken_one_weight_per_step_and_priced_again_only_once_settled() -> None:
    layout, weights = driver(3, packed=True)
    for _ in range(2):
        step(layout, 1)
    assert weights.relaid == [] and layout.packed  # 3.5 lost of the 5 a change costs
    step(layout, 1)  # 5.25: plain from now on
    assert not layout.packed and layout.changes == [False] and weights.rows is None
    assert weights.relaid == [] and not layout.settled and layout.policy.loss == 0.0
    for n in range(2):
        step(layout, 8)  # re-laying: steps on weights of both layouts are not priced
        assert weights.relaid == list(range(n + 1)) and layout.policy.loss == 0.0
    step(layout, 8)  # its last weight re-laid before it: a plain step, which loses 11 - 8 x 1.05 = 2.6
    assert layout.settled and weights.packed == [False] * 3
    assert not layout.packed and layout.policy.loss == pytest.approx(2.6)  # short of the 5 of going packed
    assert layout.policy.change_s == {True: 5.0, False: pytest.approx(0.0, abs=0.01)}  # what it took (s)
    step(layout, 8)
    assert layout.packed and layout.changes == [False, True] and weights.rows == 64


def test_taking_the_layout_at_once_relays_every_weight_now() -> None:
    layout, weights = driver(5, packed=False)
    layout.take(True, at_once=True)
    assert layout.settled and weights.packed == [True] * 5 and weights.rows == 64
    layout.take(True, at_once=True)  # already so: nothing re-laid again
    assert weights.relaid == list(range(5))
    layout.take(False)
    layout.relay_one()
    layout.finish()  # the rest of a change under way, now
    assert layout.settled and weights.packed == [False] * 5 and weights.relaid == [*range(5), *range(5)]


def test_a_failed_relay_ends_the_change_where_it_is_and_no_other_is_made() -> None:
    layout, weights = driver(4, packed=True, fail_at=2)
    layout.take(False)
    for _ in range(3):
        layout.relay_one()  # the third fails: logged, not raised
    assert layout.settled and weights.packed == [False, False, True, True]
    for _ in range(50):
        step(layout, 8)
        step(layout, 1)
    assert layout.changes == [False] and weights.relaid == [0, 1]


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN packing")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_packed_and_relaid_plain_again_is_the_very_same_weight(dtype: torch.dtype) -> None:
    forms, w = MatmulForms(), torch.randn(80, 48).to(dtype)
    forms.packing(16)
    try:
        packed = forms.relaid(w)
    except RuntimeError:
        pytest.skip(f"this CPU's oneDNN cannot pack {dtype}")
    assert packed.is_mkldnn and forms.relaid(packed) is packed
    forms.packing(None)
    plain = forms.relaid(packed)
    assert not plain.is_mkldnn and plain.dtype == dtype and torch.equal(plain, w)
    # weights in both layouts at once, as while the model is re-laid: each product by its weight's layout
    x = torch.randn(3, 48).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(forms.product(x, packed), F.linear(x, w), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(forms.product(x, plain), F.linear(x, w), rtol=tolerance, atol=tolerance)


def test_no_layout_is_chosen_while_serving_where_packing_was_not_timed() -> None:
    forms = MatmulForms()
    assert weight_layout(forms, 4, lambda i: None) is None  # never calibrated
    forms.costs, forms.pack_hint, forms.timed_share = {2: {1: (1.0, 2.0)}}, 256, 0.5
    forms.relayout_seconds = {True: 0.04, False: 0.03}
    layout = weight_layout(forms, 4, lambda i: None)
    assert layout is not None and not layout.packed and layout.pack_rows == 256
    assert layout.policy.change_s == {True: 0.04, False: 0.03} and layout.policy.timed_share == 0.5


def test_calibration_times_relaying_every_weight_and_the_share_of_them_it_timed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul_forms, "COLD_BYTES", 3 * 64 * 32 * 4)  # 3 of the 4 weights
    forms, weights = MatmulForms(), [torch.randn(64, 32) for _ in range(4)]
    forms.calibrate(weights, {1, 2}, max_rows=2, big_rows=16, rounds=1)
    forms.calibrate(weights, {1}, max_rows=2, big_rows=16, rounds=1)  # again: the last timings only
    assert forms.timed_share == 0.75
    if onednn_packing_available():
        assert forms.relayout_seconds[True] > 0 and forms.relayout_seconds[False] > 0
        assert forms.pack_hint == 16 and set(forms.costs) == {1} and set(forms.costs[1]) == {1, 2, 16}
    with pytest.raises(ValueError, match="packed"):
        forms.packing(16)
        forms.calibrate([forms.relaid(w) for w in weights], {1}, max_rows=2, big_rows=16, rounds=1)


def test_new_timings_price_the_next_steps_afresh() -> None:
    p = policy()
    assert p.excess(1, 2, packed_now=True) > 0  # priced, and kept for the next step of this size
    p.costs = {2: {1: (7.0, 5.0)}}  # packed now the faster at 1 row
    assert p.excess(1, 2, packed_now=True) == pytest.approx(5.0 - 7.0 * 1.05)


def test_products_stop_checking_their_weights_layout_once_every_weight_is_plain_again() -> None:
    forms = MatmulForms()
    assert forms.product is F.linear  # nothing measured, nothing packed
    forms.packing(64)
    forms.packing(None)  # going plain: until every weight is re-laid, each product checks its own
    assert forms.product is not F.linear
    forms.all_plain()
    assert forms.product is F.linear
    weights, told = Weights(2, packed=True), []
    layout = WeightLayout(policy(), num_weights=2, packed=True, pack_rows=64, packing=weights.packing,
                          relayout=weights.relayout, all_plain=lambda: told.append(not any(weights.packed)))
    layout.take(False)
    layout.relay_one()
    assert told == []  # one weight still packed
    layout.relay_one()
    assert told == [True]  # settled plain: told once, with every weight plain
