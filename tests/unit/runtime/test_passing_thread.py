"""Work run in a passing thread: its result or its exception comes back, and the thread is gone after."""

from __future__ import annotations

import threading

import pytest

from mmserve.runtime.passing_thread import in_passing_thread


def test_the_result_comes_back_from_another_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert in_passing_thread(work) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_its_exception_is_raised_in_the_caller() -> None:
    def fail() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError, match="nope"):
        in_passing_thread(fail)
