"""The decoder behind an async API: one request's life from embeddings to its last token.

Owns: the request lifecycle around the Decoder — get embeddings (from an in-process encoder or a
remote one), queue the request, stream its outputs, abort it in the decoder if the consumer leaves
early, and always release its encoder-cache references at the end. Does not own: scheduling or the
model (Decoder) nor transport (the Engine and the Ray Decoder deployment both use this).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from mmserve.decoder.decoder import Decoder
from mmserve.messages import DecodeRequest, PreprocessedRequest, RequestOutput, merge_outputs
from mmserve.runtime.step_loop import StepLoop

EncodeFn = Callable[[PreprocessedRequest], Awaitable[list[Any]]]  # -> per-feature embeddings
ReleaseFn = Callable[[str], Any]  # request id -> None or an awaitable


class DecoderService:
    def __init__(self, decoder: Decoder, *, stream_interval_s: float = 0.0):
        self.decoder = decoder
        self.stream_interval_s = stream_interval_s  # outputs go at most this often, the first at once
        self.loop = StepLoop(decoder.step, decoder.has_unfinished, decoder.abort_all, name="mmserve-decoder")

    async def generate(
        self, pre: PreprocessedRequest, encode: EncodeFn | None = None, release: ReleaseFn | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; closing the iterator early aborts it and frees its KV blocks."""
        request_id = pre.request_id
        finished = False
        try:
            embeddings = await encode(pre) if encode is not None and pre.features else []
            request = DecodeRequest(request_id, pre.prompt_token_ids, pre.features, embeddings, pre.sampling)
            self.loop.open(request_id)
            self.loop.submit(request_id, lambda: self.decoder.add(request))
            # NOTE: deltas that piled up while this consumer waited, or came within one stream interval,
            # go on as one: each output is a message through Serve to the ingress and on to the client.
            async for out in self.loop.outputs(request_id, merge=merge_outputs, interval_s=self.stream_interval_s):
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.loop.submit(None, lambda: self.decoder.abort(request_id))
            if release is not None and pre.features:
                result = release(request_id)
                if inspect.isawaitable(result):
                    await result

    def busy(self) -> bool:
        return self.loop.busy()

    def stop(self) -> None:
        self.loop.stop()
