"""A shared processor cache's copies (mmserve/preprocess/shared_copies.py), without Ray: a maker's "ref" is an
asyncio future that resolves to the pixels (or fails as a lost object's read does), read by awaiting it, and
the put is a fake that records what it copied."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from mmserve.messages import ProcessedItem, StoredItem
from mmserve.preprocess.processor_cache import ProcessorCache
from mmserve.preprocess.shared_copies import ItemLostError, Keeper, MakerGoneError, Put

ITEM = ProcessedItem(pixel_values=np.zeros((1, 3, 4, 4), dtype=np.uint8))


class Puts:
    """A stand-in for `ray.put`: each call returns a new ref-like tag."""

    def __init__(self) -> None:
        self.made: list[ProcessedItem] = []

    def __call__(self, value: ProcessedItem) -> str:
        self.made.append(value)
        return f"copy-{len(self.made)}"


@pytest.fixture
def puts() -> Puts:
    return Puts()


def made(result: Any = ITEM) -> StoredItem:
    """A maker's entry whose object resolves to `result` (an exception: the object is lost that way)."""
    ref: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if isinstance(result, BaseException):
        ref.set_exception(result)
    elif result is not None:
        ref.set_result(result)
    return StoredItem(ref=ref, num_tiles=1, nbytes=ITEM.nbytes)


def owner_died() -> MakerGoneError:
    return MakerGoneError("the process that made it died")


async def read(item: StoredItem) -> ProcessedItem:
    """The read of the store's object: here, the maker's "ref" awaited."""
    made: ProcessedItem = await item.ref
    return made


def fresh(put: Put) -> tuple[ProcessorCache, Keeper]:
    cache = ProcessorCache(1 << 20)
    return cache, Keeper(cache, read, put)


async def copying(keeper: Keeper, key: str, item: StoredItem) -> asyncio.Future[StoredItem | None]:
    """A hit on `item` that waits for its copy, started (its read pending until the test settles it)."""
    hit = asyncio.ensure_future(keeper.kept(key, item, counted=False, wait_s=None))
    await asyncio.sleep(0)
    return hit


def adopted(keeper: Keeper, key: str, item: StoredItem, maker: str = "A") -> StoredItem:
    keeper.adopt(key, item, source=None, maker=maker)
    return item


def test_a_hit_copies_the_item_once_and_answers_the_copy(puts: Puts):
    async def run() -> None:
        cache, keeper = fresh(puts)
        item = adopted(keeper, "k", made())
        assert cache.peek("k") is item  # indexed as the maker's object: nothing copied on sight
        assert puts.made == []
        hit = cache.get("k", hit=False)
        answers = await asyncio.gather(*(keeper.kept("k", hit, counted=i == 0) for i in range(3)))
        assert [(a.ref, a.kept) for a in answers if a is not None] == [("copy-1", True)] * 3
        assert len(puts.made) == 1 and cache.peek("k") == answers[0]
        assert await keeper.kept("k", cache.peek("k"), counted=False) == answers[0]  # kept: no second copy
        assert len(puts.made) == 1 and cache.stats().hits == 1

    asyncio.run(run())


def test_a_dead_maker_answers_a_miss_and_its_other_entries_go_too(puts: Puts):
    async def run() -> None:
        cache, keeper = fresh(puts)
        dead = adopted(keeper, "dead", made(owner_died()))
        adopted(keeper, "sibling", made(None))  # the same maker's: never read, dropped with it
        alive = adopted(keeper, "alive", made(), maker="B")
        kept_first = adopted(keeper, "kept", made())
        assert await keeper.kept("kept", kept_first, counted=False) is not None  # copied before the death
        assert await keeper.kept("dead", cache.get("dead", hit=False), counted=True) is None
        assert "dead" not in cache and "sibling" not in cache
        assert cache.peek("alive") is alive and cache.peek("kept").kept  # type: ignore[union-attr]
        assert cache.stats().hits == 0 and cache.stats().queries == 1  # the lost hit counts as a miss
        assert cache.peek("dead") is None and dead.nbytes > 0

    asyncio.run(run())


def test_an_entry_adopted_again_during_a_failing_copy_takes_its_place(puts: Puts):
    async def run() -> None:
        cache, keeper = fresh(puts)
        first = adopted(keeper, "k", made(None))  # its read pends until the test fails it
        pending = await copying(keeper, "k", first)
        second = adopted(keeper, "k", made(), maker="B")  # another replica made it too, meanwhile
        assert cache.peek("k") is first
        first.ref.set_exception(ItemLostError("lost with its node"))
        assert await pending is None
        assert cache.peek("k") is second  # the spare, not a miss for the next request
        assert (await keeper.kept("k", second, counted=False)).ref == "copy-1"  # type: ignore[union-attr]

    asyncio.run(run())


