"""Running llguidance's grammar compiles on threads with a deep stack.

Owns: a few daemon threads made with a stack of `STACK_BYTES`, and running a call on one of them for its
caller. Does not own what is compiled (constraint.py, grammar.py).

NOTE: llguidance compiles a JSON schema recursively, as deep as the schema nests through its references, and its
reference resolution (anchors, `$id` bases, its own walk order) cannot be bounded reliably beforehand: ~1,000
levels overflowed an 8 MiB thread stack and killed the process (thirty-fifth session). A 1 MiB schema nests at
most some 10,000 levels that way, ~80 MiB of stack; these threads have 512 MiB, reserved, not committed (the
pages a compile does not touch are never mapped in).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
STACK_BYTES = 512 << 20
THREADS = 2  # compiles at once in a process (a large one takes seconds; the next is not held behind it)

_lock = threading.Lock()
_work: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] | None = None


def on_big_stack(call: Callable[[], T]) -> T:
    """`call()`'s result (or its exception), run on a thread with a deep stack; the caller waits for it."""
    done: Future[T] = Future()
    _queue().put((call, done))
    return done.result()


def _queue() -> queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]:
    global _work
    with _lock:
        if _work is None:
            work: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
            previous = threading.stack_size(STACK_BYTES)  # NOTE: process-wide, for the threads made here only
            try:
                for k in range(THREADS):
                    threading.Thread(target=_serve, args=(work,), name=f"mmserve-compile-{k}", daemon=True).start()
            finally:
                threading.stack_size(previous)
            _work = work
        return _work


def _serve(work: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]]) -> None:
    while True:
        call, done = work.get()
        try:
            done.set_result(call())
        except BaseException as exc:
            done.set_exception(exc)
