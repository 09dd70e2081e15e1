"""A request's deadline: each wait gets what is left of it, and what outlives it is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from mmserve.api.deadline import Deadline
from mmserve.errors import DeadlineExceededError


def test_waits_share_one_deadline_and_the_late_one_is_cancelled() -> None:
    cancelled = asyncio.Event()

    async def slow(seconds: float) -> str:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "done"

    async def run() -> None:
        deadline = Deadline(0.3)
        assert await deadline.wait(slow(0.01)) == "done"
        assert await deadline.wait(slow(0.01)) == "done"
        with pytest.raises(DeadlineExceededError, match=r"0\.3 s \(ingress.request_timeout_s\)") as info:
            await deadline.wait(slow(10))  # the third: less than 0.3 s left
        assert info.value.status == 504 and cancelled.is_set()
        with pytest.raises(DeadlineExceededError):  # past the deadline nothing waits at all
            await deadline.wait(slow(0.01))

    asyncio.run(asyncio.wait_for(run(), 5))


def test_a_timeout_of_the_awaited_call_itself_is_not_the_deadline() -> None:
    async def times_out() -> None:
        raise TimeoutError("the callee's own")

    async def run() -> None:
        with pytest.raises(TimeoutError, match="the callee's own") as info:
            await Deadline(10).wait(times_out())
        assert not isinstance(info.value, DeadlineExceededError)

    asyncio.run(run())
