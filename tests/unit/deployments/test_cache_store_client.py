"""The preprocess replica's client of the ProcessorCacheStore (deployments/cache_store.py), without Ray: a store
that is lost or slow is a miss (the item is processed again), never a failed request; any other error is the
lookup's. And the store's read of an item, which tells mmserve's copies a dead maker from another loss."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from ray.exceptions import ActorDiedError, GetTimeoutError, ObjectLostError, OwnerDiedError

from deployments import cache_store
from deployments.cache_store import LOOKUP_TIMEOUT_S, SharedProcessorCache, read_stored
from mmserve.messages import ProcessedItem, StoredItem
from mmserve.preprocess.processor_cache import ProcessorCache
from mmserve.preprocess.shared_copies import ItemLostError, MakerGoneError

ITEM = ProcessedItem(np.zeros((1, 3, 8, 8), dtype=np.uint8))


class FailingStore:
    """Stands in for the handle's thread-side caller: every call fails with `error`; the calls are recorded."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.calls = error, list[tuple[str, tuple[Any, ...], float]]()

    def submit(self, method: str, *args: Any, timeout_s: float) -> Future[Any]:
        self.calls.append((method, args, timeout_s))
        failed: Future[Any] = Future()
        failed.set_exception(self.error)
        return failed


def client(store: FailingStore, *, shared: bool = True) -> SharedProcessorCache:
    # NOTE: built without __init__, which asks Ray for this worker's id; the lookups run as written
    cache = SharedProcessorCache.__new__(SharedProcessorCache)
    cache._store = store  # type: ignore[assignment]
    cache.own, cache._epoch, cache._lock = ProcessorCache(1 << 20 if shared else 0), None, threading.Lock()
    cache._down_until, cache._shared = 0.0, shared
    return cache


def test_with_the_cache_off_the_store_is_asked_nothing_and_sent_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    store = FailingStore(AssertionError("the store was called"))
    cache = client(store, shared=False)
    monkeypatch.setattr(cache_store.ray, "put", lambda item: ("ref", item))
    assert cache.find_source("bytes-key").result(timeout=5) is None
    assert cache.find("pixels-key", "bytes-key").result(timeout=5) is None
    stored = cache.store("pixels-key", ITEM, "bytes-key")  # the request still gets its pixels' reference
    assert stored.ref == ("ref", ITEM) and cache.own.keys() == []
    assert store.calls == []


@pytest.mark.parametrize("error", [TimeoutError("the store took past its timeout"), ActorDiedError()])
def test_a_slow_or_lost_store_is_a_miss_and_taken_as_down_for_a_lookups_timeout(
        error: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FailingStore(error)
    cache = client(store)
    now = [100.0]
    monkeypatch.setattr(cache_store, "monotonic", lambda: now[0])
    assert cache.find_source("bytes-key").result(timeout=5) is None
    assert cache.find("pixels-key", "bytes-key").result(timeout=5) is None  # at once: not asked
    assert [(m, t) for m, _, t in store.calls] == [("lookup_source", LOOKUP_TIMEOUT_S)]
    now[0] += LOOKUP_TIMEOUT_S + 0.1  # as long again: asked again
    assert cache.find("pixels-key", "bytes-key").result(timeout=5) is None
    assert [m for m, _, _ in store.calls] == ["lookup_source", "lookup"]


def test_an_item_made_while_the_store_is_down_is_not_sent_to_it_and_a_sent_one_is_given_up_in_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls to a store being replaced queue, each pinning its pixels: none is sent while it is taken as down, and
    each sent one has a timeout."""
    store = FailingStore(ActorDiedError())
    cache = client(store)
    cache._maker = "me"
    monkeypatch.setattr(cache_store.ray, "put", lambda item: f"ref-{id(item)}")
    now = [100.0]
    monkeypatch.setattr(cache_store, "monotonic", lambda: now[0])
    cache.store("k1", ITEM, "s1")
    assert [(m, t) for m, _, t in store.calls] == [("adopt", LOOKUP_TIMEOUT_S)]
    assert cache.find_source("s2").result(timeout=5) is None  # the adopt found the store lost: taken as down
    cache.store("k2", ITEM, "s2")
    assert [m for m, _, _ in store.calls] == ["adopt"]  # nothing sent since, k2 neither
    assert cache.own.peek("k2") is not None  # kept here all the same


def test_an_adopt_the_store_refuses_is_logged_and_leaves_it_up(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    store = FailingStore(ValueError("no room"))
    cache = client(store)
    cache._maker = "me"
    monkeypatch.setattr(cache_store.ray, "put", lambda item: f"ref-{id(item)}")
    cache.store("k1", ITEM, "s1")
    assert "did not index an item: ValueError('no room')" in caplog.text and cache._down_until == 0.0


def test_any_other_store_error_is_the_lookups() -> None:
    cache = client(FailingStore(ValueError("a bug in the store")))
    with pytest.raises(ValueError, match="a bug in the store"):
        cache.find_source("bytes-key").result(timeout=5)


class MalformedStore(FailingStore):
    """Answers every call, with something that is no StoreLookup."""

    def submit(self, method: str, *args: Any, timeout_s: float) -> Future[Any]:
        self.calls.append((method, args, timeout_s))
        answered: Future[Any] = Future()
        answered.set_result(object())
        return answered


def test_an_answer_the_lookup_cannot_read_fails_the_lookup_and_does_not_leave_it_waiting() -> None:
    with pytest.raises(AttributeError):
        client(MalformedStore(RuntimeError())).find_source("bytes-key").result(timeout=5)


@pytest.mark.parametrize(("lost", "as_"), [
    (OwnerDiedError("00" * 28, None, ""), MakerGoneError), (ObjectLostError("00" * 28, None, ""), ItemLostError),
    (GetTimeoutError("slow"), ItemLostError)])
def test_the_stores_read_tells_a_dead_maker_from_another_loss(lost: BaseException, as_: type) -> None:
    async def read() -> Any:
        ref: asyncio.Future[Any] = asyncio.get_running_loop().create_future()  # NOTE: awaited as a ref is
        ref.set_exception(lost)
        return await read_stored(StoredItem(ref=ref, num_tiles=1, nbytes=1))

    with pytest.raises(as_) as info:
        asyncio.run(read())
    assert isinstance(info.value, MakerGoneError) == (as_ is MakerGoneError)  # a lost object is no dead maker
