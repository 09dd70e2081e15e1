"""The cluster-wide ProcessorCache: one store deployment indexes the objects, every preprocess replica
shares it through a small client.

Owns: translating mmserve's `ItemCache` calls into Ray. A preprocess replica `ray.put`s the pixels it
made and hands that ref on at once; the store indexes the maker's ref (`adopt`) and copies the item into an
object of its own on its first hit there (mmserve/preprocess/shared_copies.py), so that an item found there outlives the
replica that made it; an item only its maker found again (from its own refs, below) is copied when that
replica shuts down gracefully (`keep`), and dies with it in a crash (a miss the next time). The store keeps
the byte-bounded LRU index of these ObjectRefs (mmserve's ProcessorCache, with refs as its storage
handles). Each preprocess replica also keeps its own refs to the items it made lately (a second, smaller
LRU, `processor_cache.replica_capacity_bytes`): a repeat there is a hit without the store's hop, and when a
lookup shows a new store (a replacement after a death starts empty, under a new epoch) the replica has it
adopt those items again, so the index is rebuilt from what the replicas still hold. A lookup is by the
request's bytes first (their source key: a repeat is found before it is decoded), then by the pixels'
content hash; while either travels to the store, the replica decodes or processes meanwhile
(mmserve/preprocess/preprocessor.py), so a new image pays no lookup hop. Resolving pixels for the encoder
falls back to the store's copy if the maker is gone. Does not own the LRU policy
(mmserve/preprocess/processor_cache.py).

NOTE: the object store holds at most the index's bytes (`capacity_bytes`; an entry not copied yet lives on
its maker's node) plus each preprocess replica's own refs (`replica_capacity_bytes`), which the index's
entries overlap until they are copied. Only objects the replica owns are held, so none of them can be lost
while it serves them.

NOTE: Ray 2.56 removed `ray.put(_owner=...)`, which would have let the store own the first copy. Sending
the pixels to the store and waiting for its ref cost the request several times a local `ray.put`
(docs/benchmarks.md, "What moved the figures").
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from time import monotonic  # NOTE: a name of its own, which a test may replace for this module alone
from typing import Any

import ray
from ray import serve
from ray.exceptions import GetTimeoutError, ObjectLostError, OwnerDiedError

from deployments.handles import FromThread
from deployments.metrics_hub import MetricsReporter
from deployments.replica_logs import route_logs
from deployments.retry import replica_lost
from mmserve.messages import MultiModalFeatureSpec, ProcessedItem, StoredItem, StoreLookup
from mmserve.preprocess.processor_cache import (
    CachedItem,
    InMemoryStorage,
    ProcessorCache,
    ProcessorCacheStats,
    done,
)
from mmserve.preprocess.shared_copies import ItemLostError, Keeper, MakerGoneError
from mmserve.runtime.metrics import MetricsSnapshot, processor_cache_snapshot

log = logging.getLogger(__name__)
# NOTE: a lookup answers in about a millisecond; this long means the store is down or restarting (Serve
# queues calls to a deployment without replicas), and the item is cheaper to process again.
LOOKUP_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0  # reading pixels from the object store (another node's: a transfer)
# copies a hand-over makes at once (its maker's own recent items first): the store's worker threads stay free
# for the cluster's lookups and first-hit copies meanwhile
KEEP_AT_ONCE = 4


async def read_stored(item: StoredItem) -> ProcessedItem:
    """A stored item's pixels (zero-copy from this node's object store; from another node's, a transfer), its
    loss as mmserve's errors: the maker's death (MakerGoneError), any other loss or a read past its timeout."""
    try:
        made: ProcessedItem = await asyncio.wait_for(item.ref, READ_TIMEOUT_S)
    except OwnerDiedError as exc:
        raise MakerGoneError(str(exc)) from exc
    except (ObjectLostError, GetTimeoutError, TimeoutError) as exc:
        raise ItemLostError(f"{type(exc).__name__}: {exc}") from exc
    return made


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  logging_config={"enable_access_log": False})  # NOTE: internal calls; no per-call log line
class ProcessorCacheStore:
    def __init__(self, capacity_bytes: int, hub: Any, metrics_push_interval_s: float):
        route_logs()
        # NOTE: the index's values are StoredItems (ObjectRefs), so the plain in-memory storage fits: an
        # evicted entry drops the index's ref, and Ray frees the object once no in-flight spec borrows it.
        self.cache = ProcessorCache(capacity_bytes, InMemoryStorage())
        self.epoch = uuid.uuid4().hex  # NOTE: a replacement replica starts empty: its clients must know
        self.keeper = Keeper(self.cache, read_stored, ray.put)
        self._handing: set[asyncio.Future] = set()  # hand-overs' copies under way (held: the loop keeps weak refs)
        self.reporter = MetricsReporter(hub, "ProcessorCacheStore", self.metrics, metrics_push_interval_s)
        self.reporter.ensure_started()

    async def lookup(self, key: str, source: str | None = None) -> StoreLookup:
        """The entry with content hash `key`; with `source`, the second look of that source's query (a hit
        remembers it)."""
        self.reporter.ensure_started()
        item = self.cache.get(key, hit=False) if source is None else self.cache.get_linked(key, source, hit=False)
        return StoreLookup(self.epoch, await self.keeper.kept(key, item, counted=True), key)

    async def lookup_source(self, source: str) -> StoreLookup:
        """The entry the bytes with source key `source` gave, and its content hash."""
        self.reporter.ensure_started()
        found = self.cache.get_source(source, hit=False)
        if found is None or (kept := await self.keeper.kept(*found, counted=True)) is None:
            return StoreLookup(self.epoch, None)
        return StoreLookup(self.epoch, kept, found[0])

    async def kept_copy(self, key: str) -> CachedItem | None:
        """The store's copy of `key` for the encoder's fallback: not a request's lookup, so it is neither
        counted in the hit rate nor made recent."""
        return await self.keeper.kept(key, self.cache.peek(key), counted=False)

    async def adopt(self, key: str, boxed: list[ray.ObjectRef], num_tiles: int, nbytes: int,
                    source: str | None = None, maker: str | None = None) -> None:
        """Index the ProcessedItem behind `boxed[0]`, made by the worker `maker`, under its content hash `key`
        (found by the source key of the bytes it came from too), if it fits the byte bound; it is copied on
        its first hit here.

        NOTE: the ref travels inside a list so that it arrives as a ref (a top-level one would be resolved
        on the way in).
        """
        self.keeper.adopt(key, StoredItem(ref=boxed[0], num_tiles=num_tiles, nbytes=nbytes), source, maker)

    async def keep(self, keys: list[str], maker: str | None = None) -> int:
        """Copy the entries of `keys`, and every entry the worker `maker` made, that are still their maker's (a
        maker shutting down hands them over: requests in flight may carry items its own cache let go); how many
        are kept now."""
        keys = list(dict.fromkeys([*keys, *(self.keeper.made_by(maker) if maker is not None else ())]))
        room = asyncio.Semaphore(KEEP_AT_ONCE)

        async def one(key: str) -> StoredItem | None:
            async with room:  # NOTE: the entry read when its turn comes (it may have been replaced meanwhile)
                return await self.keeper.kept(key, self.cache.peek(key), counted=False, wait_s=None)

        # NOTE: shielded: the maker stops waiting after its hand-over's timeout, and the copies not yet made
        # go on while its objects may still be read (it is shutting down, not gone)
        copies = asyncio.ensure_future(asyncio.gather(*(one(key) for key in keys)))
        self._handing.add(copies)
        copies.add_done_callback(self._handed)
        kept = await asyncio.shield(copies)
        return sum(item is not None and item.kept for item in kept)

    def _handed(self, copies: asyncio.Future) -> None:
        """A hand-over's copies ended: forget them; a failure is logged (its caller may have stopped waiting)."""
        self._handing.discard(copies)
        if not copies.cancelled() and copies.exception() is not None:
            log.warning("a hand-over's copies failed: %r", copies.exception())

    async def held(self, key: str) -> CachedItem | None:
        """Read-only introspection (tests, debugging): the entry for `key` as it is, neither kept nor counted."""
        return self.cache.peek(key)

    def metrics(self) -> MetricsSnapshot:
        return processor_cache_snapshot(self.cache.stats())

    async def __del__(self) -> None:
        """Serve calls this on a graceful shutdown: the last metrics (see MetricsReporter.close)."""
        if (reporter := getattr(self, "reporter", None)) is not None:  # None: __init__ failed
            await reporter.close()


