"""Work for one key done once when several threads ask for it at the same time.

Owns: running a key's work in the first caller that asks and handing its outcome to the callers that ask while
it runs (a single flight). Does not own: what the work is or caching its result once done (the preprocessor runs
each new image's processing through one, and the ProcessorCache keeps what it made).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s  # how long a caller waits for another's run before it runs the work itself (s)
        self._lock = threading.Lock()
        self._running: dict[K, Future[V]] = {}  # key -> the outcome of its run under way

    def run(self, key: K, work: Callable[[], V]) -> tuple[V, bool]:
        """(the outcome of `work` for `key`, whether another caller's run made it). A waiter whose run failed,
        or outlasts `wait_s`, runs the work itself: its errors are its own (they name its own request's item)."""
        with self._lock:
            running = self._running.get(key)
            if running is None:
                mine: Future[V] = Future()
                self._running[key] = mine
        if running is not None:
            try:
                return running.result(timeout=self.wait_s), True
            except (Exception, CancelledError):  # NOTE: CancelledError: the run's caller left
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
