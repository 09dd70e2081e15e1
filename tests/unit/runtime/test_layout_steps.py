"""The weights' two layouts priced by whole steps at start-up: every step shape at every thread count in both
layouts, in A B B A blocks, the weights ending where they began, and the policy weighing what steps took."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from unittest import mock

import pytest
import torch

from mmserve.config import DecoderConfig
from mmserve.runtime import step_threads
from mmserve.runtime.layout_steps import price_by_steps
from mmserve.runtime.step_threads import StepThreads
from mmserve.runtime.weight_layout import LayoutPolicy, WeightLayout

# what the products timed alone said: packed loses at 1 row and ties at 8 (the policy would keep plain weights)
ALONE = {1: {1: (5.0, 7.0), 8: (10.0, 10.0)}, 2: {1: (4.0, 6.0), 8: (8.0, 8.0)}}
# whole steps: packed loses at 1 row and wins at 8 by far more than the products alone said
STEPS = {(1, 1): (6.0, 7.0), (8, 1): (20.0, 14.0), (1, 2): (4.0, 5.0), (8, 2): (12.0, 9.0)}
RELAY_S = {True: 0.25, False: 0.125}  # what re-laying one weight takes, packed (True) or plain (fake seconds)
SETUP_S = 100.0  # a layout's first step of a shape (oneDNN's set-up)


class Model:
    """Weights whose layout makes its steps take fake time: a step's (plain, packed) seconds by rows and threads.
    `fail_step` / `fail_relay`: how many steps / re-lays run before one fails (None: none fails)."""

    def __init__(self, n: int, packed: bool, fail_step: int | None = None, fail_relay: int | None = None) -> None:
        self.packed, self.now, self.fail_step, self.fail_relay = [packed] * n, 0.0, fail_step, fail_relay
        self.rows: int | None = 64 if packed else None
        self.steps: list[tuple[int, int, bool]] = []  # (rows, threads, whether every weight was packed)
        self.relays = 0
        self.plain_again = 0  # calls of `all_plain`

    def packing(self, rows: int | None) -> None:
        self.rows = rows

    def relayout(self, index: int) -> None:
        if self.relays == self.fail_relay:
            self.fail_relay = None
            raise RuntimeError("no memory for the new copy")
        self.packed[index] = self.rows is not None
        self.relays += 1
        self.now += RELAY_S[self.rows is not None]

    def all_plain(self) -> None:
        assert not any(self.packed)
        self.plain_again += 1

    def step(self, rows: int, threads: int) -> None:
        """A step of `rows` new tokens run at the `threads` StepThreads.apply set."""
        if len(self.steps) == self.fail_step:
            raise RuntimeError("the scratch step failed")
        packed = all(self.packed)
        assert packed or not any(self.packed), "a step ran with the weights half re-laid"
        first = (rows, threads, packed) not in self.steps
        self.steps.append((rows, threads, packed))
        self.now += STEPS[(rows, threads)][packed] + (SETUP_S if first else 0.0)

    def clock(self) -> float:
        return self.now


def priced(packed: bool = False, rounds: int = 2, per_block: int = 1, fail_step: int | None = None,
           fail_relay: int | None = None, observed: bool = False) -> tuple[WeightLayout, Model, StepThreads]:
    """`observed`: each step priced by the layout too, as the decoder does with a layout in use."""
    model = Model(3, packed, fail_step, fail_relay)
    policy = LayoutPolicy(ALONE, timed_share=0.5, change_s={True: 1.0, False: 1.0}, close=0.05)
    layout = WeightLayout(policy, num_weights=3, packed=packed, pack_rows=64, packing=model.packing,
                          relayout=model.relayout, all_plain=model.all_plain)
    threads = StepThreads(torch.device("cpu"), DecoderConfig(small_step_threads=1, big_step_threads=2))
    threads.available = 2
    before = torch.get_num_threads()

    def run(rows: int) -> None:
        count = threads.apply(rows)
        model.step(rows, count)
        if observed:
            layout.observe(rows, count)

    try:
        steps: dict[int, Callable[[], object]] = {rows: functools.partial(run, rows) for rows in (1, 8)}
        price_by_steps(layout, threads, steps, rounds=rounds, per_block=per_block, clock=model.clock)
    finally:
        torch.set_num_threads(before)
    return layout, model, threads


@pytest.mark.parametrize("start", [False, True])
def test_every_shape_is_timed_at_every_thread_count_in_both_layouts_a_b_b_a(start: bool) -> None:
    layout, model, threads = priced(packed=start, per_block=2)
    # blocks A B B A twice, each block every count and shape twice; the first of each (layout, count, shape)
    # untimed
    blocks = [start, not start, not start, start] * 2
    timed_per_block = [(rows, count) for count in (1, 2) for rows in (1, 8)]
    runs = iter(model.steps)
    warmed: set[tuple[int, int, bool]] = set()
    for key in [(rows, count, packed) for packed in blocks for rows, count in timed_per_block]:
        if key not in warmed:
            assert next(runs) == key  # its untimed step first
            warmed.add(key)
        assert next(runs) == next(runs) == key
    assert next(runs, None) is None
    # where it began, the pack setting too, and no change recorded
    assert layout.packed == start and all(p == start for p in model.packed) and (model.rows is not None) == start
    assert layout.changes == [] and model.relays == 4 * 3  # re-laid 4 times, every weight each time
    assert model.plain_again == 2  # each time the weights went plain again, the products were told
    assert threads.small == 1 and threads.big == 2 and threads.trials == {}  # counts as configured again


@pytest.mark.parametrize("observed", [False, True])
def test_the_policy_weighs_the_steps_medians_as_whole_steps_and_a_change_at_what_it_took(observed: bool) -> None:
    # NOTE: 2 timed steps a cell: a timed set-up step would move the median. Observed: the policy, which would
    # take plain weights again after a few 1-row steps on packed ones, changes nothing while they are timed
    layout, _, _ = priced(rounds=1, observed=observed)
    assert layout.changes == [] and layout.policy.loss == 0.0
    policy = layout.policy
    assert policy.costs == {count: {rows: STEPS[(rows, count)] for rows in (1, 8)} for count in (1, 2)}
    assert policy.timed_share == 1.0
    assert policy.change_s == {packed: 3 * RELAY_S[packed] for packed in (True, False)}
    assert policy.excess(8, 2, packed_now=False) == pytest.approx(12.0 - 9.0 * 1.05)  # plain loses a batch's step
    assert policy.excess(1, 2, packed_now=True) == pytest.approx(5.0 - 4.0 * 1.05)  # packed loses a lone decode's


@pytest.mark.parametrize("fail", [{"fail_step": 0}, {"fail_step": 13}, {"fail_relay": 4}, {"fail_relay": 1}],
                         ids=["first step", "a step in layout B", "re-lay back to A", "re-lay to B"])
def test_a_failure_leaves_the_policy_frozen_with_the_weights_back_where_they_began(fail: dict[str, int]) -> None:
    layout, model, threads = priced(fail_step=fail.get("fail_step"), fail_relay=fail.get("fail_relay"))
    policy = layout.policy
    assert policy.costs == ALONE and policy.timed_share == 0.5
    assert math.isinf(policy.change_s[True]) and math.isinf(policy.change_s[False])  # frozen: no change later
    assert not layout.packed and not any(model.packed) and model.rows is None
    assert threads.small == 1 and threads.big == 2 and threads.trials == {}


def open_counts(available: int) -> StepThreads:
    """Step threads whose counts are all open, built where the stage runs `available` threads (NOTE: CI also runs
    the tests under OMP_NUM_THREADS=1, where a count has nothing to choose between and no trial is made)."""
    before = torch.get_num_threads()
    torch.set_num_threads(available)
    try:
        with mock.patch.object(step_threads, "usable_cores", lambda: available):  # NOTE: whatever this machine has
            return StepThreads(torch.device("cpu"), DecoderConfig())
    finally:
        torch.set_num_threads(before)


def test_pinned_threads_run_every_kind_at_the_count_and_set_the_trials_aside() -> None:
    threads = open_counts(2)
    threads.small, threads.heavy, threads.big = 1, 2, 2
    trials, before = threads.trials, torch.get_num_threads()
    assert trials
    try:
        with threads.pinned(1):
            assert threads.trials == {}
            assert threads.threads_for(1) == threads.threads_for(1, 10**6) == threads.threads_for(512) == 1
    finally:
        torch.set_num_threads(before)
    assert (threads.small, threads.heavy, threads.big) == (1, 2, 2) and threads.trials is trials


def test_every_count_a_step_may_run_with_is_priced_trials_and_heavy_decodes_included() -> None:
    threads = open_counts(4)  # counts open: measured, then tried
    threads.small, threads.heavy, threads.big = 4, 4, 4  # as measured at start-up
    assert threads.trials and threads.possible_counts() == {1, 4}  # a trial may move any kind to 1
    threads.trials, threads.heavy, threads.beside_count = {}, 2, None
    assert threads.possible_counts() == {2, 4}  # the heavy decodes' own count
    fixed = StepThreads(torch.device("cpu"), DecoderConfig(small_step_threads=2, big_step_threads=3))
    fixed.available, fixed.beside_count = 4, None
    assert fixed.possible_counts() == {2, 3}  # configured: no trial


def test_a_policy_frozen_before_stays_frozen_with_the_new_prices() -> None:
    model = Model(3, packed=False)
    policy = LayoutPolicy(ALONE, timed_share=0.5, change_s={True: 1.0, False: 1.0}, close=0.05)
    policy.freeze()  # e.g. a re-lay failed while serving
    layout = WeightLayout(policy, num_weights=3, packed=False, pack_rows=64, packing=model.packing,
                          relayout=model.relayout)
    threads = StepThreads(torch.device("cpu"), DecoderConfig(small_step_threads=1, big_step_threads=1))
    price_by_steps(layout, threads, {1: lambda: model.step(1, threads.apply(1))}, rounds=1, clock=model.clock)
    assert policy.costs == {1: {1: STEPS[(1, 1)]}} and math.isinf(policy.change_s[True])
