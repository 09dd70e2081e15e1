"""BlockPool: allocation, reference counts, free-list order, misuse."""

from __future__ import annotations

import pytest

from mmserve.decoder.block_pool import BlockPool, OutOfBlocksError


def test_allocate_and_free_roundtrip() -> None:
    pool = BlockPool(8)
    assert pool.num_blocks == 8 and pool.num_free == 8
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8
    assert pool.num_free == 0 and not pool.can_allocate(1) and pool.can_allocate(0)
    pool.free(a)
    assert pool.num_free == 3 and pool.can_allocate(3) and not pool.can_allocate(4)
    pool.free(b)
    assert pool.num_free == 8
    assert all(pool.ref_count(i) == 0 for i in range(8))


def test_over_allocation_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.allocate(0) == []


def test_double_free_and_bad_ids_raise() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(ValueError, match="not held"):
        pool.free(ids[:1])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    with pytest.raises(ValueError):
        BlockPool(0)


def test_shared_block_returns_only_when_last_holder_frees() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.share(ids[:1])
    assert pool.ref_count(ids[0]) == 2
    pool.free(ids)
    assert pool.num_free == 3 and pool.ref_count(ids[0]) == 1
    pool.free(ids[:1])
    assert pool.num_free == 4


def test_freed_blocks_are_reused_last() -> None:
    """Least recently freed first: the seam for a prefix cache that keeps freed blocks findable."""
    pool = BlockPool(4)
    first = pool.allocate(2)
    pool.free(first)
    assert pool.allocate(2) == [2, 3]
    assert pool.allocate(2) == first[::-1]  # tail of a sequence freed first, so reused first
