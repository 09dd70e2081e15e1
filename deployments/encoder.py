"""Encoder deployment (GPU where there is one): mmserve's EncoderService behind a handle.

Owns the translation only: pixels are resolved from the object store on a cache miss, embeddings
leave as numpy (zero-copy through the object store). A request holds nothing here once `encode` has
answered, so any replica may serve any call and none has to be told when a request ends.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from typing import Any

import ray
from ray import serve

from deployments.args import AppArgs
from deployments.cache_store import PixelResolver
from deployments.metrics_hub import MetricsReporter
from deployments.process_setup import configure_step_process, freeze_startup_heap
from deployments.retry import replica_lost
from deployments.stage_args import DEFAULT_STAGE_ENV
from deployments.step_replica import StepReplica
from mmserve.encoder.outputs import EncoderStepError
from mmserve.errors import InvalidRequestError
from mmserve.messages import EncoderOutput, MultiModalFeatureSpec, RequestFailed
from mmserve.runtime.device_errors import device_fatal
from mmserve.runtime.embeddings_wire import to_wire
from mmserve.runtime.metrics import MetricsSnapshot, encoder_snapshot
from mmserve.runtime.timeline import Timeline
from mmserve.stages import StageFactory


@serve.deployment
class Encoder(StepReplica):
    def __init__(self, app_args: AppArgs, cache_store: Any, hub: Any):
        configure_step_process(app_args.encoder)
        stages = StageFactory(app_args.engine_config(app_args.encoder))
        self.resolver = PixelResolver(cache_store)
        self.service = stages.encoder(resolve=self.resolver, alone=True)  # NOTE: no other torch stage here
        self.watch_step_thread()
        self.stuck_after_s = app_args.hung_step_s()
        stages.release_unused()
        self.stage = self.service.stage
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.vision_weights = stages.family.vision_weights_id()  # stamped on each answer: the Decoder checks it
        self.ongoing = 0  # `encode` calls in flight here (introspection)
        self.early_encode_calls = 0  # early encodes asked of this replica (introspection)
        self.early_encodes = 0  # early encodes started here, those that came while the stage was idle (introspection)
        self.reporter = MetricsReporter(hub, "Encoder", self.metrics, app_args.metrics_push_interval_s)
        self.reporter.ensure_started()
        freeze_startup_heap()  # NOTE: last: everything built above is what it freezes

    async def encode(self, request_id: str, features: list[MultiModalFeatureSpec]) -> EncoderOutput | RequestFailed:
        """One (num_embeds, hidden) numpy array per feature; this replica holds nothing for it after."""
        self.reporter.ensure_started()
        self.resolver.bind()  # NOTE: the step thread resolves pixels through the store's handle
        self.ongoing += 1
        timeline = Timeline()
        try:
            encoded = await self.service.encode(request_id, features)
        except InvalidRequestError as exc:
            return RequestFailed(request_id, exc)  # NOTE: a value, see mmserve.messages.RequestFailed
        except EncoderStepError as exc:
            raise as_raised(exc, request_id) from None
        finally:
            self.ongoing -= 1
        if any(e.device.type != "cpu" for e in encoded.embeddings):
            # NOTE: a device-to-host copy waits for the device's queue, the next batch's forward included:
            # not on the event loop, which serves this replica's other calls meanwhile
            try:
                arrays, dtype = await asyncio.to_thread(to_wire, encoded.embeddings)
            except Exception as exc:  # NOTE: that next forward's fault, which sticks: this request's only if its item
                if device_fatal(exc):
                    raise self.service.faulted(features) from None
                raise
        else:
            arrays, dtype = to_wire(encoded.embeddings)
        timeline.add(encoded.timings)
        timeline.since_start("encoder.replica")  # the call's whole time here: its round trip less this is the hop
        return EncoderOutput(request_id, arrays, dtype=dtype, timings=timeline.phases, host=encoded.host,
                             vision_weights=self.vision_weights)

    async def encode_early(self, request_id: str, features: list[MultiModalFeatureSpec]) -> bool:
        """Start encoding a request's items into this replica's cache before its `encode` call comes (the
        same routing key sends that call here); answers at once: whether anything was started."""
        self.resolver.bind()
        started = self.service.encode_early(request_id, features)
        self.early_encodes += started
        self.early_encode_calls += 1  # NOTE: last: a reader that waits for this call's count sees the other too
        return started

    def metrics(self) -> MetricsSnapshot:
        return encoder_snapshot(self.stage.stats())

    def replica_info(self) -> dict[str, Any]:
        """Read-only introspection (tests, debugging): who answered, where, the ids of the requests that
        hold encoder-cache references here, the `encode` calls in flight, the early encodes asked and started, this
        replica's vision forward passes and cache lookups (and those that found an early encode)."""
        # NOTE: the books belong to the step thread; a copy taken while it mutates them may need a retry.
        for _ in range(100):
            try:
                referenced = self.stage.manager.referencing_requests()
                break
            except RuntimeError:  # dictionary changed size during iteration
                continue
        else:
            raise RuntimeError("the encoder-cache books kept changing; try again")
        stats = self.stage.stats()
        return {"replica_id": self.replica_id, "node_id": ray.get_runtime_context().get_node_id(),
                "referenced_requests": referenced, "ongoing": self.ongoing,
                "early_encode_calls": self.early_encode_calls, "early_encodes": self.early_encodes,
                "forward_passes": self.stage.runner.forward_passes,
                "cache_queries": stats.queries, "cache_hits": stats.hits, "early_found": stats.early_found,
                "torch_threads": self.stage.runner.threads.available, "switch_interval_s": sys.getswitchinterval(),
                "frozen_objects": gc.get_freeze_count(),
                "stage_env": {k: os.environ.get(k) for k in DEFAULT_STAGE_ENV}}


def as_raised(exc: EncoderStepError, request_id: str) -> BaseException:
    """What `encode` raises for a request that a step failed: its pixels' loss as itself (their maker gone and
    the store without a copy), so that the callers see a loss and retry the request from its preprocessing
    (deployments/retry.py); any other failure as the step's error for this request alone (other requests'
    ids and errors are not its caller's to read)."""
    cause = exc.cause_of(request_id)
    if cause is None:
        return exc
    return cause if replica_lost(cause) else EncoderStepError({request_id: cause})
