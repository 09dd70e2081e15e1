"""The cluster-wide ProcessorCache: one store deployment owns the objects, every preprocess replica
shares it through a small client.

Owns: translating mmserve's `ItemCache` calls into Ray: processed pixels are sent once to the store
replica, which `ray.put`s them itself so that it *owns* the objects: they outlive the preprocess
replica that made them. The store keeps the byte-bounded LRU index of ObjectRefs (mmserve's
ProcessorCache, with refs as its storage handles). Does not own the LRU policy
(mmserve/processor_cache.py).

NOTE: Ray 2.56 removed `ray.put(_owner=...)`, which would have saved the hop through the store.
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve

from deployments.metrics_hub import MetricsReporter
from mmserve.messages import ProcessedItem, StoredItem
from mmserve.metrics import MetricsSnapshot, processor_cache_snapshot
from mmserve.processor_cache import CachedItem, InMemoryStorage, ProcessorCache


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  logging_config={"enable_access_log": False})  # NOTE: internal calls; no per-call log line
class ProcessorCacheStore:
    def __init__(self, capacity_bytes: int, hub: Any):
        # NOTE: the index's values are StoredItems (ObjectRefs), so the plain in-memory storage fits: an
        # evicted entry drops the index's ref, and Ray frees the object once no in-flight spec borrows it.
        self.cache = ProcessorCache(capacity_bytes, InMemoryStorage())
        self.reporter = MetricsReporter(hub, "ProcessorCacheStore", self.metrics)
        self.reporter.ensure_started()

    async def lookup(self, key: str) -> CachedItem | None:
        self.reporter.ensure_started()
        return self.cache.get(key)

    async def insert(self, key: str, item: ProcessedItem) -> StoredItem:
        """Own a copy of `item` in the object store and index it (if it fits the byte bound)."""
        stored = StoredItem(ref=ray.put(item), num_tiles=item.num_tiles, nbytes=item.nbytes)
        self.cache.put(key, stored)
        return stored

    def metrics(self) -> MetricsSnapshot:
        return processor_cache_snapshot(self.cache.stats())


class SharedProcessorCache:
    """mmserve's `ItemCache` for a preprocess replica; call from a worker thread (it blocks)."""

    def __init__(self, store: Any):  # a DeploymentHandle to ProcessorCacheStore
        # NOTE: build the handle's router now, once. Left to first use, the worker threads of the first
        # concurrent requests each ran Serve's unlocked lazy init and built a router of their own
        # (seen: 5 per replica), leaking all but one. `_init()` is what that first use calls.
        if not store.is_initialized:
            store._init()
        self._handle = store

    def get(self, key: str) -> CachedItem | None:
        return self._handle.lookup.remote(key).result()

    def store(self, key: str, item: ProcessedItem) -> StoredItem:
        return self._handle.insert.remote(key, item).result()


def resolve_item(data: CachedItem) -> ProcessedItem:
    """The encoder's `resolve`: fetch the pixels of a StoredItem (zero-copy numpy on the same node)."""
    return ray.get(data.ref) if isinstance(data, StoredItem) else data
