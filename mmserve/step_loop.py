"""Drives a step function in a worker thread and fans its outputs out to asyncio consumers.

Owns: the bridge between a synchronous, single-threaded stage (`step() -> outputs`) and many
concurrent async callers, each waiting on the outputs of its own request id. Does not own: what a
step does. Used by the in-process Engine and, unchanged, by the Ray decoder deployment.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any, Protocol

from mmserve.messages import RequestFailed


class Steppable(Protocol):
    def step(self) -> list[Any]: ...  # outputs carrying `.request_id` and `.finished`

    def has_unfinished(self) -> bool: ...

    def abort_all(self) -> None: ...  # after a failed step: drop every request, free everything


class StepLoop:
    def __init__(self, stage: Steppable):
        self.stage = stage
        # request id -> (the event loop its consumer runs on, its queue)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mmserve-step-loop", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def open(self, request_id: str) -> None:
        """Register interest in a request's outputs before it is submitted."""
        self.start()
        self._queues[request_id] = (asyncio.get_running_loop(), asyncio.Queue())

    def notify(self) -> None:
        """New work was handed to the stage: make sure the loop runs."""
        self._wake.set()

    async def outputs(self, request_id: str) -> AsyncIterator[Any]:
        """Outputs of one request until (and including) its finished one; exceptions are raised."""
        _, queue = self._queues[request_id]
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, RequestFailed):
                    raise item.error
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(request_id, None)

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            while not self._stopped and self.stage.has_unfinished():
                try:
                    outputs = self.stage.step()
                except Exception as exc:  # a broken step fails every waiting request, not the loop
                    self._broadcast(exc)
                    self.stage.abort_all()
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item: Any) -> None:
        entry = self._queues.get(request_id)
        if entry is None:
            return  # nobody listens (any more)
        loop, queue = entry
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop closed; it is gone
            self._queues.pop(request_id, None)

    def _broadcast(self, exc: BaseException) -> None:
        for request_id in list(self._queues):
            self._deliver(request_id, exc)
