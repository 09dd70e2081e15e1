"""How many images one process decodes and processes at once.

Owns: a bound on the CPU- and memory-heavy part of an image's way (its lookup, decode, hash and the HF
processor: `Preprocessor._load_items`), so that a process serving many requests at once, most of them waiting on
their images' fetches, does not also hold as many decoded images in memory (up to `media.max_image_pixels` RGB
each) as it has requests; a wait for a slot ends when its caller leaves. Does not own the fetches (they wait on
the network, unbounded here) nor the request bound (the host's: Serve's `max_ongoing_requests`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError

POLL_S = 0.05  # how often a wait for a slot asks whether its caller has left (s)


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's cpuset), at least 1."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class ImageSlots:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"image slots must be at least 1, got {slots}")
        self.slots = slots
        self._free = threading.BoundedSemaphore(slots)

    @contextlib.contextmanager
    def held(self, cancelled: Callable[[], bool]) -> Iterator[None]:
        """Hold a slot for the body; raises concurrent.futures.CancelledError if `cancelled()` while waiting."""
        while not self._free.acquire(timeout=POLL_S):
            if cancelled():
                raise CancelledError("the caller left while its image waited for a slot")
        try:
            yield
        finally:
            self._free.release()
