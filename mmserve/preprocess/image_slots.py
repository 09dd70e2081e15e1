"""Bounds on a process's image work: slots, each held by one image or one request at a time.

Owns: the bounded, cancellable slots (`ImageSlots`) that `Preprocessor._load_items` takes for the CPU- and
memory-heavy part of an image's way (its lookup, decode, hash and the HF processor: one slot per core of the
process), and for a request whose images are fetched from the network (its reads, in parallel, and its images'
bytes until all are processed: `FETCHING_PER_CORE` requests per core), so that a process serving many requests at
once holds neither as many decoded images nor as many fetched ones as it has requests, while requests without a
fetch (text, data: URLs) do not wait behind slow ones until those fill every thread; a wait ends when its caller
leaves. NOTE: both bounds scale with the cores the process may compute on at once (`core_company.usable_cores`:
its CPU affinity within its CPU quota), and so does what they hold: up to `FETCHING_PER_CORE` x cores x
`media.max_images_per_prompt` x `media.max_image_bytes` of fetched bytes. Does not own the request bound (the
host's: Serve's `max_ongoing_requests`) nor the fetches themselves (media.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError

POLL_S = 0.05  # how often a wait for a slot asks whether its caller has left (s)
# requests fetching images from the network at once, per core: each holds its images' bytes (up to
# media.max_images_per_prompt of media.max_image_bytes each) until all are processed
FETCHING_PER_CORE = 4


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


def held(slots: ImageSlots | None, cancelled: Callable[[], bool]) -> contextlib.AbstractContextManager[None]:
    """A slot of `slots` held for the `with` body (none where `slots` is None)."""
    return slots.held(cancelled) if slots is not None else contextlib.nullcontext()
