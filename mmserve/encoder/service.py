"""The encoder stage behind an async API: many concurrent callers, one stepping thread.

Owns: turning `encode(request)` calls into queued stage actions, batching arrivals within a short
window, and handing back each request's embeddings. Does not own: caching or encoding (EncoderStage)
nor transport (the in-process Engine calls it directly; the Ray Encoder deployment via a handle).
"""

from __future__ import annotations

import asyncio
from typing import Any

from mmserve.encoder.stage import EncoderStage, Resolver, inline_pixels
from mmserve.messages import MultiModalFeatureSpec
from mmserve.runtime.step_loop import StepLoop


class EncoderService:
    def __init__(self, stage: EncoderStage, *, batch_wait_s: float = 0.0, resolve: Resolver = inline_pixels):
        self.stage = stage
        self.resolve = resolve
        self.loop = StepLoop(stage.step, stage.has_pending, stage.abort_all, batch_wait_s=batch_wait_s,
                             name="mmserve-encoder")

    async def encode(self, request_id: str, features: list[MultiModalFeatureSpec]) -> list[Any]:
        """Embeddings of each feature, in order: (num_embeds, hidden) tensors. Raises if refused.

        The request holds its encoder-cache entries until they are handed back here, not after.
        """
        if not features:
            return []
        self.loop.open(request_id)
        self.loop.submit(request_id, lambda: self.stage.add_request(request_id, features, self.resolve))
        try:
            async for out in self.loop.outputs(request_id):
                return list(out.embeddings)
        except asyncio.CancelledError:  # the caller left before its embeddings came
            self.abort(request_id)
            raise
        raise RuntimeError(f"encoder stage ended request {request_id} without embeddings")

    def abort(self, request_id: str) -> None:
        """Drop a request still waiting for its embeddings (idempotent)."""
        self.loop.submit(None, lambda: self.stage.abort(request_id))

    def busy(self) -> bool:
        return self.loop.busy()

    def check_health(self) -> None:
        self.loop.check_health()

    def stop(self) -> None:
        self.loop.stop()
