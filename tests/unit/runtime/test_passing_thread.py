"""Work run in a passing thread: its result or its exception comes back, and the thread is gone after."""

from __future__ import annotations

import threading

import pytest
import torch

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


def test_it_runs_at_the_callers_torch_thread_count_not_the_one_another_thread_set_last() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        elsewhere = threading.Thread(target=lambda: torch.set_num_threads(1))  # e.g. a step thread's decode count
        elsewhere.start()
        elsewhere.join()
        assert in_passing_thread(torch.get_num_threads) == 3 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
