"""The encoder cache's lookups as the stats count them, and what the stage owes its cache's recency.

Owns: the query, hit and early-found counts; the entries an early encode made for a request still on its way
(and the phases of the step that made them, which that request's own lookup takes as its own); and the entries
served from the cache off the step thread (`EncoderStage.cached`), whose recency the next step books. Does not
own the cache's books (`EncoderCacheManager`) nor when lookups happen (`EncoderStage`).

NOTE: an early encode's work is counted as the miss it was for the request it ran ahead of: its own lookups are
not counted, and that request's first hit on an entry made for it is not a hit.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from mmserve.messages import PhaseTimes

TOUCHES_KEPT = 4096  # entries served from the cache whose recency a step has still to book (entries)


class Lookups:
    def __init__(self) -> None:
        self.queries = 0  # a request's lookups by a step (count)
        self.hits = 0  # of those, the ones that found their entry (count)
        self.early_found = 0  # of those, entries an early encode made for that request: its misses (count)
        # entries an early encode made that no request has found yet -> the phases of the step that made them
        self.early: dict[str, PhaseTimes] = {}
        self._served = 0  # lookups of requests served from the cache off the step thread, all hits (count)
        self._served_lock = threading.Lock()
        # what those requests found, for the next step to make the newest unreferenced; bounded (recency hints:
        # the oldest may go unapplied on a stage that serves only such requests for a long while)
        self._touched: deque[str] = deque(maxlen=TOUCHES_KEPT)

    @property
    def total_queries(self) -> int:
        return self.queries + self._served

    @property
    def total_hits(self) -> int:
        return self.hits + self._served

    def looked_up(self, identifier: str, hit: bool, early: bool) -> PhaseTimes:
        """Count a step's lookup of `identifier` for a request (`early`: an early encode's) -> the phases to add to
        the request's own (those of the step that made the entry for it ahead of it)."""
        if early:
            if not hit:
                self.early[identifier] = ()  # its step's phases once it has run (`encoded_early`)
            return ()
        self.queries += 1
        # NOTE: `hit` too: an early entry evicted earlier in this step (forgotten by `forget` after it) is this
        # request's own miss again
        if hit and identifier in self.early:
            self.early_found += 1
            return self.early.pop(identifier)
        self.hits += hit
        return ()

    def encoded_early(self, identifier: str, phases: PhaseTimes) -> None:
        """The phases of the step that encoded an early entry, for the request it was made for."""
        if identifier in self.early:
            self.early[identifier] = phases

    def forget(self, evicted: Iterable[str]) -> None:
        for identifier in evicted:
            self.early.pop(identifier, None)

    def served(self, identifiers: list[str]) -> bool:
        """Count a request served from the cache off the step thread (any thread), unless an entry it found
        was made early for a request still to come (False: it must take the step, which times it for that one)."""
        if any(identifier in self.early for identifier in identifiers):
            return False
        with self._served_lock:
            self._served += len(identifiers)
        self._touched.extend(identifiers)
        return True

    def take_touched(self) -> list[str]:
        """The entries served since the last call, oldest first (on the step thread)."""
        taken = []
        while self._touched:
            taken.append(self._touched.popleft())
        return taken
