"""Which items one encoder step books: the pending requests' next items, in turns, under the step's limits.

Owns: the order of booking (rounds over the pending requests, each taking its next cached items and at most
one miss a round, in the stage's turn order), when a step stops booking (a miss that does
not fit its compute budget, its forward's crops or the cache), which request may start, and the rule that
keeps partly booked requests from holding each other's room (below). Does not own: the books themselves
(`EncoderCacheManager`), the tensors, nor the forward (`EncoderStage`).

NOTE: turns, not first come first served per request: an 8-image prompt of pan-and-scan crops booked whole
before the next request would hold every single image behind it for all of its forwards; in turns, each
request's next item goes into the same forward, so a one-image request is handed out after one forward.
Requests still start in arrival order (only the oldest not yet started may start), and none is passed over
for good: a later arrival never starts before an earlier one.

NOTE: a request references its items from their booking until it is handed out whole. Started requests
that all wait for room each other holds would wait for ever; so a request starts only when the rows it
still needs fit, together with those every started request still needs, in what no request holds
(free or evictable). Every later booking of a started request keeps that true (its rows move from
"needed" to "held"), so each started request can always finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mmserve.encoder.cache_manager import EncoderCacheManager
from mmserve.encoder.outputs import Resolver
from mmserve.messages import MultiModalFeatureSpec


@dataclass(eq=False)
class Pending:
    request_id: str
    features: list[MultiModalFeatureSpec]
    resolve: Resolver
    early: bool = False  # an early encode (`add_request`): its lookups are not counted
    next_index: int = 0  # features before it are booked (hit or allocated) for this request
    arrived: float = field(default_factory=time.perf_counter)  # added to the stage (s, perf_counter)
    timings: list[tuple[str, float]] = field(default_factory=list)  # steps that encoded its items, early too (ms)

    @property
    def done(self) -> bool:
        return self.next_index == len(self.features)

    @property
    def started(self) -> bool:
        return 0 < self.next_index < len(self.features)


Miss = tuple[Pending, MultiModalFeatureSpec]


class StepBooking:
    """One step's booking; `run` returns its misses (each request's at most once per round)."""

    def __init__(self, manager: EncoderCacheManager, cached: Callable[[str], bool], budget: int, max_items: int,
                 count: Callable[[Pending, str, bool], None]) -> None:
        self.manager, self.cached, self.count = manager, cached, count
        self.budget = budget  # embedding rows left to encode this step
        self.max_items = max_items  # crops one forward takes
        self.crops = 0  # crops booked this step
        self.misses: list[Miss] = []
        self._needs: dict[str, int] = {}  # started request -> rows it still needs and holds no reference to
        self._arrival: list[Pending] = []  # the pending requests, in arrival order

    def run(self, turns: list[Pending], arrival: Iterable[Pending]) -> list[Miss]:
        """The step's misses, its rounds visiting the pending requests in `turns` order (the stage's: a new
        request at the back, and after each step those up to its last miss's request moved behind the rest);
        `arrival`: the same requests in arrival order.

        NOTE: the turns go round from step to step, not only within one: a forward of one crop (a CPU's) holds
        one miss, and the oldest request would else take it every step. A request whose miss does not fit stops
        the turns of those after it this step, not of those before it: they go on booking in turns (else one
        refusal would leave them one item a forward). Only the oldest request not yet started may start, when
        there is room for it; until then it and those after it wait, and nobody else's turn stops for them.
        """
        self._arrival = list(arrival)
        self._needs = {req.request_id: self._needed(req) for req in self._arrival if req.started}
        queue = list(turns)
        booked = True
        while booked:  # NOTE: a round that books nothing ends the step (those left may not start yet)
            booked, queue = False, [req for req in queue if not req.done]
            for i, req in enumerate(queue):
                if not req.started and (req is not self._oldest_unstarted() or not self._may_start(req)):
                    continue  # NOTE: waits for its elders' starts, or for room: it stops nobody's turn
                before = req.next_index
                turn = self._book_turn(req)
                booked |= req.next_index > before
                if not turn:
                    queue = queue[:i]
                    break
        return self.misses

    def _book_turn(self, req: Pending) -> bool:
        """Book `req`'s next items up to and including one miss; False when the step books no more."""
        while not req.done:
            spec = req.features[req.next_index]
            hit = self.manager.check_and_update_cache(req.request_id, spec.identifier)
            if not hit:
                self._hold_cached_rest(req)
                if not self._allocate(req, spec):
                    return False
            self.count(req, spec.identifier, hit)
            req.next_index += 1
            self._needs[req.request_id] = self._needed(req)
            if req.done:
                del self._needs[req.request_id]
            if not hit:
                return True
        return True

    def _allocate(self, req: Pending, spec: MultiModalFeatureSpec) -> bool:
        # NOTE: a step's first miss may take more than the budget and then runs alone, as an item with more
        # crops than one forward does (vLLM too raises its budget to the largest item)
        room = self.budget if self.misses else max(self.budget, spec.num_embeds)
        tiles = _num_tiles(spec)
        if (self.misses and self.crops + tiles > self.max_items) or \
                not self.manager.can_allocate(spec.num_embeds, room):
            return False
        self.manager.allocate(req.request_id, spec.identifier, spec.num_embeds)
        self.budget -= spec.num_embeds
        self.crops += tiles
        self.misses.append((req, spec))
        return True

    def _oldest_unstarted(self) -> Pending | None:
        return next((req for req in self._arrival if req.next_index == 0 and not req.done), None)

    def _may_start(self, req: Pending) -> bool:
        """Whether what no request holds (free or evictable rows) has room for every row `req` needs beside
        those every started request still needs."""
        room = self.manager.num_free_tokens + self.manager.num_freeable_tokens
        return room >= sum(self._needs.values()) + self._needed(req)

    def _needed(self, req: Pending) -> int:
        """Rows of `req`'s items not booked yet that no request references (its own bookings included)."""
        rows = {spec.identifier: spec.num_embeds for spec in req.features[req.next_index:]
                if self.manager.refcount(spec.identifier) == 0}
        return sum(rows.values())

    def _hold_cached_rest(self, req: Pending) -> None:
        """Reference the request's later items that are encoded now, before one of its misses makes room: the
        room must not be made by evicting what the request itself is about to hit. NOTE: its distinct items fit
        the cache together (checked at add), so holding them cannot keep its own misses out; one booked this step
        is not held (its booker keeps it from eviction, and a reference would fail this request with its booker
        should its encoding fail)."""
        for spec in req.features[req.next_index + 1:]:
            if self.cached(spec.identifier):
                self.manager.check_and_update_cache(req.request_id, spec.identifier)


def _num_tiles(spec: MultiModalFeatureSpec) -> int:
    """Crops the item's pixels hold (ProcessedItem and StoredItem both say); 1 if it carries none."""
    return int(getattr(spec.data, "num_tiles", 1))
