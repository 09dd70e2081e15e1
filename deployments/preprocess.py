"""Preprocess deployment (CPU, autoscaled): ChatRequest -> PreprocessedRequest through mmserve's
Preprocessor, with the cluster-wide ProcessorCache. Owns nothing but the translation, and handing a
request's newly processed images to the Encoder early (`preprocess.early_encode`)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import ray
from ray import serve

from deployments.args import AppArgs
from deployments.cache_store import SharedProcessorCache
from deployments.handles import cancel, hold
from deployments.metrics_hub import MetricsReporter
from deployments.process_setup import freeze_startup_heap
from deployments.replica_logs import route_logs
from mmserve.errors import InvalidRequestError, OverloadedError
from mmserve.messages import ChatRequest, PreprocessedRequest, RequestFailed, ServedModel
from mmserve.preprocess.image_slots import FETCHING_PER_CORE, ImageSlots
from mmserve.runtime import affinity
from mmserve.runtime.core_company import usable_cores
from mmserve.runtime.metrics import MetricsSnapshot, merge, preprocess_snapshot, replica_cache_snapshot
from mmserve.runtime.timeline import Timeline
from mmserve.stages import StageFactory

log = logging.getLogger("ray.serve")
# NOTE: short: when the whole app shuts down the store may be gone first, and the call then waits this long
HAND_OVER_TIMEOUT_S = 2.0
EARLY_TIMEOUT_S = 5.0  # an early encode's call, given up after (s)


@serve.deployment
class Preprocess:
    def __init__(self, app_args: AppArgs, cache_store: Any, hub: Any, encoder: Any):
        route_logs()
        cache = app_args.engine.processor_cache  # NOTE: the cache off (0 bytes) keeps nothing here either
        self.cache = SharedProcessorCache(cache_store, min(cache.replica_capacity_bytes, cache.capacity_bytes),
                                          shared=cache.capacity_bytes > 0)
        # NOTE: the factory reads config files only here; no weights are loaded by a preprocess replica
        factory = StageFactory(app_args.engine_config())
        self.served = ServedModel(factory.spec.model_id, factory.spec.max_model_len, factory.spec.sampling_defaults)
        # NOTE: a thread per request Serve lets in: its default pool here is num_cpus + 4 threads (5 at num_cpus
        # 0), and a request holds its thread while its images are fetched (up to media.fetch_timeout_s), so five
        # slow image URLs held up every request of the replica, text ones too. What the threads may hold in memory
        # at once is bounded apart (image_slots.py): images decoded and processed at once, one per core, and
        # requests fetching images (their bytes until processed), FETCHING_PER_CORE per core
        self._workers = ThreadPoolExecutor(app_args.preprocess.max_ongoing_requests,
                                           thread_name_prefix="mmserve-preprocess")
        self.preprocessor = factory.preprocessor(
            self.cache, stamp_block_hashes=app_args.decoder.routing == "affinity",  # the Decoder router's key
            image_slots=ImageSlots(cores := usable_cores()), fetch_slots=ImageSlots(FETCHING_PER_CORE * cores))
        self.reporter = MetricsReporter(hub, "Preprocess", self.metrics, app_args.metrics_push_interval_s)
        self.reporter.ensure_started()
        self.ongoing = 0  # requests being processed here now, on worker threads
        self._counting = threading.Lock()  # guards `ongoing`
        self.encoder = hold(encoder) if app_args.early_encode() else None
        self._early: set[asyncio.Task] = set()  # early-encode calls not answered yet (held: see asyncio)
        freeze_startup_heap()  # NOTE: last: everything built above is what it freezes

    async def process(self, request: ChatRequest) -> PreprocessedRequest | RequestFailed:
        self.reporter.ensure_started()
        self.cache.bind()
        timeline, left = Timeline(), threading.Event()
        try:
            # NOTE: a worker thread: the HF processor is CPU work, and the cache client blocks on handles; the
            # request's context (Serve's request id in the logs) goes with it, as asyncio.to_thread's would
            work = functools.partial(contextvars.copy_context().run, self._process, request, left)
            pre = await asyncio.get_running_loop().run_in_executor(self._workers, work)
            self._encode_early(pre)
            timeline.add(pre.timings)
            timeline.since_start("preprocess.replica")  # the whole call here: its round trip less this is the hop
            return replace(pre, timings=timeline.phases)
        except (InvalidRequestError, OverloadedError) as exc:  # NOTE: a 4xx, or a 503 to retry later
            return RequestFailed(request.request_id, exc)  # NOTE: a value, see mmserve.messages.RequestFailed
        except asyncio.CancelledError:  # the caller left (a client gone, a deadline): its thread stops soon too
            left.set()
            raise

    def _process(self, request: ChatRequest, left: threading.Event) -> PreprocessedRequest:
        """On a worker thread: the request's preprocessing, counted in `ongoing` until its thread is done with it
        (which may be after its caller left: the work stops at its next image)."""
        with self._counting:
            self.ongoing += 1
        try:
            return self.preprocessor.process(request, cancelled=left.is_set)
        finally:
            with self._counting:
                self.ongoing -= 1

    def _encode_early(self, pre: PreprocessedRequest) -> None:
        """Send the Encoder the request's items if some are new here (a processor-cache miss: it has not
        seen them either); sent before this call answers, not awaited."""
        if self.encoder is None or pre.processor_cache_hits >= len(pre.features):
            return
        sent = self.encoder.encode_early.remote(f"{pre.request_id}/early", pre.features)
        task = asyncio.ensure_future(_settle(sent))
        self._early.add(task)
        task.add_done_callback(self._early.discard)

    async def __del__(self) -> None:
        """Serve calls this on a graceful shutdown (a downscale): the store copies the items this replica made
        that it still indexes, so that requests in flight with them, and later repeats, do not lose them; then
        the last metrics."""
        cache = getattr(self, "cache", None)  # None: __init__ failed
        try:
            if cache is not None:
                cache.bind()  # NOTE: a replica that served no request had not bound its store caller yet
                kept = await asyncio.wrap_future(cache.hand_over(HAND_OVER_TIMEOUT_S))
                log.info("the processor cache store kept %d items this replica made", kept)
        except Exception as exc:  # NOTE: the store may be shutting down too (the whole app is)
            log.info("processed items not handed over to the store: %r", exc)
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            await reporter.close()
        workers = getattr(self, "_workers", None)
        if workers is not None:
            workers.shutdown(wait=False, cancel_futures=True)  # NOTE: Serve drained the calls; none should be left

    async def served_model(self) -> ServedModel:
        """The model's name and context length, for the ingress (which reads no checkpoint itself)."""
        return self.served

    def metrics(self) -> MetricsSnapshot:
        return merge([preprocess_snapshot(self.preprocessor.image_processor_calls),
                      replica_cache_snapshot(self.cache.own_stats()),
                      affinity.DECISIONS.snapshot()])  # its Encoder router's, for the early encodes

    def replica_info(self) -> dict[str, Any]:
        """Read-only introspection (tests, debugging): who answered, where, its processor calls, the
        requests it is processing now and the hits on the items it made."""
        return {"replica_id": serve.get_replica_context().replica_id.unique_id,
                "node_id": ray.get_runtime_context().get_node_id(),
                "image_processor_calls": self.preprocessor.image_processor_calls, "ongoing": self.ongoing,
                "slots": self.preprocessor.slots(),
                "own_cache_hits": self.cache.own_stats().hits}


async def _settle(sent: Any) -> None:
    """Await an early encode's answer: its failure is logged, never raised (the request encodes anyway).

    NOTE: for EARLY_TIMEOUT_S at most, then cancelled: the Encoder answers at once, and a call that waits longer
    has no replica to go to (Serve queues it, pinning its pixels); the request's own encode comes by then."""
    try:
        await asyncio.wait_for(sent, EARLY_TIMEOUT_S)
    except TimeoutError:
        cancel(sent)
        log.info("an early encode was not answered within %.0f s (every Encoder busy, or none reachable); given up",
                 EARLY_TIMEOUT_S)
    except Exception as exc:
        log.info("an early encode failed: %r", exc)
