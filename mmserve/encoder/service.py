"""The encoder stage behind an async API: many concurrent callers, one stepping thread.

Owns: turning `encode(request)` calls into queued stage actions, batching arrivals within a short
window, handing back each request's embeddings (at once, without waiting for the step under way, when all are
cached), and early encodes (`encode_early`: items encoded into the
cache ahead of the request that will ask for them). Does not own: caching or encoding (EncoderStage)
nor transport (the in-process Engine calls it directly; the Ray Encoder deployment via a handle).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import torch

from mmserve.encoder.outputs import Resolver, inline_pixels
from mmserve.encoder.stage import EncoderStage
from mmserve.messages import EncoderOutput, MultiModalFeatureSpec, PhaseTimes
from mmserve.runtime.device_errors import device_fatal
from mmserve.runtime.shared_cores import cpu_host
from mmserve.runtime.step_loop import StageStopped, StepLoop

log = logging.getLogger(__name__)


class EncoderService:
    def __init__(self, stage: EncoderStage, *, batch_wait_s: float = 0.0, resolve: Resolver = inline_pixels):
        self.stage = stage
        self.resolve = resolve
        self.loop = StepLoop(stage.step, stage.has_pending, stage.abort_all, batch_wait_s=batch_wait_s,
                             name="mmserve-encoder", fatal=device_fatal)
        self._early: set[asyncio.Task] = set()  # early encodes under way (held: the loop keeps weak references)

    async def encode(self, request_id: str, features: list[MultiModalFeatureSpec], early: bool = False
                     ) -> EncoderOutput:
        """Embeddings of each feature, in order: (num_embeds, hidden) tensors, with the stage's phases. Raises if
        refused.

        The request holds its encoder-cache entries until they are handed back here, not after.
        """
        if not features:
            return EncoderOutput(request_id, [])
        if self.loop.died():  # NOTE: not even a cache hit: the dead device's tensors cannot be read
            raise self.faulted(features)
        if not early and not self.loop.has_consumer(request_id):  # NOTE: a live id's second call is refused below
            served = self._from_cache(request_id, features)
            if served is not None:
                return served
        self.loop.open(request_id)
        self.loop.submit(request_id, lambda: self.stage.add_request(request_id, features, self.resolve, early))
        try:
            # NOTE: closed on the way out, so that the request's channel is gone when this returns (left to the
            # collector, the same id could not be opened again for a loop turn or two)
            async with contextlib.aclosing(self.loop.outputs(request_id)) as outputs:
                async for out in outputs:
                    return self._output(request_id, list(out.embeddings), out.timings)
        except asyncio.CancelledError:  # the caller left before its embeddings came
            self.abort(request_id)
            raise
        except StageStopped:  # NOTE: e.g. its own early encode's forward hit a fault: that fault, not a retry
            fault = self.stage.fault_of(features)
            if fault is not None:
                raise fault from None
            raise
        raise RuntimeError(f"encoder stage ended request {request_id} without embeddings")

    def faulted(self, features: list[MultiModalFeatureSpec]) -> BaseException:
        """What a request for `features` gets once the device faulted: the fault itself where the faulting forward
        held one of its items (no caller may take those to another replica), else a lost stage (retried there)."""
        return self.stage.fault_of(features) or StageStopped(f"{self.loop.name}: the device faulted")

    def _from_cache(self, request_id: str, features: list[MultiModalFeatureSpec]) -> EncoderOutput | None:
        """The request answered from the cache alone, without a turn of the step thread (which may be inside a
        forward for others); None when an item is missing."""
        started = time.perf_counter()
        embeddings = self.stage.cached(features)
        if embeddings is None:
            return None
        return self._output(request_id, embeddings, (("encoder.stage", (time.perf_counter() - started) * 1e3),))

    def _output(self, request_id: str, embeddings: list[torch.Tensor], timings: PhaseTimes) -> EncoderOutput:
        dtype = str(embeddings[0].dtype).removeprefix("torch.")  # NOTE: tensors, not the wire's numpy
        return EncoderOutput(request_id, embeddings, dtype=dtype, timings=timings,
                             host=cpu_host(self.stage.runner.device.type))

    def encode_early(self, request_id: str, features: list[MultiModalFeatureSpec]) -> bool:
        """Start encoding `features` into the cache for a request still on its way here (its own `encode`
        call then finds them); returns at once, False when nothing was started.

        NOTE: only on an idle stage. Then the items are encoded while the request travels on, which is
        what an early start buys; a busy stage would only queue them twice, and under load nothing is
        gained by starting sooner. Failures are logged, not raised: the request's own call reports its own.
        """
        if not features or self.loop.busy():
            return False
        task = asyncio.ensure_future(self.encode(request_id, features, early=True))
        self._early.add(task)
        task.add_done_callback(self._early_done)
        return True

    def _early_done(self, task: asyncio.Task) -> None:
        self._early.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("an early encode failed (its request will encode on its own): %r", task.exception())

    def abort(self, request_id: str) -> None:
        """Drop a request still waiting for its embeddings (idempotent)."""
        self.loop.submit(None, lambda: self.stage.abort(request_id))

    def busy(self) -> bool:
        return self.loop.busy()

    def check_health(self, stuck_after_s: float | None = None) -> None:
        self.loop.check_health(stuck_after_s)

    def stop(self) -> None:
        self.loop.stop()
