"""One request's outputs, handed from a stage's step thread to the event loop of the request's consumer.

Owns: the hand-over and its wake-ups, and reading a request's outputs off its channel (`read`: one by one, or
merged and paced by a stream interval). Does not own what the outputs are, nor which requests exist (the step
loop).

NOTE: the consumer's event loop is woken only when it waits for what just came: for any output while it
waits for the next one, and for a last one (finished or failed) while it waits out a stream interval.
A wake-up crosses threads (a write to the loop's self-pipe, the loop thread taking the GIL from the step
thread, a preempted step when the host's cores are busy); an asyncio queue fed per output paid that for
every token, although a paced stream takes its outputs once per interval (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from mmserve.messages import RequestFailed


def is_last(item: Any) -> bool:
    """Whether nothing follows `item` in its request's outputs: a failure, or a finished output."""
    return isinstance(item, RequestFailed) or bool(getattr(item, "finished", False))


class OutputChannel:
    """`put` from any thread; `take` from the consumer's event loop, one taker at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[Any] = []
        self._lock = threading.Lock()
        self._waiter: asyncio.Future | None = None  # the taker's, while it waits
        self._last_only = False  # the waiter wants waking only for a last item
        self.joined = False  # set by the step loop's thread when an action submitted for it runs (step_loop.py)

    def put(self, item: Any) -> None:
        """Queue `item`; raises RuntimeError if the consumer's loop has closed (NOTE: asked first: a consumer
        not waiting in `take` would otherwise be handed outputs it will never read, kept for ever)."""
        if self.loop.is_closed():
            raise RuntimeError("the consumer's event loop is closed")
        with self._lock:
            self._items.append(item)
            waiter = self._waiter
            if waiter is None or (self._last_only and not is_last(item)):
                return
            self._waiter = None
        self.loop.call_soon_threadsafe(_wake, waiter)

    async def take(self, deadline: float | None = None) -> list[Any]:
        """What has come, in order. `deadline` None: at least one item, waiting for it. Else (monotonic s;
        inf: none) what came by then, sooner only when a last item comes; possibly nothing."""
        with self._lock:
            ready = bool(self._items) and (deadline is None or is_last(self._items[-1]))
            if ready or (deadline is not None and time.monotonic() >= deadline):
                return self._drain()
            waiter = self.loop.create_future()
            self._waiter, self._last_only = waiter, deadline is not None
        try:
            if deadline is None or math.isinf(deadline):
                await waiter
            else:
                try:
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                        await waiter
                except TimeoutError:
                    pass
        finally:
            with self._lock:
                if self._waiter is waiter:
                    self._waiter = None
        with self._lock:
            return self._drain()

    def _drain(self) -> list[Any]:
        items, self._items = self._items, []
        return items


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def read(channel: OutputChannel, merge: Callable[[list[Any]], Any] | None = None,
               interval_s: Callable[[], float] = lambda: 0.0) -> AsyncGenerator[Any]:
    """A request's outputs off `channel` until (and including) its finished one; failures are raised.

    With `merge`, the outputs that queued up while the consumer was busy come as one, `merge(items)`;
    with `interval_s` too (asked after each output yielded, and counted from when it went: it may
    change with load; inf = only at the end), outputs that come sooner than that wait for the rest of
    the interval, gathering company (a finished or failed one never waits). So the first output goes
    at once and later ones at most one interval late, at least one per interval while they keep coming.
    """
    if merge is None:
        while True:
            for item in await channel.take():
                if isinstance(item, RequestFailed):
                    raise item.error
                yield item
                if item.finished:
                    return
    deadline: float | None = None
    while True:
        items = await channel.take(deadline)
        if not items:  # none came within the interval: the next goes at once
            items = await channel.take()
        # NOTE: a failure ends the request, but outputs may follow it (an action that failed it, e.g. a
        # late fetch of its embeddings, then a step that ran it before its abort): those are not sent
        at = next((k for k, item in enumerate(items) if isinstance(item, RequestFailed)), None)
        failed, items = (None, items) if at is None else (items[at], items[:at])
        sent = time.monotonic()
        if items:
            yield merge(items)
            if items[-1].finished:  # NOTE: a failure after it (a later step failed whole) ends nothing
                return
        if failed is not None:
            raise failed.error
        deadline = sent + interval_s()
