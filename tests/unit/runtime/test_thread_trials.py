"""A step thread count chosen badly (or for other times) is measured again on that kind's own steps."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import DecoderConfig
from mmserve.runtime import step_threads
from mmserve.runtime.step_threads import BIG, BIG_FIRST_PERIOD, HEAVY, SMALL, StepThreads
from mmserve.runtime.thread_trials import (
    FIRST_PERIOD,
    MIN_PAIRS,
    RUN_LENGTH,
    TIMED_STEPS,
    ThreadTrials,
    choose,
    more_over_fewer,
    pairs,
)

TRIAL_STEPS = TIMED_STEPS * RUN_LENGTH  # a decode trial's steps, timed or not


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch):
    """torch at 2 threads while the test builds its StepThreads (their `available`), restored after; the process's
    cores taken as 2 (NOTE: a StepThreads caps torch's count at them, 1 on a one-core machine or container)."""
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def serve(trials: ThreadTrials, current: int, steps: int, time_of, size=lambda i: 8) -> tuple[int, list[int]]:
    """Run `steps` steps through `trials`, each taking `time_of(count)` s -> (chosen count, counts used)."""
    used = []
    for i in range(steps):
        count = trials.count_for(current)
        used.append(count)
        current = trials.observe(count, size(i), time_of(count), current)
    return current, used


def test_a_slower_count_is_left_once_a_second_trial_agrees_and_the_trials_then_come_less_often() -> None:
    trials = ThreadTrials((1, 2), close=0.05)
    chosen, used = serve(trials, 1, FIRST_PERIOD + 2 * TRIAL_STEPS, lambda c: 0.010 if c == 2 else 0.016)
    assert used[:FIRST_PERIOD] == [1] * FIRST_PERIOD  # no trial before the period is up
    # then both counts in runs of two, the runs in ABBA order, in two trials back to back (the second checks)
    assert used[FIRST_PERIOD:] == [2, 2, 1, 1, 1, 1, 2, 2] * (2 * TRIAL_STEPS // 8)
    assert chosen == 2 and trials.changes == [(1, 2)] and trials.period == FIRST_PERIOD and trials.trials == 2
    chosen, used = serve(trials, chosen, FIRST_PERIOD + TRIAL_STEPS, lambda c: 0.010 if c == 2 else 0.016)
    assert chosen == 2 and trials.trials == 3 and trials.period == 2 * FIRST_PERIOD  # confirmed: rarer
    assert used.count(1) == MIN_PAIRS * RUN_LENGTH  # won every pair plainly: the trial ended at its fewest pairs


def test_a_count_in_doubt_is_tried_soon_and_once_confirmed_waits_a_whole_period() -> None:
    trials = ThreadTrials((1, 2), close=0.05)
    serve(trials, 2, 5, lambda c: 0.010)
    trials.soon(16)  # e.g. its start-up measurement was taken beside others' work
    _, used = serve(trials, 2, 16 + TRIAL_STEPS, lambda c: 0.010 if c == 2 else 0.016)
    assert used[:16] == [2] * 16 and used[16:].count(1) == MIN_PAIRS * RUN_LENGTH  # the trial 16 steps on
    assert trials.trials == 1 and trials.period == FIRST_PERIOD  # confirmed: not 32, the usual first period
    trials.soon(10**6)
    assert trials.period == FIRST_PERIOD  # never later than it was


@pytest.mark.parametrize(("current", "other_s", "full"), [
    (2, 0.016, False),  # two threads 1.6x faster: plain after MIN_PAIRS pairs
    (2, 0.0115, True),  # 1.15x: within DECISIVE of the boundary, the whole trial runs
    (1, 0.016, True),  # the count in use loses: the whole trial, and a second one to check
])
def test_a_trial_ends_early_only_to_keep_a_count_that_wins_every_pair_plainly(current: int, other_s: float,
                                                                             full: bool) -> None:
    trials = ThreadTrials((1, 2), close=0.05, first_period=64)  # NOTE: no second trial within the steps served
    _, used = serve(trials, current, 64 + TRIAL_STEPS, lambda c: 0.010 if c == 2 else other_s)
    tried = used[64:].count(1 if current == 2 else 2)
    assert tried == (TRIAL_STEPS // 2 if full else MIN_PAIRS * RUN_LENGTH)


def test_the_step_right_after_a_switch_does_not_decide() -> None:
    """Two threads settle at 10 ms a decode, but the first step back after one at one thread waits 30 ms for its
    second core (others took it meanwhile); one thread takes 14 ms. Runs of two, the first untimed, keep two
    threads; single steps alternating, each timed, would have chosen one."""
    def seconds(count: int, previous: int) -> float:
        return 0.014 if count == 1 else 0.010 if previous == 2 else 0.030

    for run_length, kept in ((RUN_LENGTH, 2), (1, 1)):
        trials = ThreadTrials((1, 2), close=0.05, first_period=2, run_length=run_length)
        current = previous = 2
        while trials.trials < 2:  # two trials: one that would change the count is checked by the next
            count = trials.count_for(current)
            current = trials.observe(count, 1, seconds(count, previous), current)
            previous = count
        assert trials.trials == 2 and current == kept


def test_one_trial_against_the_count_in_use_changes_nothing_unless_the_next_agrees() -> None:
    """A trial whose two-thread steps others happened to hit reads one thread as faster; the trial run at once
    to check it does not, so two threads stay and the trials go back to their period."""
    trials = ThreadTrials((1, 2), close=0.05, first_period=2)
    current, pending = 2, []
    for _ in range(2 + 2 * TRIAL_STEPS):
        count = trials.count_for(current)
        unlucky = trials.trials == 0  # the first trial's steps at two threads lost a core to others
        current = trials.observe(count, 1, 0.014 if count == 1 else 0.030 if unlucky else 0.010, current)
        pending.append(trials.pending)
    assert 1 in pending and pending[-1] is None  # the first trial's verdict waited for the second's
    assert current == 2 and trials.changes == [] and trials.trials == 2 and trials.period == 2


def test_steps_that_come_in_a_fixed_order_do_not_favour_the_count_tried_first() -> None:
    """Requests of two chunks, the second attending twice the context: equally fast counts stay as they are."""
    trials = ThreadTrials((1, 2), close=0.05, first_period=2, size_tolerance=0.25, run_length=1)
    current = 1
    for i in range(2 + TIMED_STEPS):
        count = trials.count_for(current)
        current = trials.observe(count, 4096, 0.9 if i % 2 == 0 else 1.1, current)  # first / second chunk
    assert trials.trials == 1 and current == 1 and trials.changes == []


def verdict(steps: list[tuple[int, int, float]], current: int, close: float, tolerance: float = 0.0) -> int:
    """The count a finished trial of `steps` (count, size, seconds) keeps, as `ThreadTrials.observe` decides it."""
    return choose(more_over_fewer(steps, tolerance), tuple(sorted({count for count, _, _ in steps})), current, close)


def test_a_tie_goes_to_fewer_threads_and_unequal_steps_decide_nothing() -> None:
    assert verdict([(2, 8, 0.0100), (1, 8, 0.0102)] * 8, 2, close=0.05) == 1  # within 5%: a core saved
    assert verdict([(2, 8, 0.0100), (1, 8, 0.0200)] * 8, 1, close=0.05) == 2
    grew = [(2, 8, 0.010), (1, 9, 0.030)] * 8  # the batch changed between the steps of every pair
    assert verdict(grew, 2, close=0.05) == 2 and verdict(grew, 1, close=0.05) == 1


def test_nearly_equal_steps_compare_per_token_when_allowed() -> None:
    chunks = [(1, 300, 0.300), (2, 280, 0.168), (1, 290, 0.290), (2, 310, 0.186)] * 4  # 2 threads: 0.6 ms a token
    assert verdict(chunks, 1, close=0.05) == 1  # no two sizes equal: nothing decides
    assert verdict(chunks, 1, close=0.05, tolerance=0.25) == 2
    per_token = [(1, 240, 0.240), (2, 300, 0.250)] * 8  # 2 threads took longer but computed 25% more tokens
    assert verdict(per_token, 1, close=0.05, tolerance=0.25) == 2
    far = [(1, 100, 0.100), (2, 300, 0.180)] * 8  # 3x the tokens: not compared even per token
    assert verdict(far, 1, close=0.05, tolerance=0.25) == 1


def test_steps_of_mixed_sizes_compare_with_the_nearest_step_of_their_size_at_the_other_count() -> None:
    """A text prompt, then an image's: neighbours never compare. The image's prefill at 2 threads runs 4x slower
    (the node's other stages are busy right after its encode), the text's as fast as on 1 thread."""
    times = {(1, 30): 0.003, (2, 30): 0.003, (1, 290): 0.009, (2, 290): 0.036}
    trials = ThreadTrials((1, 2), close=0.05, first_period=2, size_tolerance=0.25, run_length=1)
    current = 2
    for i in range(2 + 2 * TIMED_STEPS):  # a trial, and the one that checks its change
        size = 30 if i % 2 == 0 else 290
        count = trials.count_for(current)
        current = trials.observe(count, size, times[count, size], current)
    assert trials.trials == 2 and current == 1 and trials.changes == [(2, 1)]
    steps = [(2, 30, 0.003), (1, 290, 0.009), (1, 30, 0.003), (2, 290, 0.036)] * 4
    unique = [(count, size, seconds + i * 1e-9) for i, (count, size, seconds) in enumerate(steps)]  # told apart
    paired = [step for pair in pairs(unique, 0.25) for step in pair]
    assert sorted(paired) == sorted(unique)  # every step compared, none twice
    assert verdict([(c, s, 1e-4 * s) for c, s, _ in steps], 2, close=0.05) == 1  # a tie: a core saved
    assert verdict([(c, s, 1e-4 * s / c) for c, s, _ in steps], 1, close=0.05) == 2  # twice as fast on 2


def test_a_few_slow_steps_outweigh_many_quick_ones_a_little_faster_the_other_way() -> None:
    """Text prefills 7% faster on 2 threads (2.26 against 2.43 ms), image prefills 3.8x slower (35.85 against
    9.43): the median pair favours 2 threads, the time the steps take favours 1."""
    text = [(2, 30, 0.00226), (1, 30, 0.00243)] * 5
    images = [(2, 290, 0.03585), (1, 290, 0.00943)] * 3
    assert verdict(text + images, 2, close=0.05) == 1
    assert verdict(text, 1, close=0.05) == 2  # text alone: 2 threads win by more than `close`


def test_one_stalled_step_does_not_decide() -> None:
    steady = [(2, 100, 0.005), (1, 100, 0.010)] * 7  # 2 threads twice as fast...
    assert verdict([*steady, (2, 100, 0.500), (1, 100, 0.010)], 1, close=0.05) == 2  # ...but one took 100x
    assert verdict([*steady, (2, 100, 0.005), (1, 100, 0.0)], 1, close=0.05) == 2  # a zero time is left out


def test_the_stage_switches_its_decode_count_while_serving_unless_the_config_fixed_it(two_threads) -> None:
    open_ = StepThreads(torch.device("cpu"), DecoderConfig(small_step_tokens=16, big_step_threads=2))
    fixed = StepThreads(torch.device("cpu"), DecoderConfig(small_step_threads=1, big_step_threads=2))
    open_.small = open_.heavy = 1  # as a start-up measurement disturbed by other replicas starting might have chosen
    for _ in range(FIRST_PERIOD + 2 * TRIAL_STEPS):  # a trial, and the one that checks its change
        count = open_.apply(8)
        open_.observe(8, 0.010 if count == 2 else 0.016, count)
    assert open_.small == 2 and open_.apply(300) == 2  # prefill chunks keep their own count
    assert open_.heavy == 1 and open_.trials[HEAVY].trials == 0  # no decode is heavy (heavy_rows 0)
    assert SMALL not in fixed.trials and all(fixed.apply(8) == 1 for _ in range(FIRST_PERIOD + TRIAL_STEPS))
    assert open_.changes() == [(SMALL, 1, 2)] and open_.trials_run == 2


def test_heavy_decodes_are_measured_again_on_their_own_steps(two_threads) -> None:
    threads = StepThreads(torch.device("cpu"), DecoderConfig(small_step_tokens=16, big_step_threads=2))
    threads.small, threads.heavy, threads.heavy_rows = 1, 1, 1024  # as calibration left them
    for _ in range(FIRST_PERIOD + 2 * TRIAL_STEPS):
        count = threads.apply(8, 8 * 2048)  # 8 sequences of 2k tokens: twice as fast on 2 threads
        threads.observe(8, 0.020 if count == 2 else 0.040, count, 8 * 2048)
    assert (threads.heavy, threads.small) == (2, 1) and threads.changes() == [(HEAVY, 1, 2)]
    assert threads.apply(1, 300) == 1 and threads.apply(8, 8 * 2048) == 2


def test_prefill_chunks_chosen_badly_at_start_up_are_measured_again_after_a_few_requests(two_threads) -> None:
    threads = StepThreads(torch.device("cpu"), DecoderConfig(small_step_tokens=16, small_step_threads=1))
    threads.big = 1  # as a start-up measurement beside other replicas starting chose
    used = []
    for i in range(BIG_FIRST_PERIOD + 2 * TIMED_STEPS):  # prefill chunks: runs of one; a trial and its check
        size = 260 + 7 * (i % 5)  # prompts of about the same length, never twice the same in a row
        count = threads.apply(size, size)
        used.append(count)
        threads.observe(size, size * (0.0006 if count == 2 else 0.001), count, size)
        assert threads.apply(1, 300) == 1  # the decodes between them keep their configured count
    assert used[:BIG_FIRST_PERIOD] == [1] * BIG_FIRST_PERIOD and 2 in used[BIG_FIRST_PERIOD:]
    assert threads.big == 2 and threads.changes() == [(BIG, 1, 2)]
    assert list(threads.trials) == [BIG]  # a configured decode count is never tried


def test_each_trial_keeps_its_measured_ratio_for_the_log() -> None:
    """The figure behind a verdict: more threads' time per token over fewer's, or None where nothing compared."""
    assert more_over_fewer([(2, 8, 0.015), (1, 8, 0.010)] * 8) == pytest.approx(1.5)
    assert more_over_fewer([(2, 8, 0.010), (1, 9, 0.030)] * 8) is None
    trials = ThreadTrials((1, 2), close=0.05, first_period=2)
    current = 2
    for _ in range(2 + 2 * TRIAL_STEPS):
        count = trials.count_for(current)
        current = trials.observe(count, 1, 0.012 if count == 2 else 0.008, current)  # 2 threads slower served
    assert trials.trials == 2 and current == 1 and trials.last_ratio == pytest.approx(1.5)


def test_a_replica_keeps_only_its_latest_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica may serve for months; its list of count changes (stats, tests) does not grow with it."""
    from mmserve.runtime import thread_trials

    monkeypatch.setattr(thread_trials, "CHANGES_KEPT", 3)
    trials = ThreadTrials((1, 2), close=0.05, first_period=1)
    current = 1
    for _ in range(6):  # each count in turn is made plainly faster: each pair of trials changes it
        faster = 2 if current == 1 else 1
        current, _ = serve(trials, current, 3 * TRIAL_STEPS, lambda c, f=faster: 0.010 if c == f else 0.020)
    assert len(trials.changes) == 3 and trials.changes[-1][1] == current
