"""EncoderCacheManager: books only — references, FIFO eviction of unreferenced entries, validation."""

from __future__ import annotations

import pytest

from mmserve.encoder.cache_manager import EncoderCacheManager
from mmserve.errors import CapacityError


def _alloc(m: EncoderCacheManager, request_id: str, mm_hash: str, n: int) -> None:
    assert not m.check_and_update_cache(request_id, mm_hash)
    assert m.can_allocate(n, compute_budget_left=m.compute_budget_tokens)
    m.allocate(request_id, mm_hash, n)


def test_unreferenced_entries_evicted_fifo_in_free_order() -> None:
    m = EncoderCacheManager(capacity_tokens=10, compute_budget_tokens=10)
    _alloc(m, "r1", "a", 3)
    _alloc(m, "r2", "b", 3)
    _alloc(m, "r3", "c", 3)
    for rid in ("r2", "r1", "r3"):  # freed in this order: b, a, c
        m.free_request(rid)
    assert m.freeable_order() == ["b", "a", "c"]
    assert m.num_free_tokens == 1 and m.num_freeable_tokens == 9
    assert m.take_freed() == []  # freeing evicts nothing

    assert m.can_allocate(4, compute_budget_left=10)  # needs 3 more rows: evicts b only
    assert m.take_freed() == ["b"]
    m.allocate("r4", "d", 4)
    assert m.can_allocate(5, compute_budget_left=10)  # 0 free: evicts a (3) then c (3)
    assert m.take_freed() == ["a", "c"]
    assert m.take_freed() == []
    assert "d" in m and m.num_cached == 1


def test_a_touched_entry_is_evicted_last_and_a_referenced_one_is_left_alone() -> None:
    m = EncoderCacheManager(capacity_tokens=9, compute_budget_tokens=9)
    for rid, mm_hash in (("r1", "a"), ("r2", "b"), ("r3", "c")):
        _alloc(m, rid, mm_hash, 3)
    m.free_request("r1")
    m.free_request("r2")
    m.touch("a")  # served from the cache without a reference
    m.touch("c")  # referenced (r3): not freeable, nothing to move
    m.touch("zz")  # unknown: ignored
    assert m.freeable_order() == ["b", "a"] and m.refcount("c") == 1
    assert m.can_allocate(3, compute_budget_left=9)
    assert m.take_freed() == ["b"]


def test_referenced_entries_are_never_evicted() -> None:
    m = EncoderCacheManager(capacity_tokens=10, compute_budget_tokens=10)
    _alloc(m, "r1", "a", 6)
    _alloc(m, "r2", "b", 4)
    m.free_request("r2")
    assert not m.can_allocate(5, compute_budget_left=10)  # 0 free + 4 freeable < 5
    assert m.take_freed() == []  # a refusal evicts nothing
    assert "a" in m and "b" in m
    assert m.can_allocate(4, compute_budget_left=10)
    assert m.take_freed() == ["b"]
    assert m.refcount("a") == 1


def test_refcounts_return_to_zero_after_requests_end_or_abort() -> None:
    m = EncoderCacheManager(capacity_tokens=10, compute_budget_tokens=10)
    _alloc(m, "r1", "a", 4)
    assert m.check_and_update_cache("r2", "a")
    assert m.check_and_update_cache("r2", "a")  # the same item twice in one request: one reference
    assert m.refcount("a") == 2 and m.referrers("a") == {"r1", "r2"}
    m.free_request("r1")
    assert m.refcount("a") == 1 and m.freeable_order() == []
    m.free_request("r2")  # e.g. an abort: same path
    assert m.refcount("a") == 0 and m.freeable_order() == ["a"]
    m.free_request("r2")  # idempotent
    m.free_request("never-seen")
    assert m.num_freeable_tokens == 4 and m.num_cached_tokens == 4


def test_unreferenced_entry_stays_a_hit_until_space_is_needed() -> None:
    m = EncoderCacheManager(capacity_tokens=8, compute_budget_tokens=8)
    _alloc(m, "r1", "a", 4)
    m.free_request("r1")
    _alloc(m, "r2", "b", 4)  # fits in free space: a is not touched
    assert m.take_freed() == []
    assert m.check_and_update_cache("r3", "a")  # still a hit, now referenced again
    assert m.freeable_order() == [] and m.num_freeable_tokens == 0
    assert not m.can_allocate(4, compute_budget_left=8)  # a is pinned by r3 again


def test_can_allocate_respects_the_compute_budget_left() -> None:
    m = EncoderCacheManager(capacity_tokens=10, compute_budget_tokens=8)
    assert not m.can_allocate(5, compute_budget_left=4)
    assert m.can_allocate(4, compute_budget_left=4)


def test_discard_forgets_entries_and_their_references() -> None:
    m = EncoderCacheManager(capacity_tokens=10, compute_budget_tokens=10)
    _alloc(m, "r1", "a", 4)
    assert m.check_and_update_cache("r2", "a")
    m.discard(["a", "unknown"])
    assert "a" not in m and m.num_free_tokens == 10 and m.take_freed() == ["a"]
    m.free_request("r1")  # no dangling reference left behind
    assert m.freeable_order() == []


def test_allocate_misuse_is_loud() -> None:
    m = EncoderCacheManager(capacity_tokens=4, compute_budget_tokens=4)
    _alloc(m, "r1", "a", 4)
    with pytest.raises(RuntimeError, match="already allocated"):
        m.allocate("r2", "a", 4)
    with pytest.raises(RuntimeError, match="can_allocate"):
        m.allocate("r2", "b", 1)


def test_capacity_errors_name_the_limit() -> None:
    m = EncoderCacheManager(capacity_tokens=10, compute_budget_tokens=6)
    m.validate_item(6)
    with pytest.raises(CapacityError, match="cache_capacity_tokens"):
        EncoderCacheManager(capacity_tokens=4, compute_budget_tokens=8).validate_item(5)
    m.validate_item(7)  # over one step's budget: the stage runs it alone, never refused
    m.validate_request({"a": 5, "b": 5})
    with pytest.raises(CapacityError, match="distinct images need 11"):
        m.validate_request({"a": 5, "b": 6})
    with pytest.raises(ValueError):
        m.validate_item(0)
    with pytest.raises(ValueError):
        EncoderCacheManager(capacity_tokens=0, compute_budget_tokens=1)


def test_peak_cached_tokens_keeps_the_high_water_mark_within_capacity() -> None:
    m = EncoderCacheManager(capacity_tokens=10, compute_budget_tokens=10)
    _alloc(m, "r1", "a", 3)
    _alloc(m, "r2", "b", 6)
    assert m.num_cached_tokens == m.peak_cached_tokens == 9
    m.free_request("r1")
    m.free_request("r2")
    _alloc(m, "r3", "c", 5)  # evicts a (3) and b (6): 5 booked now, the peak stays
    assert m.num_cached_tokens == 5 and m.peak_cached_tokens == 9 <= m.capacity_tokens
