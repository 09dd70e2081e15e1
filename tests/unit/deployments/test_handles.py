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


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # the loop never ran it
def test_a_thread_calling_through_a_loop_that_never_runs_the_call_gives_up_past_its_timeout(monkeypatch) -> None:
    """A call's timeout runs on the replica's loop; with that loop held up (a shutdown joining the calling
    thread), the thread gives up by itself a little later, and the call is cancelled."""
    import time

    from deployments import handles

    class Handle:
        def options(self, **_: Any) -> Handle:
            return self

    monkeypatch.setattr(handles, "LOOP_GRACE_S", 0.2)
    caller = handles.FromThread(Handle())
    held_up = asyncio.new_event_loop()  # NOTE: never run, as a loop blocked in a join
    caller._loop = held_up
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            caller.call("kept_copy", "key", timeout_s=0.1)
        assert time.monotonic() - started < 5  # a bound on a hang, not a timing
    finally:
        held_up.close()


def test_a_call_the_thread_gives_up_on_is_cancelled_on_the_replica_too() -> None:
    """The thread's own give-up (`call` past its grace, or a caller cancelling `submit`'s future) cancels the
    task on the loop: the handle call is cancelled as on its timeout, not left running on the callee."""
    import threading
    import time

    from deployments import handles

    call = PendingCall()

    class Method:
        def remote(self, *_: Any) -> PendingCall:
            return call

    class Handle:
        def options(self, **_: Any) -> Handle:
            return self

        kept_copy = Method()

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        caller = handles.FromThread(Handle())
        caller._loop = loop
        answer = caller.submit("kept_copy", "key", timeout_s=60)
        deadline = time.monotonic() + 5
        while call._answer is None and time.monotonic() < deadline:  # the call reached the "replica"
            time.sleep(0.01)
        answer.cancel()
        while call.cancels == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert call.cancels == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()
