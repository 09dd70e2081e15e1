"""The preprocess replica's client of the ProcessorCacheStore (deployments/cache_store.py), without Ray: a store
that is lost or slow is a miss (the item is processed again), never a failed request; any other error is the
lookup's."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from deployments.cache_store import LOOKUP_TIMEOUT_S, SharedProcessorCache
from mmserve.preprocess.processor_cache import ProcessorCache


class FailingStore:
    """Stands in for the handle's thread-side caller: every call fails with `error`; the calls are recorded."""

    def __init__(self, error: BaseException) -> None:
        self.error, self.calls = error, list[tuple[str, tuple[Any, ...], float]]()

    def submit(self, method: str, *args: Any, timeout_s: float) -> Future[Any]:
        self.calls.append((method, args, timeout_s))
        failed: Future[Any] = Future()
        failed.set_exception(self.error)
        return failed


def client(store: FailingStore) -> SharedProcessorCache:
    # NOTE: built without __init__, which asks Ray for this worker's id; the lookups run as written
    cache = SharedProcessorCache.__new__(SharedProcessorCache)
    cache._store = store  # type: ignore[assignment]
    cache.own, cache._epoch, cache._lock = ProcessorCache(1 << 20), None, threading.Lock()
    return cache


@pytest.mark.parametrize("error", [TimeoutError("the store took past its timeout"), ActorDiedError()])
def test_a_slow_or_lost_store_is_a_miss(error: BaseException) -> None:
    store = FailingStore(error)
    cache = client(store)
    assert cache.find_source("bytes-key").result(timeout=5) is None
    assert cache.find("pixels-key", "bytes-key").result(timeout=5) is None
    assert [(m, t) for m, _, t in store.calls] == [("lookup_source", LOOKUP_TIMEOUT_S), ("lookup", LOOKUP_TIMEOUT_S)]


def test_any_other_store_error_is_the_lookups() -> None:
    cache = client(FailingStore(ValueError("a bug in the store")))
    with pytest.raises(ValueError, match="a bug in the store"):
        cache.find_source("bytes-key").result(timeout=5)
