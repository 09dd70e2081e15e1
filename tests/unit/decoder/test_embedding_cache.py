"""The decoder's cache of recent embeddings: least recently used out first, within its bytes."""

from __future__ import annotations

import torch

from mmserve.decoder.embedding_cache import EmbeddingCache

ROW = 4 * 8  # bytes of one (1, 8) float32 row


def rows(n: int) -> torch.Tensor:
    return torch.zeros(n, 8)  # (n, hidden)


def test_a_kept_item_is_found_and_counted():
    cache = EmbeddingCache(10 * ROW)
    emb = rows(2)
    assert cache.get("a") is None
    cache.put("a", emb)
    assert cache.get("a") is emb  # the tensor itself: no copy
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.queries, stats.hits) == (1, 2 * ROW, 2, 1)


def test_the_least_recently_used_goes_first():
    cache = EmbeddingCache(6 * ROW)
    for key in "abc":
        cache.put(key, rows(2))
    assert cache.get("a") is not None  # now b is the oldest
    cache.put("d", rows(2))
    assert [k for k in "abcd" if cache.get(k) is not None] == ["a", "c", "d"]
    assert cache.stats().bytes == 6 * ROW


def test_an_item_bigger_than_the_cache_is_not_kept_and_evicts_nothing():
    cache = EmbeddingCache(4 * ROW)
    cache.put("a", rows(3))
    cache.put("big", rows(5))
    assert cache.get("big") is None and cache.get("a") is not None


def test_putting_a_key_again_replaces_it_and_its_bytes():
    cache = EmbeddingCache(4 * ROW)
    cache.put("a", rows(3))
    cache.put("a", rows(1))
    cache.put("b", rows(3))
    assert cache.get("a") is not None and cache.stats().bytes == 4 * ROW


def test_zero_capacity_keeps_nothing():
    cache = EmbeddingCache(0)
    cache.put("a", rows(1))
    assert cache.get("a") is None and cache.stats().entries == 0
