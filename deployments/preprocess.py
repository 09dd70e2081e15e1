"""Preprocess deployment (CPU, autoscaled): ChatRequest -> PreprocessedRequest through mmserve's
Preprocessor, with the cluster-wide ProcessorCache. Owns nothing but the translation."""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray import serve

from deployments.args import AppArgs
from deployments.cache_store import SharedProcessorCache
from deployments.metrics_hub import MetricsReporter
from mmserve.errors import InvalidRequestError
from mmserve.messages import ChatRequest, PreprocessedRequest, RequestFailed, ServedModel
from mmserve.runtime.metrics import MetricsSnapshot, merge, preprocess_snapshot, replica_cache_snapshot
from mmserve.stages import StageFactory


@serve.deployment
class Preprocess:
    def __init__(self, app_args: AppArgs, cache_store: Any, hub: Any):
        cache = app_args.engine.processor_cache  # NOTE: the cache off (0 bytes) keeps nothing here either
        self.cache = SharedProcessorCache(cache_store, min(cache.replica_capacity_bytes, cache.capacity_bytes))
        # NOTE: the factory reads config files only here; no weights are loaded by a preprocess replica
        factory = StageFactory(app_args.engine_config())
        self.served = ServedModel(factory.spec.model_id, factory.spec.max_model_len)
        self.preprocessor = factory.preprocessor(
            self.cache, stamp_block_hashes=app_args.decoder.routing == "affinity")  # the Decoder router's key
        self.reporter = MetricsReporter(hub, "Preprocess", self.metrics, app_args.metrics_push_interval_s)
        self.reporter.ensure_started()
        self.ongoing = 0  # requests being processed here now

    async def process(self, request: ChatRequest) -> PreprocessedRequest | RequestFailed:
        self.reporter.ensure_started()
        self.cache.bind()
        self.ongoing += 1
        try:
            # NOTE: a worker thread: the HF processor is CPU work, and the cache client blocks on handles.
            return await asyncio.to_thread(self.preprocessor.process, request)
        except InvalidRequestError as exc:
            return RequestFailed(request.request_id, exc)  # NOTE: a value, see mmserve.messages.RequestFailed
        finally:
            self.ongoing -= 1

    async def served_model(self) -> ServedModel:
        """The model's name and context length, for the ingress (which reads no checkpoint itself)."""
        return self.served

    def metrics(self) -> MetricsSnapshot:
        return merge([preprocess_snapshot(self.preprocessor.image_processor_calls),
                      replica_cache_snapshot(self.cache.own_stats())])

    def replica_info(self) -> dict[str, Any]:
        """Read-only introspection (tests, debugging): who answered, where, its processor calls, the
        requests it is processing now and the hits on the items it made."""
        return {"replica_id": serve.get_replica_context().replica_id.unique_id,
                "node_id": ray.get_runtime_context().get_node_id(),
                "image_processor_calls": self.preprocessor.image_processor_calls, "ongoing": self.ongoing,
                "own_cache_hits": self.cache.own_stats().hits}
