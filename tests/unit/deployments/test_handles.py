"""deployments/handles.py without Ray: a handle call awaited by a task that is cancelled is cancelled too."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import pytest

from deployments.handles import awaited


class PendingCall:
    """Stands in for a DeploymentResponse whose replica has not answered: awaiting it waits; `cancel` counts."""

    def __init__(self) -> None:
        self.cancels = 0
        self._answer: asyncio.Future[Any] | None = None

    def __await__(self) -> Generator[Any, None, Any]:
        self._answer = asyncio.get_running_loop().create_future()
        return (yield from self._answer.__await__())

    def cancel(self) -> None:
        self.cancels += 1


def test_a_cancelled_waiter_cancels_its_handle_call() -> None:
    call = PendingCall()

    async def run() -> None:
        waiter = asyncio.ensure_future(awaited(call))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(run())
    assert call.cancels == 1


def test_an_answered_call_is_returned_and_not_cancelled() -> None:
    call = PendingCall()

    async def run() -> Any:
        waiter = asyncio.ensure_future(awaited(call))
        await asyncio.sleep(0.01)
        assert call._answer is not None
        call._answer.set_result("embeddings")
        return await waiter

    assert asyncio.run(run()) == "embeddings" and call.cancels == 0
