"""processor_cache.py: byte bound, LRU order, refusals, stats, storage interface, threads."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from mmserve.config import ProcessorCacheConfig
from mmserve.messages import ProcessedItem
from mmserve.preprocess.processor_cache import CachedItem, ProcessorCache


def item(nbytes: int) -> ProcessedItem:
    return ProcessedItem(pixel_values=np.zeros(nbytes, dtype=np.uint8))


def test_hit_miss_and_stats() -> None:
    cache = ProcessorCache(1000)
    assert cache.get("a") is None
    stored = item(400)
    assert cache.put("a", stored)
    assert cache.get("a") is stored
    stats = cache.stats()
    assert (stats.queries, stats.hits, stats.entries, stats.bytes_held) == (2, 1, 1, 400)
    assert stats.hit_rate == 0.5


def test_a_source_key_finds_its_item_in_one_query_until_the_item_is_evicted() -> None:
    cache = ProcessorCache(1000)
    a, b = item(600), item(600)
    assert cache.put("a", a, source="bytes-a")
    assert cache.get_source("bytes-a") == ("a", a)
    assert cache.get_source("bytes-other") is None
    assert cache.get_linked("a", "bytes-other") is a  # the second look of that query: now linked
    assert cache.get_source("bytes-other") == ("a", a)
    assert cache.sources()["a"] in ("bytes-a", "bytes-other")
    stats = cache.stats()
    assert (stats.queries, stats.hits) == (3, 3)  # get_linked is not a query of its own
    assert cache.put("b", b, source="bytes-b")  # evicts "a"
    assert cache.get_source("bytes-a") is None and cache.get_linked("z", "bytes-z") is None
    assert "a" not in cache.sources()


def test_a_refused_item_links_no_source() -> None:
    for cache in (ProcessorCache(100), ProcessorCache(0)):
        assert not cache.put("a", item(400), source="bytes-a")
        assert cache.get_source("bytes-a") is None and cache.sources() == {}


def test_peek_neither_counts_nor_refreshes() -> None:
    cache = ProcessorCache(1000)
    old, new = item(400), item(400)
    cache.put("old", old)
    cache.put("new", new)
    assert cache.peek("old") is old and cache.peek("gone") is None
    assert (cache.stats().queries, cache.stats().hits) == (0, 0)
    cache.put("third", item(400))  # evicts the least recently used: "old", peeked or not
    assert cache.keys() == ["new", "third"]


def test_byte_bound_evicts_least_recently_used_first() -> None:
    cache = ProcessorCache(1000)
    for key in "abc":
        cache.put(key, item(300))
    cache.get("a")  # order now b, c, a
    cache.put("d", item(300))  # 1200 > 1000: b goes
    assert cache.keys() == ["c", "a", "d"]
    cache.put("e", item(600))  # needs 600 free: c and a go
    assert cache.keys() == ["d", "e"]
    stats = cache.stats()
    assert stats.evictions == 3 and stats.bytes_held == 900 and stats.peak_bytes_held == 900
    assert stats.bytes_held <= cache.capacity_bytes


def test_too_big_items_are_refused_without_evicting() -> None:
    cache = ProcessorCache(1000)
    cache.put("a", item(500))
    assert not cache.put("huge", item(1004))
    assert "huge" not in cache and "a" in cache
    assert cache.stats().refused == 1 and cache.stats().evictions == 0


def test_capacity_zero_disables_the_cache() -> None:
    cache = ProcessorCache.from_config(ProcessorCacheConfig(capacity_bytes=0))
    assert not cache.put("a", item(4))
    assert cache.get("a") is None and len(cache) == 0
    assert cache.stats().queries == 1


def test_put_of_a_present_key_refreshes_it() -> None:
    cache = ProcessorCache(1000)
    cache.put("a", item(400))
    cache.put("b", item(400))
    assert cache.put("a", item(400))
    assert cache.keys() == ["b", "a"] and cache.stats().bytes_held == 800


class RecordingStorage:
    """Handles are ints, as a remote store's references would be opaque."""

    def __init__(self) -> None:
        self.values: dict[int, CachedItem] = {}
        self.freed: list[int] = []
        self._next = 0

    def put(self, key: str, value: CachedItem) -> int:
        self._next += 1
        self.values[self._next] = value
        return self._next

    def get(self, handle: int) -> CachedItem:
        return self.values[handle]

    def free(self, handle: int) -> None:
        self.freed.append(handle)
        del self.values[handle]


def test_storage_holds_the_values_and_frees_evicted_ones() -> None:
    storage = RecordingStorage()
    cache = ProcessorCache(1000, storage)
    first = item(600)
    cache.put("a", first)
    assert cache.get_handle("a") == 1 and cache.get("a") is first
    cache.put("b", item(600))
    assert storage.freed == [1] and list(storage.values) == [2]
    cache.clear()
    assert storage.freed == [1, 2] and cache.stats().bytes_held == 0


def test_replace_swaps_the_held_copy_and_frees_the_old_one() -> None:
    # The Ray store first indexes the maker's copy, then swaps in one of its own: same bytes, same recency.
    storage = RecordingStorage()
    cache = ProcessorCache(1000, storage)
    cache.put("a", item(400))
    cache.put("b", item(400))
    copy = item(400)
    assert cache.replace("a", copy)
    assert cache.keys() == ["a", "b"]  # least recently used first: replace did not touch the order
    assert cache.get("a") is copy and storage.freed == [1]
    stats = cache.stats()
    assert (stats.bytes_held, stats.entries, stats.evictions) == (800, 2, 0)
    assert not cache.replace("gone", item(400)) and storage.freed == [1, 4]  # the unused copy is freed
    assert not cache.replace("b", item(200))  # a copy must be the same size as what it replaces


def test_discard_forgets_a_key_without_counting_an_eviction() -> None:
    storage = RecordingStorage()
    cache = ProcessorCache(1000, storage)
    cache.put("a", item(400))
    cache.discard("a")
    cache.discard("never")
    assert "a" not in cache and storage.freed == [1]
    stats = cache.stats()
    assert (stats.bytes_held, stats.entries, stats.evictions) == (0, 0, 0)


def test_threads_keep_the_books_consistent() -> None:
    cache = ProcessorCache(40_000)
    errors: list[Any] = []

    def work(seed: int) -> None:
        try:
            for i in range(300):
                key = f"k{(seed * 7 + i) % 50}"
                if cache.get(key) is None:
                    cache.put(key, item(4_000))
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = cache.stats()
    assert not errors
    assert stats.entries == 10 and stats.bytes_held == 40_000 and stats.peak_bytes_held <= 40_000
    assert stats.queries == 8 * 300
