"""Decoder steps take torch threads by their size, in their own thread only."""

from __future__ import annotations

import threading

import pytest
import torch

from mmserve.config import DecoderConfig
from mmserve.runtime import step_threads
from mmserve.runtime.step_threads import BIG_FIRST_PERIOD, UNTRUSTED_FIRST_PERIOD, StepThreads

CPU = torch.device("cpu")


class FakeClock:
    """Stands in for step_threads' `time`: only the fake steps move it, so the timings are exact.

    NOTE: real sleeps of ~10 ms meant to tie within 5% (step_threads.CLOSE) did not on a busy CI machine.
    """

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def step(self, ms_by_threads: dict[int, float]) -> None:
        """A step that takes `ms_by_threads[n]` ms on the calling thread's current count `n`."""
        self.now += ms_by_threads[torch.get_num_threads()] / 1000


class FakeCompany:
    """Stands in for step_threads' `CoreCompany`: others keep `FakeCompany.others_cores` of 2 cores busy."""

    others_cores: float | None = 0.0

    def __init__(self) -> None:
        self.cores = {0, 1}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def others(self) -> float | None:
        return FakeCompany.others_cores


@pytest.fixture(autouse=True)
def many_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cores enough for every count the tests set (NOTE: a StepThreads caps torch's count at `usable_cores`, which
    on a machine or container with one core would leave every count at 1)."""
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 64)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """Fake time, on a node where nothing else runs (unless a test sets `FakeCompany.others_cores`)."""
    fake = FakeClock()
    monkeypatch.setattr(step_threads, "time", fake)
    monkeypatch.setattr(step_threads, "CoreCompany", FakeCompany)
    monkeypatch.setattr(FakeCompany, "others_cores", 0.0)
    return fake


def test_small_steps_and_big_steps_take_their_own_counts() -> None:
    threads = StepThreads(CPU, DecoderConfig(small_step_tokens=16, small_step_threads=1, big_step_threads=4))
    threads.available = 4  # as if the stage had been configured with 4
    assert [threads.threads_for(n) for n in (1, 8, 16, 17, 300)] == [1, 1, 1, 4, 4]
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # NOTE: CI also runs this under OMP_NUM_THREADS=1, where nothing is open
    try:
        unset = StepThreads(CPU, DecoderConfig())
    finally:
        torch.set_num_threads(before)
    assert unset.needs_calibration and unset.threads_for(1) == unset.threads_for(300) == unset.available == 2
    torch.set_num_threads(1)
    try:
        alone = StepThreads(CPU, DecoderConfig())
    finally:
        torch.set_num_threads(before)
    assert not alone.needs_calibration and alone.threads_for(1) == alone.threads_for(300) == 1
    assert not StepThreads(CPU).needs_calibration  # the encoder's: every step at the stage's count
    assert not StepThreads(torch.device("meta"), DecoderConfig()).enabled  # not CPU: never touched


def test_calibration_picks_the_faster_count_and_fewer_threads_on_a_tie(clock: FakeClock) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = StepThreads(CPU, DecoderConfig())

        def big_step() -> None:  # twice as fast on 2 threads; applies and reports its count as the runner does
            count, started = threads.apply(300), clock.now
            clock.step({1: 20.0, 2: 10.0})
            threads.observe(300, clock.now - started, count)

        def small_step() -> None:  # 2% faster on 2: a tie (within CLOSE), so 1, which a plain "fastest" misses
            threads.apply(1)
            clock.step({1: 10.2, 2: 10.0})

        threads.calibrate(small_step=small_step, big_step=big_step)
        assert (threads.small, threads.big) == (1, 2)
        assert not threads.needs_calibration and torch.get_num_threads() == 2  # the stage's count restored
        # the calibration's own steps are not trials' steps: serving waits its whole period before a trial
        for _ in range(BIG_FIRST_PERIOD):
            big_step()
            assert torch.get_num_threads() == 2
        assert threads.apply(300) == 1  # then the first trial begins, with the other count
    finally:
        torch.set_num_threads(before)


def test_apply_changes_only_the_calling_threads_count() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = StepThreads(CPU, DecoderConfig(small_step_tokens=16, small_step_threads=1))
        seen: list[int] = []

        def step_thread() -> None:
            torch.ones(4).sum()  # NOTE: a first op makes torch set this thread up from the process setting
            threads.apply(1)
            seen.append(torch.get_num_threads())
            threads.apply(300)
            seen.append(torch.get_num_threads())
            threads.apply(2)
            seen.append(torch.get_num_threads())

        t = threading.Thread(target=step_thread)
        t.start()
        t.join()
        assert seen == [1, 2, 1]
        assert torch.get_num_threads() == 2  # this thread's (another stage's) setting is untouched
    finally:
        torch.set_num_threads(before)


def test_encoder_runner_keeps_its_count_in_a_thread_started_after_a_decode_step_chose_one() -> None:
    import numpy as np

    from mmserve.encoder.runner import EncoderRunner
    from mmserve.messages import ProcessedItem

    before = torch.get_num_threads()
    seen: list[int] = []

    def vision(px: torch.Tensor) -> torch.Tensor:  # (n, 3, H, W) -> (n, mm_tokens=4, hidden=8)
        seen.append(torch.get_num_threads())
        return torch.zeros(px.shape[0], 4, 8)

    try:
        torch.set_num_threads(2)
        runner = EncoderRunner(vision)
        torch.set_num_threads(1)  # what a decode step's apply() leaves as the default for new threads
        item = ProcessedItem(np.zeros((1, 3, 4, 4), dtype=np.uint8))
        t = threading.Thread(target=lambda: runner.embed_multimodal([item]))
        t.start()
        t.join()
        assert seen == [2]
    finally:
        torch.set_num_threads(before)


def test_a_step_leaves_a_core_when_its_threads_are_fewer_than_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmserve.runtime.core_company import usable_cores

    monkeypatch.setattr(step_threads, "usable_cores", usable_cores)  # this machine's own
    threads = StepThreads(CPU, DecoderConfig(small_step_tokens=16, small_step_threads=1, big_step_threads=4))
    assert threads.cores == usable_cores() >= 1  # this process's affinity within its CPU quota, read once
    threads.available, threads.cores = 4, 4
    assert threads.leaves_a_core(8) and not threads.leaves_a_core(300)  # 1 of 4 cores; all 4 of them
    threads.cores = 1
    assert not threads.leaves_a_core(8)
    assert StepThreads(torch.device("meta"), DecoderConfig()).leaves_a_core(300)  # the forward is elsewhere


def test_a_heavy_decode_takes_its_own_measured_count_and_light_ones_keep_theirs(clock: FakeClock) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = StepThreads(CPU, DecoderConfig(small_step_tokens=16))

        def light() -> None:  # one short sequence: a tie on 1 or 2 (2% apart)
            threads.apply(1, 128)
            clock.step({1: 10.2, 2: 10.0})

        def heavy() -> None:  # 8 sequences of 1024: twice as fast on 2
            threads.apply(8, 8 * 1024)
            clock.step({1: 20.0, 2: 10.0})

        def big() -> None:
            threads.apply(300, 300)
            clock.step({1: 10.2, 2: 10.0})

        threads.calibrate(small_step=light, big_step=big, heavy_step=(heavy, 128, 8 * 1024))
        assert (threads.small, threads.heavy, threads.heavy_rows) == (1, 2, 1024)
        # by the rows attended, not the tokens computed: one long sequence is heavy, a few short ones light
        assert [threads.threads_for(n, rows) for n, rows in ((1, 300), (4, 1000), (8, 2400), (1, 8000))] == [1, 1, 2, 2]
        assert threads.threads_for(300, 300) == 1  # prefill chunks keep theirs
        configured = StepThreads(CPU, DecoderConfig(small_step_threads=1))
        assert configured.threads_for(8, 10**6) == 1  # a configured decode count holds for every decode
    finally:
        torch.set_num_threads(before)


def test_a_measurement_while_others_fill_the_cores_keeps_all_threads_and_is_tried_again_soon(
        clock: FakeClock) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def measured(others: float | None) -> StepThreads:
            FakeCompany.others_cores = others
            threads = StepThreads(CPU, DecoderConfig(small_step_tokens=16))
            threads.cores = 2  # as on a 2-core machine, whatever this one has

            def small() -> None:  # 1 thread wins: the second core was taken by others
                threads.apply(1)
                clock.step({1: 10.0, 2: 20.0})

            def big() -> None:  # 2 threads win despite the company
                count = threads.apply(300)
                started = clock.now
                clock.step({1: 20.0, 2: 10.0})
                threads.observe(300, clock.now - started, count)

            threads.calibrate(small_step=small, big_step=big)
            return threads

        quiet = measured(0.4)  # a quiet node's background: the verdict holds
        assert (quiet.small, quiet.big, quiet.voided) == (1, 2, set())
        assert unknown_is_quiet(measured(None))
        busy = measured(0.6)  # the 2-thread arm had less than 1.5 cores: not trusted
        assert (busy.small, busy.big) == (2, 2)
        assert busy.voided == {"small"} and busy.company["small"] == 0.6  # the big steps' win of all threads stands
        for _ in range(UNTRUSTED_FIRST_PERIOD):  # the doubted count is tried again after a few steps
            assert busy.apply(1) == 2
            busy.observe(1, 0.02, 2)
        assert busy.apply(1) == 1  # the trial's first step, at the other count
        assert quiet.trials["small"].period > UNTRUSTED_FIRST_PERIOD  # a trusted one waits its whole period
        more = StepThreads(CPU, DecoderConfig(small_step_tokens=16))  # more threads than the 2 cores: the rule
        more.available, more.cores = 4, 2  # asks of the others what those cores can give, no more
        assert more._trusted(0.4) and not more._trusted(0.6) and more._trusted(None)
    finally:
        torch.set_num_threads(before)


def unknown_is_quiet(threads: StepThreads) -> bool:
    """Where the company is unknown (no /proc/stat), the measurement is taken as it is."""
    return threads.small == 1 and threads.voided == set()


def test_a_measurement_of_short_steps_goes_on_until_it_can_tell_the_company(clock: FakeClock) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def steps_taken(ms: float) -> int:
            threads, taken = StepThreads(CPU, DecoderConfig(small_step_tokens=16)), [0]

            def step() -> None:
                threads.apply(1)
                clock.step({1: ms, 2: ms})
                taken[0] += 1

            threads.calibrate(small_step=step, big_step=step)
            return taken[0] // 2  # two kinds measured alike

        assert steps_taken(100.0) == 2 * (2 + 7)  # warm-up and timed rounds, each at 1 and 2 threads
        assert steps_taken(6.0) == 2 * (2 + 21)  # 21 rounds of 12 ms: past the company's MIN_WALL_S
        assert steps_taken(0.1) == 2 * (2 + 64)  # never more rounds than most_rounds
    finally:
        torch.set_num_threads(before)


def test_steps_take_fewer_threads_while_work_computes_beside_them_and_no_trial_counts_those_steps() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = StepThreads(CPU, DecoderConfig(small_step_tokens=16))  # counts open: trials run
        threads.small = threads.heavy = threads.big = 2  # as if measured
        threads.cores = 2  # a 2-core machine's
        busy = [False]
        threads.beside = lambda: busy[0]
        assert (threads.apply(1), threads.apply(300)) == (2, 2)
        busy[0] = True
        assert (threads.apply(1), threads.apply(300)) == (1, 1) and torch.get_num_threads() == 1
        assert threads.leaves_a_core(1) is False  # what the step's kind takes, not the yield
        for _ in range(2 * 256):  # more than a trial's first period, all yielded
            threads.observe(1, 0.001, threads.apply(1))
        busy[0] = False
        assert threads.apply(1) == 2  # the trial's period did not run out on yielded steps
        assert threads.trials["small"].trials == 0
        assert 1 in threads.possible_counts()
        threads.small = 1  # a kind already at the cap: its trial neither runs nor counts beside the work
        busy[0] = True
        for _ in range(2 * 256):
            assert threads.apply(1) == 1
            threads.observe(1, 0.001, 1)
        busy[0] = False
        assert threads.apply(1) == 1 and threads.trials["small"].trials == 0  # no trial began on those steps
        torch.set_num_threads(2)  # NOTE: the stage's count is the thread's when it is built
        unlimited = StepThreads(CPU, DecoderConfig(small_step_tokens=16, small_step_threads=2, big_step_threads=2,
                                                   threads_beside_encodes=None))
        unlimited.beside = lambda: True
        assert unlimited.apply(1) == 2 and unlimited.possible_counts() == {2}
    finally:
        torch.set_num_threads(before)


def test_a_stage_runs_no_more_threads_than_the_cores_it_may_compute_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_threads, "usable_cores", lambda: 2)  # e.g. a container limited to 2 CPUs
    before = torch.get_num_threads()
    torch.set_num_threads(4)  # e.g. torch's default: one per core the affinity shows
    try:
        threads = StepThreads(torch.device("cpu"), DecoderConfig(small_step_threads=4, big_step_threads=4))
        assert threads.available == 2 and threads.threads_for(1) == threads.threads_for(512) == 2
        assert StepThreads(torch.device("meta")).available == 4  # off the CPU nothing is capped
    finally:
        torch.set_num_threads(before)