def _key_and_item(found: StoreLookup) -> tuple[str, StoredItem] | None:
    return None if found.item is None or found.key is None else (found.key, found.item)


class SharedProcessorCache:
    """mmserve's `ItemCache` for a preprocess replica; `bind()` on the replica's loop, then call from a
    worker thread (it blocks)."""

    def __init__(self, store: Any, replica_capacity_bytes: int, *, shared: bool = True):
        """`store`: a DeploymentHandle to ProcessorCacheStore; `shared` False (the cache off: a store of 0 bytes)
        asks it nothing and sends it nothing, so a new image pays no store hop for a cache that keeps nothing."""
        self._store = FromThread(store)
        self.bind = self._store.bind
        self.own = ProcessorCache(replica_capacity_bytes)  # key -> StoredItem of an object this replica made
        self._shared = shared
        self._maker = ray.get_runtime_context().get_worker_id()  # the owner of those objects, for the store
        self._epoch: str | None = None  # of the store that answered the last lookup
        self._lock = threading.Lock()
        self._down_until = 0.0  # lookups are misses at once until then (s, monotonic)

    def find_source(self, source: str) -> Future[tuple[str, CachedItem] | None]:
        """An item this replica made from these bytes (answered at once), else the store's (in flight)."""
        mine = self.own.get_source(source)
        if mine is not None:
            return done(mine)
        return self._ask("lookup_source", source)

    def find(self, key: str, source: str) -> Future[CachedItem | None]:
        """An item this replica made with these pixels (answered at once), else the store's (in flight)."""
        mine = self.own.get_linked(key, source)
        if mine is not None:
            return done(mine)
        return self._ask("lookup", key, source, pick=lambda found: found.item)

    def store(self, key: str, item: ProcessedItem, source: str) -> StoredItem:
        ref = ray.put(item)  # owned by this replica; the request carries it on at once
        stored = StoredItem(ref=ref, num_tiles=item.num_tiles, nbytes=item.nbytes)
        self._adopt(key, stored, source)
        self.own.put(key, stored, source)
        return stored

    def _adopt(self, key: str, stored: StoredItem, source: str | None) -> None:
        """Have the store index an item this replica made; not awaited: the store indexes it on arrival (and
        copies it on its first hit there).

        NOTE: not while the store is taken as down, and each call given up after a lookup's timeout: calls to a
        store being replaced queue, each pinning its pixels for as long as the outage lasts. A replaced store is
        refilled with every item this replica holds once it answers (`_notice`)."""
        if not self._shared or monotonic() < self._down_until:
            return
        self._store.submit("adopt", key, [stored.ref], stored.num_tiles, stored.nbytes, source, self._maker,
                           timeout_s=LOOKUP_TIMEOUT_S).add_done_callback(self._adopted)

    def _adopted(self, asked: Future[Any]) -> None:
        """An adopt's end: one the store did not take is logged (its item is a miss elsewhere), and a store that
        did not answer is taken as down, as by a lookup."""
        try:
            asked.result()
        except CancelledError:  # NOTE: the replica's loop going down cancels its calls: nothing to tell
            return
        except BaseException as exc:
            if not self._taken_down(exc):
                log.warning("the processor cache store did not index an item: %r", exc)

    def _ask(self, method: str, *args: Any, pick: Callable[[StoreLookup], Any] = _key_and_item) -> Future[Any]:
        """The store's answer, through `pick`, as a future; a store that is down or slow answers None (a
        miss: the item is processed again), never a failed request.

        NOTE: a store that did not answer is taken as down for a lookup's timeout: while Serve replaces it,
        calls to it queue, and each of a request's lookups (two per new image) would wait the whole timeout.
        """
        if not self._shared or monotonic() < self._down_until:
            return done(None)
        answer: Future[Any] = Future()

        def settle(asked: Future[Any]) -> None:
            try:
                found: StoreLookup = asked.result()
            except BaseException as exc:  # NOTE: a cancelled call too: the waiting request must hear of it
                if self._taken_down(exc):
                    answer.set_result(None)
                else:
                    answer.set_exception(exc)
                return
            try:
                picked = pick(found)
            except Exception as exc:  # NOTE: the request waiting on `answer` must hear of it (a malformed answer)
                answer.set_exception(exc)
                return
            answer.set_result(picked)
            self._notice(found.epoch)  # NOTE: after the answer: a refill must not hold up the request

        self._store.submit(method, *args, timeout_s=LOOKUP_TIMEOUT_S).add_done_callback(settle)
        return answer

    def _taken_down(self, exc: BaseException) -> bool:
        """Whether `exc` says the store is unavailable (lost, or no answer in time): then it is taken as down for
        a lookup's timeout (logged once, as it goes down)."""
        if not (replica_lost(exc) or isinstance(exc, TimeoutError)):
            return False
        if monotonic() >= self._down_until:
            log.warning("processor cache store unavailable (%s); misses for %.0f s", type(exc).__name__,
                        LOOKUP_TIMEOUT_S)
        self._down_until = monotonic() + LOOKUP_TIMEOUT_S
        return True

    def hand_over(self, timeout_s: float) -> Future[int]:
        """On this replica's graceful shutdown: have the store copy the items this replica made (requests in
        flight may carry them, those its own cache let go too), before they go with it; the number kept."""
        return self._store.submit("keep", self.own.keys(), self._maker, timeout_s=timeout_s)

    def own_stats(self) -> ProcessorCacheStats:
        return self.own.stats()

    def _notice(self, epoch: str) -> None:
        """A store this replica has not heard from before: if it replaced one (which died, and its index
        with it), have it adopt every item this replica still holds."""
        with self._lock:
            replaced, self._epoch = self._epoch is not None and self._epoch != epoch, epoch
        if not replaced:
            return
        keys, sources = self.own.keys(), self.own.sources()
        log.info("processor cache store replaced; refilling it with the %d items this replica holds", len(keys))
        for key in keys:
            stored = self.own.peek(key)
            if isinstance(stored, StoredItem):
                self._adopt(key, stored, sources.get(key))


