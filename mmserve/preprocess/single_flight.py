"""Work for one key done once when several threads ask for it at the same time.

Owns: running a key's work in the first caller that asks and handing its outcome to the callers that ask while
it runs (a single flight). Does not own: what the work is or caching its result once done (the preprocessor runs
each new image's processing through one, and the ProcessorCache keeps what it made).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
POLL_S = 0.1  # how often a waiter asks whether its own caller left (s)


class SingleFlight(Generic[K, V]):
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s  # how long a caller waits for another's run before it runs the work itself (s)
        self._lock = threading.Lock()
        self._running: dict[K, Future[V]] = {}  # key -> the outcome of its run under way

    def run(self, key: K, work: Callable[[], V], cancelled: Callable[[], bool] = lambda: False) -> tuple[V, bool]:
        """(the outcome of `work` for `key`, whether another caller's run made it). A waiter whose run failed,
        or outlasts `wait_s`, runs the work itself: its errors are its own (they name its own request's item).
        A waiter whose own caller left (`cancelled()`, asked every POLL_S while it waits) raises CancelledError."""
        with self._lock:
            running = self._running.get(key)
            if running is None:
                mine: Future[V] = Future()
                self._running[key] = mine
        if running is not None:
            if (outcome := self._wait(running, cancelled)) is not None:
                return outcome[0], True
            if cancelled():
                raise CancelledError("the caller left while another request processed the same item")
            return work(), False
        try:
            value = work()
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._running[key]
        mine.set_result(value)
        return value, False

    def _wait(self, running: Future[V], cancelled: Callable[[], bool]) -> tuple[V] | None:
        """(the run's outcome,), or None when it failed, outlasted `wait_s` or the caller left."""
        deadline = time.monotonic() + self.wait_s
        while not cancelled():
            try:
                return (running.result(timeout=min(POLL_S, max(deadline - time.monotonic(), 0.0))),)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    return None
            except (Exception, CancelledError):  # NOTE: CancelledError: the run's caller left
                return None
        return None
