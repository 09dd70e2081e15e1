"""SingleFlight: one run per key at a time; waiters take its outcome, or run the work themselves when it failed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError

import pytest

from mmserve.preprocess.single_flight import SingleFlight


def _ask_while_running(flight: SingleFlight[str, int], first: Callable[[], int],
                       waiter: Callable[[], int]) -> list[tuple[int, bool]]:
    """Start `first` for key "k", and once it runs, `waiter` for the same key; both outcomes, first's first.

    NOTE: `first` goes on once the waiter has found its run (seen through the flight's table of runs), not
    after a fixed sleep that a loaded machine could outlast."""
    inside, found, out = threading.Event(), threading.Event(), [(0, False), (0, False)]

    class Watched(dict):
        def get(self, key, default=None):
            running = super().get(key, default)
            if running is not None:
                found.set()
            return running

    flight._running = Watched(flight._running)

    def run_first() -> None:
        def work() -> int:
            inside.set()
            found.wait(10)  # NOTE: the waiter holds the run's future now: it takes its outcome whenever it comes
            return first()

        try:
            out[0] = flight.run("k", work)
        except RuntimeError:
            out[0] = (-1, False)

    thread = threading.Thread(target=run_first)
    thread.start()
    assert inside.wait(10)
    out[1] = flight.run("k", waiter)
    thread.join(10)
    assert found.is_set() and not thread.is_alive()  # the waiter met the run under way, and the run ended
    return out


def test_a_waiter_takes_the_runs_outcome_without_running_the_work() -> None:
    calls: list[str] = []

    def waiter() -> int:
        calls.append("waiter")
        return 2

    out = _ask_while_running(SingleFlight(10), lambda: 1, waiter)
    assert out == [(1, False), (1, True)] and calls == []


def test_a_waiter_whose_run_failed_runs_the_work_itself() -> None:
    def broken() -> int:
        raise RuntimeError("the first request's item")

    out = _ask_while_running(SingleFlight(10), broken, lambda: 2)
    assert out == [(-1, False), (2, False)]  # its own outcome, not the other's error


def test_a_waiter_runs_the_work_itself_past_its_wait() -> None:
    own = threading.Event()

    def waiter() -> int:
        own.set()
        return 2

    def first() -> int:  # NOTE: outlasts the waiter's wait: it ends once the waiter has run its own work
        own.wait(10)
        return 1

    out = _ask_while_running(SingleFlight(0.01), first, waiter)
    assert out == [(1, False), (2, False)]


def test_runs_one_after_another_each_run_their_work() -> None:
    flight: SingleFlight[str, int] = SingleFlight(10)
    assert flight.run("k", lambda: 1) == (1, False) and flight.run("k", lambda: 2) == (2, False)
    with pytest.raises(ValueError):
        flight.run("k", lambda: int("x"))
    assert flight.run("k", lambda: 3) == (3, False)  # a failed run leaves nothing behind


def test_a_waiter_whose_caller_left_stops_waiting_and_runs_nothing() -> None:
    calls: list[str] = []

    def waiter() -> int:
        calls.append("waiter")
        return 2

    flight: SingleFlight[str, int] = SingleFlight(30)
    inside, release = threading.Event(), threading.Event()

    def run_first() -> None:
        def work() -> int:  # NOTE: runs until the waiter has given up
            inside.set()
            release.wait(10)
            return 1

        flight.run("k", work)

    thread = threading.Thread(target=run_first)
    thread.start()
    assert inside.wait(10)
    gone = [False]
    timer = threading.Timer(0.2, lambda: gone.__setitem__(0, True))  # the caller leaves while it waits
    timer.start()
    started = time.monotonic()
    with pytest.raises(CancelledError):
        flight.run("k", waiter, cancelled=lambda: gone[0])
    assert time.monotonic() - started < 5 and calls == []  # not the 30 s wait, and no work of its own
    release.set()
    thread.join(10)
