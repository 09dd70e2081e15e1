"""OutputChannel: a request's outputs reach its consumer in order, and its event loop is woken only when the
consumer waits for what came (any output when it waits for the next, a last one when it waits out an interval)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from mmserve.messages import RequestFailed, RequestOutput
from mmserve.runtime.output_channel import OutputChannel


def out(i: int, *, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [i], str(i), finished, "length" if finished else None, 5, i)


def counted(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Count the cross-thread wake-ups scheduled on `loop`."""
    calls = [0]
    original = loop.call_soon_threadsafe

    def call_soon_threadsafe(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = call_soon_threadsafe  # type: ignore[method-assign, assignment]
    return calls


def later(delay_s: float, *puts: tuple[OutputChannel, Any]) -> None:
    """Put each item from another thread, `delay_s` after the previous one."""
    def run() -> None:
        for channel, item in puts:
            time.sleep(delay_s)
            channel.put(item)
    threading.Thread(target=run, daemon=True).start()


async def waiting(channel: OutputChannel, deadline: float | None = None) -> asyncio.Task:
    """`channel.take(deadline)` started and waiting (its waiter registered) before anything is put."""
    task = asyncio.create_task(channel.take(deadline))
    await asyncio.sleep(0)  # NOTE: the task runs up to its first await: the put cannot come first
    return task


def test_a_waiting_taker_is_woken_once_by_the_first_output() -> None:
    async def run() -> tuple[list, int]:
        channel = OutputChannel(asyncio.get_running_loop())
        wakes = counted(channel.loop)
        taking = await waiting(channel)
        later(0.01, (channel, out(1)))
        return await asyncio.wait_for(taking, 5), wakes[0]

    items, wakes = asyncio.run(run())
    assert [o.new_token_ids for o in items] == [[1]] and wakes == 1


def test_outputs_during_an_interval_wake_nobody_and_all_come_at_its_end_in_order() -> None:
    async def run() -> tuple[list, int, float]:
        channel = OutputChannel(asyncio.get_running_loop())
        wakes = counted(channel.loop)
        started = time.monotonic()
        # NOTE: a 2 s interval for 10 ms of puts: a stalled CI machine still has them all in before its end
        taking = await waiting(channel, started + 2.0)
        later(0.001, *((channel, out(i)) for i in range(1, 11)))
        items = await asyncio.wait_for(taking, 5)
        return items, wakes[0], time.monotonic() - started

    items, wakes, waited = asyncio.run(run())
    assert [o.new_token_ids[0] for o in items] == list(range(1, 11))
    assert wakes == 0  # the step thread touched nothing of the consumer's loop
    assert waited >= 1.9  # taken at the interval's end, not at the first output (~1 ms in)


def test_a_last_output_ends_the_interval_early_with_everything_before_it() -> None:
    async def run() -> tuple[list, int, float]:
        channel = OutputChannel(asyncio.get_running_loop())
        wakes = counted(channel.loop)
        started = time.monotonic()
        taking = await waiting(channel, started + 10.0)
        later(0.001, (channel, out(1)), (channel, out(2)), (channel, out(3, finished=True)))
        items = await asyncio.wait_for(taking, 5)
        return items, wakes[0], time.monotonic() - started

    items, wakes, waited = asyncio.run(run())
    assert [o.new_token_ids[0] for o in items] == [1, 2, 3] and items[-1].finished
    assert wakes == 1 and waited < 5.0


def test_a_failure_is_a_last_item_and_what_is_queued_is_taken_at_once() -> None:
    async def run() -> tuple[list, list]:
        channel = OutputChannel(asyncio.get_running_loop())
        channel.put(out(1))
        channel.put(RequestFailed("r", ValueError("boom")))
        first = await asyncio.wait_for(channel.take(time.monotonic() + 10.0), 5)  # a last item: no wait
        channel.put(out(2))
        return first, await channel.take()  # queued: no wait

    first, second = asyncio.run(run())
    assert isinstance(first[-1], RequestFailed) and first[0].new_token_ids == [1]
    assert [o.new_token_ids for o in second] == [[2]]


def test_a_passed_deadline_takes_what_is_there_possibly_nothing() -> None:
    async def run() -> tuple[list, list]:
        channel = OutputChannel(asyncio.get_running_loop())
        empty = await channel.take(time.monotonic() - 1)
        channel.put(out(1))
        return empty, await channel.take(time.monotonic() - 1)

    empty, one = asyncio.run(run())
    assert empty == [] and [o.new_token_ids for o in one] == [[1]]
