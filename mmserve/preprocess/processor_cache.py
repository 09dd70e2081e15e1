"""ProcessorCache: a byte-bounded LRU from content hash to the image processor's output.

Owns: the LRU index (key -> storage handle + size), the byte bound, eviction order and statistics, and
the sources: which request bytes (a source key, `hashing.hash_source`) last gave which content hash, so
that a byte-identical repeat is found before its bytes are decoded. A query is one item: a lookup by
source, then (on a miss) by content hash as the second look of the same query.
Does not own: where the values live. A `CacheStorage` keeps them: `InMemoryStorage`, the only one; in the
Ray app its values are small records holding ObjectRefs (the pixels stay in the object store).
NOTE: `get` runs outside the lock, after a lookup took the handle: a storage whose `free` released memory
at once would let a reader race an eviction; `InMemoryStorage` drops a reference only, which the reader holds.
Not owned either: hashing (hashing.py) or running the processor (preprocessor.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from mmserve.config import ProcessorCacheConfig
from mmserve.messages import ProcessedItem, StoredItem

CachedItem = ProcessedItem | StoredItem  # what a FeatureSpec carries: the pixels, or a reference to them


class ItemCache(Protocol):
    """What the Preprocessor needs of a cache: this module's ProcessorCache in one process, a client
    of the shared store in the Ray app. Lookups answer with futures: one already done when the answer is
    at hand, one in flight when it travels (the caller decodes or processes meanwhile)."""

    def find_source(self, source: str) -> Future[tuple[str, CachedItem] | None]:
        """(content hash, item) of the bytes with this source key, if known."""
        ...

    def find(self, key: str, source: str) -> Future[CachedItem | None]:
        """The item with content hash `key`, after `find_source(source)` missed; a hit remembers the source."""
        ...

    def store(self, key: str, item: ProcessedItem, source: str) -> CachedItem: ...


MAX_SOURCES = 65_536  # source keys remembered (each ~200 bytes); NOTE: a bound on memory, not on hits


def done(value: Any) -> Future[Any]:
    """A future that already holds `value`."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class CacheStorage(Protocol):
    """Where cached items live; a handle is whatever `get` and `free` need."""

    def put(self, key: str, item: CachedItem) -> Any: ...

    def get(self, handle: Any) -> CachedItem: ...

    def free(self, handle: Any) -> None: ...


class InMemoryStorage:
    """The handle is the item itself; freeing drops nothing but the index's reference."""

    def put(self, key: str, item: CachedItem) -> CachedItem:
        return item

    def get(self, handle: CachedItem) -> CachedItem:
        return handle

    def free(self, handle: CachedItem) -> None:
        return None


@dataclass(frozen=True)
class ProcessorCacheStats:
    capacity_bytes: int  # the bound (bytes)
    queries: int  # lookups (count)
    hits: int  # lookups that found the key (count)
    evictions: int  # entries dropped to make room (count)
    refused: int  # items not stored because they alone exceed the capacity (count)
    bytes_held: int  # bytes of items currently held (bytes)
    peak_bytes_held: int  # the most bytes ever held at once (bytes)
    entries: int  # items currently held (count)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _Entry:
    handle: Any
    nbytes: int


