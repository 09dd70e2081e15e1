"""Decoder deployment (GPU where there is one): mmserve's DecoderService behind a streaming handle.

Owns the translation only: it asks the Encoder deployment for a request's embeddings (they travel
encoder -> decoder through the object store, never through the ingress), streams RequestOutputs
back. Nothing is released at the end: an encoder replica holds nothing for a request once it has
answered (mmserve.encoder.stage).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments.args import AppArgs
from deployments.handles import awaited, hold, shed
from deployments.metrics_hub import MetricsReporter
from deployments.process_setup import configure_step_process, freeze_startup_heap
from deployments.retry import ACTOR_LOST, attempt_id, retrying
from deployments.step_replica import StepReplica
from mmserve.errors import InvalidRequestError, OverloadedError, ReplicaLostError
from mmserve.messages import EncoderOutput, PreprocessedRequest, RequestFailed, RequestOutput
from mmserve.models.weights_id import check_same_weights
from mmserve.runtime import affinity
from mmserve.runtime.embeddings_wire import from_wire
from mmserve.runtime.metrics import MetricsSnapshot, decoder_snapshot, merge
from mmserve.stages import StageFactory


@serve.deployment
class Decoder(StepReplica):
    def __init__(self, app_args: AppArgs, encoder: Any, hub: Any):
        configure_step_process(app_args.decoder)
        stages = StageFactory(app_args.engine_config(app_args.decoder))
        self.service = stages.decoder()
        self.vision_weights = stages.family.vision_weights_id()  # what an Encoder's answer must have been made with
        self.watch_step_thread()
        stages.release_unused()
        self.engine = self.service.decoder
        self.encoder = hold(encoder)
        self.replica_loss_retries = app_args.replica_loss_retries
        self.stuck_after_s = app_args.hung_step_s()
        self.reporter = MetricsReporter(hub, "Decoder", self.metrics, app_args.metrics_push_interval_s)
        self.reporter.ensure_started()
        freeze_startup_heap()  # NOTE: last: everything built above is what it freezes

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[RequestOutput | RequestFailed]:
        self.reporter.ensure_started()
        try:
            # NOTE: closed with this generator, at once (Serve may cancel it at its `yield`): the request aborts
            async with contextlib.aclosing(self.service.generate(request, encode=self._encode)) as outputs:
                async for out in outputs:
                    yield out
        except (InvalidRequestError, OverloadedError) as exc:
            yield RequestFailed(request.request_id, exc)  # NOTE: a value, see mmserve.messages.RequestFailed

    async def _encode(self, request: PreprocessedRequest) -> EncoderOutput:
        # NOTE: only a dead encoder is retried here (a RequestFailed is the encoder's verdict, and lost pixels
        # stay lost: the ingress preprocesses such a request again, retry.Kept); past the retries a ReplicaLostError,
        # which the ingress does not retry again
        try:
            out: EncoderOutput | RequestFailed = await retrying(
                lambda attempt: awaited(self.encoder.encode.remote(
                    attempt_id(request.request_id, attempt, "encode-retry"), request.features)),
                retries=self.replica_loss_retries, what=f"encode of {request.request_id}", kinds=ACTOR_LOST)
        except BackPressureError as exc:
            raise shed(exc, "the encoder") from None
        except ACTOR_LOST as exc:
            raise ReplicaLostError(f"encoder replicas lost ({type(exc).__name__}); retry") from None
        if isinstance(out, RequestFailed):
            raise out.error
        check_same_weights(out.vision_weights, self.vision_weights)  # NOTE: before anything caches them
        return replace(out, embeddings=from_wire(out.embeddings, out.dtype))  # tensors, with the encoder's phases

    def metrics(self) -> MetricsSnapshot:
        return merge([decoder_snapshot(self.service.stats()), affinity.DECISIONS.snapshot()])  # and its router's

    def replica_info(self) -> dict[str, Any]:
        """Read-only introspection (tests, debugging): who answered and the torch threads its steps use
        (the counts measured at start-up unless configured, the cores others kept busy while each kind was
        measured and the kinds whose measurement that voided, and measured again while serving: trials run
        and the changes they made, as (kind, from, to)), and the matmul forms chosen at start-up (per
        thread count, by row count from 1), whether the layers' weights are packed for oneDNN (the layout
        chosen: the weights follow it one per step), and the layouts taken while serving (True = packed; None
        where the layout is not chosen while serving), and the tokens each running request has generated."""
        threads, forms, layout = self.engine.runner.threads, self.engine.runner.model.matmul, self.engine.runner.layout
        running = list(self.engine.scheduler.running)  # NOTE: a copy, beside the step thread that changes it
        return {"replica_id": serve.get_replica_context().replica_id.unique_id,
                "torch_threads": threads.available, "small_step_threads": threads.threads_for(0),
                "heavy_decode_threads": threads.threads_for(0, threads.heavy_rows + 1) if threads.heavy_rows else None,
                "heavy_decode_rows": threads.heavy_rows,
                "big_step_threads": threads.threads_for(threads.small_step_tokens + 1),
                "thread_trials": threads.trials_run, "thread_changes": threads.changes(),
                "thread_measurement_company": dict(threads.company),
                "thread_measurement_voided": sorted(threads.voided),
                "matmul_forms": {count: list(names[1:]) for count, names in forms.chosen.items()},
                "weights_packed": forms.pack_rows is not None,
                "weight_layout_changes": None if layout is None else list(layout.changes),
                "running_output_tokens": [seq.num_tokens - seq.num_prompt_tokens for seq in running]}
