"""Decoder deployment (GPU where there is one): mmserve's DecoderService behind a streaming handle.

Owns the translation only: it asks the Encoder deployment for a request's embeddings (they travel
encoder -> decoder through the object store, never through the ingress), streams RequestOutputs
back, and tells the encoder replica that served the request when it is done.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator
from typing import Any

import torch
from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments.args import AppArgs
from deployments.handles import hold
from deployments.metrics_hub import MetricsReporter
from deployments.process_setup import configure_step_process
from mmserve.errors import InvalidRequestError, OverloadedError
from mmserve.messages import EncoderOutput, PreprocessedRequest, RequestFailed, RequestOutput
from mmserve.runtime.embeddings_wire import from_wire
from mmserve.runtime.metrics import MetricsSnapshot, decoder_snapshot
from mmserve.stages import StageFactory

log = logging.getLogger(__name__)


@serve.deployment
class Decoder:
    def __init__(self, app_args: AppArgs, encoder: Any, hub: Any):
        configure_step_process(app_args.decoder)
        stages = StageFactory(app_args.engine_config(app_args.decoder))
        self.service = stages.decoder()
        stages.release_unused()
        self.engine = self.service.decoder
        self.encoder = hold(encoder)
        self._encoded_on: dict[str, str] = {}  # request id -> encoder replica holding its references
        self._releases: set[asyncio.Future] = set()  # release calls still in flight
        self.reporter = MetricsReporter(hub, "Decoder", self.metrics, app_args.metrics_push_interval_s)
        self.reporter.ensure_started()

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[RequestOutput | RequestFailed]:
        self.reporter.ensure_started()
        try:
            async for out in self.service.generate(request, encode=self._encode, release=self._release):
                yield out
        except (InvalidRequestError, OverloadedError) as exc:
            yield RequestFailed(request.request_id, exc)  # NOTE: a value, see mmserve.messages.RequestFailed

    async def _encode(self, request: PreprocessedRequest) -> list[torch.Tensor]:
        try:
            out: EncoderOutput | RequestFailed = await self.encoder.encode.remote(request.request_id,
                                                                                  request.features)
        except BackPressureError as exc:
            raise OverloadedError(f"the encoder's queue is full ({exc}); retry later") from None
        if isinstance(out, RequestFailed):
            raise out.error
        if out.replica_id is not None:
            self._encoded_on[request.request_id] = out.replica_id
        return from_wire(out.embeddings, out.dtype)

    def _release(self, request_id: str) -> None:
        """Tell the encoder replica that served the request to drop its references, without waiting.

        NOTE: not awaited: awaited, the round trip came after the last token and before the end of the
        stream, so every image request's end-to-end time paid one more hop.
        """
        replica_id = self._encoded_on.pop(request_id, None)
        if replica_id is not None:
            # NOTE: in a context of its own: Serve cancels the child calls made in a request's context
            # when that request is cancelled (a client leaving mid-stream), and an inherited one raced
            # that cancellation: the release was dropped and the references leaked.
            task = asyncio.get_running_loop().create_task(self._send_release(request_id, replica_id),
                                                          context=contextvars.Context())
            self._releases.add(task)  # NOTE: a reference, or the task may be collected before it runs
            task.add_done_callback(self._releases.discard)

    async def _send_release(self, request_id: str, replica_id: str) -> None:
        try:
            await self.encoder.release.remote(request_id, replica_id=replica_id)
        except Exception:  # the encoder replica is gone: its references went with it
            log.warning("releasing %s on encoder replica %s failed", request_id, replica_id, exc_info=True)

    def check_health(self) -> None:
        """Serve's periodic probe: a replica whose step thread died is replaced."""
        self.service.check_health()

    def __del__(self) -> None:
        """Serve calls this on the replica's graceful shutdown: join the step thread (see StepLoop.stop)."""
        for part in (getattr(self, "reporter", None), getattr(self, "service", None)):  # None: __init__ failed
            if part is not None:
                part.stop()

    def metrics(self) -> MetricsSnapshot:
        return decoder_snapshot(self.engine.stats())