class ProcessorCache:
    """Thread-safe LRU; `capacity_bytes == 0` disables it (every lookup misses, nothing is stored)."""

    def __init__(self, capacity_bytes: int, storage: CacheStorage | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._storage: CacheStorage = storage if storage is not None else InMemoryStorage()
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._sources: OrderedDict[str, str] = OrderedDict()  # source key -> content hash, LRU first
        self._lock = threading.Lock()
        self._queries = self._hits = self._evictions = self._refused = 0
        self._bytes = self._peak = 0

    @classmethod
    def from_config(cls, config: ProcessorCacheConfig, storage: CacheStorage | None = None) -> ProcessorCache:
        return cls(config.capacity_bytes, storage)

    def get_handle(self, key: str, *, counted: bool = True, hit: bool = True) -> Any | None:
        """The storage handle for `key` (marking it most recently used), or None on a miss; `counted`
        False for the second look of a query already counted; `hit` False when the caller counts the hit
        itself (`count_hit`) once it knows the item can be read.

        NOTE: a hit is never taken back: the counters are exported as Prometheus counters, which must not go
        down (a decrease reads as a restart, and `rate()` adds the whole count again)."""
        with self._lock:
            self._queries += counted
            entry = self._index.get(key)
            if entry is None:
                return None
            self._hits += hit
            self._index.move_to_end(key)
            return entry.handle

    def count_hit(self) -> None:
        """Count the hit of a lookup made with `hit=False` whose item the caller could read."""
        with self._lock:
            self._hits += 1

    def get_source(self, source: str, *, hit: bool = True) -> tuple[str, CachedItem] | None:
        """(content hash, item) last stored or found under the source key `source`; counts a query (and its
        hit unless `hit` is False: see `get_handle`)."""
        with self._lock:
            key = self._sources.get(source)
            if key is not None and key not in self._index:  # its item was evicted meanwhile
                del self._sources[source]
                key = None
            if key is None:
                self._queries += 1
                return None
            self._sources.move_to_end(source)
        handle = self.get_handle(key, hit=hit)
        return None if handle is None else (key, self._storage.get(handle))

    def get_linked(self, key: str, source: str, *, hit: bool = True) -> CachedItem | None:
        """The second look of the query `get_source(source)` missed: by content hash (not counted again as a
        query); a hit remembers `source` for the next time (and is counted unless `hit` is False)."""
        handle = self.get_handle(key, counted=False, hit=hit)
        if handle is None:
            return None
        self.link(source, key)
        return self._storage.get(handle)

    def link(self, source: str, key: str) -> None:
        """Remember that the bytes of `source` give content hash `key`."""
        with self._lock:
            self._sources[source] = key
            self._sources.move_to_end(source)
            while len(self._sources) > MAX_SOURCES:
                self._sources.popitem(last=False)

    def sources(self) -> dict[str, str]:
        """Content hash -> a source key that gives it, for the items held."""
        with self._lock:
            return {key: source for source, key in self._sources.items() if key in self._index}

    def find_source(self, source: str) -> Future[tuple[str, CachedItem] | None]:
        return done(self.get_source(source))

    def find(self, key: str, source: str) -> Future[CachedItem | None]:
        return done(self.get_linked(key, source))

    def peek(self, key: str) -> CachedItem | None:
        """The item under `key`, or None, without counting a lookup or making it recent: for readers
        that are not requests (the encoder's fallback when the maker's copy is lost)."""
        with self._lock:
            entry = self._index.get(key)
        return None if entry is None else self._storage.get(entry.handle)

    def get(self, key: str, *, hit: bool = True) -> CachedItem | None:
        handle = self.get_handle(key, hit=hit)
        return None if handle is None else self._storage.get(handle)

    def store(self, key: str, item: ProcessedItem, source: str | None = None) -> ProcessedItem:
        """Cache `item` if it fits; return what a FeatureSpec should carry (here: the item itself)."""
        self.put(key, item, source)
        return item

    def put(self, key: str, item: CachedItem, source: str | None = None) -> bool:
        """Store `item` (made from the bytes of `source`, if given), evicting LRU entries until it fits;
        False if it can never fit."""
        stored = self._put(key, item)
        if stored and source is not None:
            self.link(source, key)
        return stored

    def _put(self, key: str, item: CachedItem) -> bool:
        nbytes = item.nbytes
        with self._lock:
            if self.capacity_bytes == 0:
                return False
            if nbytes > self.capacity_bytes:
                self._refused += 1
                return False
            if key in self._index:
                self._index.move_to_end(key)
                return True
        handle = self._storage.put(key, item)  # NOTE: outside the lock; a store may be slow
        with self._lock:
            to_free = self._insert(key, _Entry(handle, nbytes))
        for old in to_free:
            self._storage.free(old)
        return True

    def _insert(self, key: str, entry: _Entry) -> list[Any]:
        """Under the lock: add `entry` after evicting; returns handles to free outside the lock."""
        if key in self._index:  # another thread stored it meanwhile; keep theirs
            self._index.move_to_end(key)
            return [entry.handle]
        to_free = []
        while self._bytes + entry.nbytes > self.capacity_bytes:
            _, old = self._index.popitem(last=False)
            self._bytes -= old.nbytes
            self._evictions += 1
            to_free.append(old.handle)
        self._index[key] = entry
        self._bytes += entry.nbytes
        self._peak = max(self._peak, self._bytes)
        return to_free

    def replace(self, key: str, item: CachedItem) -> bool:
        """Swap what `key` holds for an equal-sized copy (recency unchanged); False if `key` is gone."""
        handle = self._storage.put(key, item)  # NOTE: outside the lock; a store may be slow
        with self._lock:
            entry = self._index.get(key)
            swapped = entry is not None and entry.nbytes == item.nbytes
            if swapped:
                handle, entry.handle = entry.handle, handle  # type: ignore[union-attr]
        self._storage.free(handle)  # the old one, or the unused new one
        return swapped

    def discard(self, key: str) -> None:
        """Forget `key` if held (not counted as an eviction)."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._bytes -= entry.nbytes
        if entry is not None:
            self._storage.free(entry.handle)

    def __contains__(self, key: str) -> bool:
        """Membership without counting a query or touching recency."""
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._index)

    def clear(self) -> None:
        with self._lock:
            handles = [e.handle for e in self._index.values()]
            self._index.clear()
            self._sources.clear()
            self._bytes = 0
        for handle in handles:
            self._storage.free(handle)

    def stats(self) -> ProcessorCacheStats:
        with self._lock:
            return ProcessorCacheStats(
                capacity_bytes=self.capacity_bytes, queries=self._queries, hits=self._hits,
                evictions=self._evictions, refused=self._refused, bytes_held=self._bytes,
                peak_bytes_held=self._peak, entries=len(self._index),
            )
