"""Torch work done in a thread that ends with it, so that one stage process keeps one OpenMP thread pool.

Owns: `in_passing_thread`. Does not own how many threads torch uses (`step_threads.py`) nor which work
goes there (the stage builders and the encoder's runner choose).

NOTE: why: with libgomp (the OpenMP of torch's Linux CPU builds) every thread that starts a parallel
region gets its own pool of worker threads, kept as long as that thread lives. Once the pools' threads
outnumber the CPUs, libgomp stops spinning between regions, so each of a decode step's ~100 small
regions wakes its workers from sleep. Measured on a small VM (docs/benchmarks.md): a decode step in the
step thread took far longer where the model had been loaded and calibrated in the main thread than where
no other thread had run a region; an idle second pool added to every region.
So a stage is built (weights loaded, kernels timed) in a passing thread, and the in-process engine's
encoder runs each vision forward in one: the step thread's pool is then alone most of the time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def in_passing_thread(fn: Callable[[], T], name: str = "mmserve-passing") -> T:
    """`fn()` run in a new thread at the calling thread's torch thread count, joined: its result, or its
    exception raised here.

    NOTE: a new thread starts at the count that any thread set last (`torch.set_num_threads` also sets the
    default of threads started later), e.g. another stage's step thread that just chose one thread for its
    decodes; so the count is the caller's, whatever ran meanwhile.
    """
    threads = torch.get_num_threads()
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            # NOTE: torch sets a thread's count up lazily, from the last count set anywhere; asking first does that
            # set-up now, so that a count set elsewhere before `fn`'s first parallel op cannot replace ours
            torch.get_num_threads()
            torch.set_num_threads(threads)
            result.append(fn())
        except BaseException as exc:  # NOTE: re-raised in the caller's thread, whatever it is
            error.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