def test_a_dead_makers_entries_go_but_not_another_makers_that_took_one_of_their_places(puts: Puts):
    async def run() -> None:
        cache, keeper = fresh(puts)
        first = adopted(keeper, "x", made(owner_died()))
        second = adopted(keeper, "y", made(None))  # A's too; its read pends until the test fails it
        pending = await copying(keeper, "y", second)
        spare = adopted(keeper, "y", made(), maker="B")  # B made it too, meanwhile
        # x is found lost: A's other entries go, but not y, whose copy is under way (its read may be done)
        assert await keeper.kept("x", first, counted=False) is None
        assert cache.peek("x") is None and cache.peek("y") is second
        second.ref.set_exception(owner_died())  # y is found lost too: B's spare takes its place, and stays
        assert await pending is None
        assert cache.peek("y") is spare
        assert (await keeper.kept("y", spare, counted=False)).ref == "copy-1"  # type: ignore[union-attr]

    asyncio.run(run())


def test_a_slow_copy_answers_a_miss_and_goes_on(puts: Puts):
    async def run() -> None:
        cache, keeper = fresh(puts)
        item = adopted(keeper, "k", made(None))
        looking = asyncio.ensure_future(keeper.kept("k", cache.get("k", hit=False), counted=True, wait_s=0.1))
        await asyncio.sleep(0.02)
        assert cache.stats().hits == 0  # NOTE: not counted while it waits: a hit is never taken back
        assert await looking is None
        assert cache.stats().hits == 0  # answered as a miss
        item.ref.set_result(ITEM)  # the maker's object arrives after the hit gave up
        for _ in range(1000):  # NOTE: up to 10 s: the copy is made on a worker thread
            await asyncio.sleep(0.01)
            if cache.peek("k") != item:
                break
        assert cache.peek("k").kept  # type: ignore[union-attr]
        assert len(puts.made) == 1

    asyncio.run(run())


def test_a_copy_a_lookup_gave_up_on_is_not_waited_for_again_until_it_ends(puts: Puts):
    """A slow maker's node: the first lookup waits its while, the next ones answer a miss at once; a hand-over
    (no time limit) still waits for it."""
    async def run() -> None:
        cache, keeper = fresh(puts)
        item = adopted(keeper, "k", made(None))
        assert await keeper.kept("k", cache.get("k", hit=False), counted=True, wait_s=0.05) is None
        again = asyncio.ensure_future(keeper.kept("k", cache.get("k", hit=False), counted=True, wait_s=5.0))
        for _ in range(3):  # NOTE: a few turns of the loop, no timer: an answer that does not wait is done
            await asyncio.sleep(0)
        assert again.done() and again.result() is None and cache.stats().hits == 0
        handed = asyncio.ensure_future(keeper.kept("k", item, counted=False, wait_s=None))
        await asyncio.sleep(0.01)
        assert not handed.done()
        item.ref.set_result(ITEM)
        assert (await handed).kept  # type: ignore[union-attr]
        assert (await keeper.kept("k", cache.get("k", hit=False), counted=True, wait_s=5.0)).kept  # type: ignore[union-attr]

    asyncio.run(run())


def test_the_entries_a_maker_made_and_the_store_has_not_copied_are_named_for_its_hand_over(puts: Puts):
    async def run() -> None:
        cache, keeper = fresh(puts)
        adopted(keeper, "a", made(), maker="A")
        adopted(keeper, "b", made(), maker="B")
        adopted(keeper, "c", made(), maker="A")
        assert await keeper.kept("c", cache.peek("c"), counted=False) is not None  # copied: the store's own now
        assert keeper.made_by("A") == ["a"] and keeper.made_by("B") == ["b"] and keeper.made_by("C") == []

    asyncio.run(run())


def test_a_copy_of_an_entry_replaced_since_does_not_blame_the_new_entrys_maker(puts: Puts):
    """`keep` reads its entries before their copies start: one may have been replaced by another maker's by then;
    its loss must not drop the other maker's entries."""
    async def run() -> None:
        cache, keeper = fresh(puts)
        gone = adopted(keeper, "k", made(owner_died()), maker="A")
        hand_over = keeper.kept("k", cache.peek("k"), counted=False, wait_s=None)  # read, not started
        cache.discard("k")
        adopted(keeper, "k", made(), maker="B")  # B's object of the same item takes the place
        other = adopted(keeper, "o", made(), maker="B")
        assert await hand_over is None  # A's object is lost
        assert cache.peek("o") is other and cache.peek("k") is not gone  # B's entries stay

    asyncio.run(run())


def test_a_failed_copy_leaves_the_makers_object_serving():
    def full(_: Any) -> None:
        raise MemoryError("object store full")

    async def run() -> None:
        cache, keeper = fresh(full)
        item = adopted(keeper, "k", made())
        assert await keeper.kept("k", item, counted=False) is item
        assert cache.peek("k") is item

    asyncio.run(run())