class PixelResolver:
    """The encoder's `resolve`: a StoredItem's pixels (zero-copy numpy on the same node); `bind()` on the
    replica's loop, then call from a worker thread. If the replica that made them is gone before the
    encoder reads them (downscaled or crashed), the store's adopted copy serves instead. A step's items are
    brought together first (`prefetch`): their transfers overlap, under one timeout."""

    def __init__(self, store: Any):  # a DeploymentHandle to ProcessorCacheStore
        self._store = FromThread(store)
        self.bind = self._store.bind

    @staticmethod
    def prefetch(specs: Sequence[MultiModalFeatureSpec]) -> list[bool]:
        """Bring every item's pixels to this node together, waiting at most one read's timeout in all -> whether
        each is here (or known lost: `__call__` then falls back to the store's copy)."""
        refs = list(dict.fromkeys(s.data.ref for s in specs if isinstance(s.data, StoredItem)))  # once each
        if len(refs) < 2:  # NOTE: nothing to overlap; `__call__`'s own read has the same timeout
            return [True] * len(specs)
        _, not_here = ray.wait(refs, num_returns=len(refs), timeout=READ_TIMEOUT_S, fetch_local=True)
        late = set(not_here)
        return [not (isinstance(s.data, StoredItem) and s.data.ref in late) for s in specs]

    def __call__(self, spec: MultiModalFeatureSpec) -> ProcessedItem:
        data = spec.data
        if not isinstance(data, StoredItem):
            return data
        try:
            return ray.get(data.ref, timeout=READ_TIMEOUT_S)
        except ObjectLostError as lost:  # OwnerDiedError included
            # NOTE: whatever goes wrong from here, the loss is the reason reported: callers retry a request
            # whose pixels were lost from its preprocessing on (deployments/retry.py)
            try:
                kept = self._store.call("kept_copy", spec.identifier, timeout_s=LOOKUP_TIMEOUT_S)  # key: the hash
                if isinstance(kept, StoredItem):
                    log.info("pixels of %s lost with their maker; using the store's copy", spec.identifier)
                    return ray.get(kept.ref, timeout=READ_TIMEOUT_S)
            except Exception:
                log.warning("no kept copy of %s either", spec.identifier, exc_info=True)
            raise lost from None
