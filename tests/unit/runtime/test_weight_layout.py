"""The weights' layout chosen again while serving: priced by the steps run, changed one weight per step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmserve.runtime import matmul_forms
from mmserve.runtime.matmul_forms import MatmulForms, onednn_packing_available
from mmserve.runtime.weight_layout import LayoutPolicy, WeightLayout, step_costs, weight_layout

# As one CPU timed them (docs/benchmarks.md): packed loses at 1-2 rows, wins at 8, ties on a prefill chunk.
COSTS = {2: {1: (5.0, 7.0), 2: (6.0, 8.0), 8: (11.0, 8.0), 256: (35.0, 34.0)},
         1: {1: (8.0, 9.0), 8: (20.0, 10.0), 256: (70.0, 70.0)}}


def test_a_step_is_priced_at_the_nearest_timed_threads_and_rows_scaled_by_rows() -> None:
    assert step_costs(COSTS, 2, 1) == (5.0, 7.0)
    assert step_costs(COSTS, 4, 8) == (11.0, 8.0)  # 4 threads: the nearest timed count, 2
    assert step_costs(COSTS, 2, 16) == (22.0, 16.0)  # nearer 8 than 256 in ratio, twice its rows
    assert step_costs(COSTS, 2, 128) == pytest.approx((17.5, 17.0))  # nearer 256: half its rows
    assert step_costs(COSTS, 1, 1) == (8.0, 9.0)


def policy(change_s: float = 10.0, timed_share: float = 1.0) -> LayoutPolicy:
    return LayoutPolicy(COSTS, timed_share=timed_share, change_s=change_s, close=0.05)


def test_a_step_loses_what_the_layout_in_place_takes_beyond_close_of_the_other() -> None:
    p = policy()
    assert p.excess(1, 2, packed_now=True) == pytest.approx(7.0 - 5.0 * 1.05)
    assert p.excess(1, 2, packed_now=False) == pytest.approx(5.0 - 7.0 * 1.05)  # plain wins: negative
    assert p.excess(256, 2, packed_now=False) < 0  # packed 3% faster on a chunk: within close, no loss
    # timings of a quarter of the weights' bytes: a step reads them all, and loses 4x as much
    assert policy(timed_share=0.25).excess(1, 2, packed_now=True) == pytest.approx(4 * (7.0 - 5.25))


def test_the_layout_changes_once_staying_has_lost_what_a_change_costs() -> None:
    p = policy(change_s=5.0)
    for _ in range(2):
        p.observe(1, 2, packed_now=True)  # a lone client's decodes on packed weights: 1.75 lost each
    assert not p.due()
    p.observe(1, 2, packed_now=True)
    assert p.due() and p.loss == pytest.approx(5.25)


def test_steps_the_layout_wins_take_back_from_the_loss_but_never_below_zero() -> None:
    p = policy(change_s=5.0)
    p.observe(1, 2, packed_now=True)
    p.observe(1, 2, packed_now=True)  # 3.5 lost
    p.observe(8, 2, packed_now=True)  # packed wins by 11 x 1.05 - 8 = 3.55: back to 0, not below
    assert p.loss == 0.0 and not p.due()
    for _ in range(5):
        p.observe(8, 2, packed_now=True)
    assert p.loss == 0.0  # a loaded server's steps keep the packed weights
    for _ in range(3):
        p.observe(1, 2, packed_now=True)
    assert p.due()  # the last steps' losses count in full


def test_a_mix_near_the_balance_changes_nothing() -> None:
    p = policy(change_s=6.0)
    for _ in range(100):  # 3 decodes of 1 row for 2 of 8: 37 ms either way; a run of 1-row steps loses 5.25
        for rows in (1, 1, 1, 8, 8):
            p.observe(rows, 2, packed_now=True)
            assert not p.due()


def test_the_policy_refuses_without_timings_of_both_layouts() -> None:
    with pytest.raises(ValueError, match="timings"):
        LayoutPolicy({}, timed_share=1.0, change_s=1.0, close=0.05)
    with pytest.raises(ValueError, match="timings"):
        LayoutPolicy({2: {}}, timed_share=1.0, change_s=1.0, close=0.05)


class Weights:
    """Stands in for a model: which of its weights are packed, and the packing set for re-laid ones."""

    def __init__(self, n: int, packed: bool) -> None:
        self.packed, self.rows = [packed] * n, 64 if packed else None
        self.relaid: list[int] = []

    def packing(self, rows: int | None) -> None:
        self.rows = rows

    def relayout(self, index: int) -> None:
        self.packed[index] = self.rows is not None
        self.relaid.append(index)


def driver(n: int, packed: bool, change_s: float = 5.0) -> tuple[WeightLayout, Weights]:
    weights = Weights(n, packed)
    layout = WeightLayout(policy(change_s), num_weights=n, packed=packed, pack_rows=64, packing=weights.packing,
                          relayout=weights.relayout)
    return layout, weights


def test_a_new_layout_is_taken_one_weight_per_step_and_priced_again_only_once_settled() -> None:
    layout, weights = driver(3, packed=True)
    for _ in range(2):
        layout.after_step(1, 2)
    assert weights.relaid == [] and layout.packed  # 3.5 lost of the 5 a change costs
    layout.after_step(1, 2)  # 5.25: plain from now on
    assert not layout.packed and layout.changes == [False] and weights.rows is None
    assert weights.relaid == [] and not layout.settled and layout.policy.loss == 0.0
    for step in range(3):
        layout.after_step(8, 2)  # re-laying: these steps are not priced
        assert weights.relaid == list(range(step + 1)) and layout.policy.loss == 0.0
    assert layout.settled and weights.packed == [False] * 3
    assert layout.policy.change_s < 1.0  # the next change is priced at what this one took (s)
    layout.after_step(8, 2)  # plain loses 11 - 8 x 1.05 = 2.6 on a step of 8 rows: more than this change took
    assert layout.packed and layout.changes == [False, True] and weights.rows == 64


def test_taking_the_layout_at_once_relays_every_weight_now() -> None:
    layout, weights = driver(5, packed=False)
    layout.take(True, at_once=True)
    assert layout.settled and weights.packed == [True] * 5 and weights.rows == 64
    layout.take(True, at_once=True)  # already so: nothing re-laid again
    assert weights.relaid == list(range(5))
    layout.take(False)
    layout.after_step(1, 2)
    layout.finish()  # the rest of a change under way, now
    assert layout.settled and weights.packed == [False] * 5 and weights.relaid == [*range(5), *range(5)]


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN packing")
def test_a_weight_packed_and_relaid_plain_again_is_the_very_same_weight() -> None:
    forms, w = MatmulForms(), torch.randn(80, 48)
    forms.packing(16)
    packed = forms.relaid(w)
    assert packed.is_mkldnn and forms.relaid(packed) is packed
    forms.packing(None)
    plain = forms.relaid(packed)
    assert not plain.is_mkldnn and torch.equal(plain, w)
    x = torch.randn(3, 48)
    # weights in both layouts at once, as while the model is re-laid: each product by its weight's layout
    torch.testing.assert_close(forms.product(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(forms.product(x, plain), F.linear(x, w))


def test_no_layout_is_chosen_while_serving_where_packing_was_not_timed() -> None:
    forms = MatmulForms()
    assert weight_layout(forms, 4, lambda i: None) is None  # never calibrated
    forms.costs, forms.pack_hint, forms.pack_seconds, forms.timed_share = {2: {1: (1.0, 2.0)}}, 256, 0.04, 0.5
    layout = weight_layout(forms, 4, lambda i: None)
    assert layout is not None and not layout.packed and layout.pack_rows == 256
    assert layout.policy.change_s == 0.04 and layout.policy.timed_share == 0.5


def test_calibration_times_what_packing_every_weight_takes_and_the_share_it_timed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul_forms, "COLD_BYTES", 3 * 64 * 32 * 4)  # 3 of the 4 weights
    forms = MatmulForms()
    forms.calibrate([torch.randn(64, 32) for _ in range(4)], {1}, max_rows=2, big_rows=16, rounds=1)
    assert forms.timed_share == 0.75
    if onednn_packing_available():
        assert forms.pack_seconds > 0 and forms.pack_hint == 16 and set(forms.costs[1]) == {1, 2, 16}
