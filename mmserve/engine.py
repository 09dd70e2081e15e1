"""The in-process engine: preprocess -> encoder stage -> decoder, wired in one process.

Owns: the library API (`generate`, `stream`, `stats`, `shutdown`) over the three stages, which
`StageFactory` builds from one `EngineConfig` exactly as the Ray deployments build theirs. The
hand-offs are the same services the deployments use (`EncoderService`, `DecoderService`), called
directly instead of through handles. Does not own any stage's logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace

from mmserve.config import EngineConfig
from mmserve.decoder.decoder import LogitsObserver
from mmserve.decoder.stats import DecoderStats
from mmserve.encoder.outputs import EncoderStats
from mmserve.messages import ChatRequest, EncoderOutput, PreprocessedRequest, RequestOutput, TokenLogprob, merge_outputs
from mmserve.preprocess.processor_cache import ProcessorCache, ProcessorCacheStats
from mmserve.stages import StageFactory


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str  # generated text, stop string excluded
    token_ids: list[int]  # generated tokens (tokens)
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int  # prompt tokens, image tokens included (tokens)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (tokens)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the request asked
    index: int = 0  # which of the request's `n` choices (choice index)
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended a "stop"


@dataclass(frozen=True)
class EngineStats:
    image_processor_calls: int  # HF image-processor invocations (calls)
    processor_cache: ProcessorCacheStats
    encoder: EncoderStats
    decoder: DecoderStats


class Engine:
    def __init__(self, config: EngineConfig, *, on_logits: LogitsObserver | None = None):
        self.config = config
        stages = StageFactory(config)
        self.spec = stages.spec
        self.processor_cache = ProcessorCache.from_config(config.processor_cache)
        self.preprocessor = stages.preprocessor(self.processor_cache)
        self.encoder_service = stages.encoder()
        self.decoder_service = stages.decoder(self.preprocessor.tokenizer, on_logits=on_logits)
        stages.release_unused()
        self.encoder, self.decoder = self.encoder_service.stage, self.decoder_service.decoder

    @classmethod
    def from_model_dir(cls, model_dir: str, **engine_kwargs) -> Engine:
        return cls(EngineConfig(model=str(model_dir), **engine_kwargs))

    def preprocess(self, request: ChatRequest) -> PreprocessedRequest:
        """Front end (raises InvalidRequestError subclasses for bad input)."""
        return self.preprocessor.process(request)

    def _serve(self, pre: PreprocessedRequest) -> AsyncGenerator[RequestOutput]:
        return self.decoder_service.generate(pre, encode=self._encode)

    async def _encode(self, pre: PreprocessedRequest) -> EncoderOutput:
        return await self.encoder_service.encode(pre.request_id, pre.features)

    async def stream(self, request: ChatRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; closing the iterator early aborts the request."""
        pre = await asyncio.to_thread(self.preprocess, request)
        async with contextlib.aclosing(self._serve(pre)) as outputs:  # NOTE: closing this one aborts it at once
            async for out in outputs:
                yield out

    def generate(self, requests: list[ChatRequest]) -> list[Completion]:
        """Run requests together through the batching pipeline; for callers without an event loop.

        One Completion per choice: the requests in order, a request's `n` choices by index."""
        pres = [self.preprocess(r) for r in requests]

        async def run_all() -> list[list[Completion]]:
            return list(await asyncio.gather(*(self._complete(pre) for pre in pres)))

        return [choice for choices in asyncio.run(run_all()) for choice in choices]

    async def _complete(self, pre: PreprocessedRequest) -> list[Completion]:
        outputs: dict[int, list[RequestOutput]] = {i: [] for i in range(pre.sampling.n)}
        pre = replace(pre, sampling=replace(pre.sampling, final_only=True))  # the whole answer is read at once
        async for out in self._serve(pre):
            outputs[out.index].append(out)
        return [_completion(pre, index, outs) for index, outs in outputs.items()]

    def has_unfinished(self) -> bool:
        return self.encoder_service.busy() or self.decoder_service.busy()

    def stats(self) -> EngineStats:
        return EngineStats(
            image_processor_calls=self.preprocessor.image_processor_calls,
            processor_cache=self.processor_cache.stats(),
            encoder=self.encoder.stats(),
            decoder=self.decoder_service.stats(),
        )

    def shutdown(self) -> None:
        """Stop and join the stages' step threads; requests still running fail. Idempotent.

        An engine never shut down is stopped at interpreter exit (mmserve.runtime.step_loop's exit hook).
        """
        self.encoder_service.stop()
        self.decoder_service.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _completion(pre: PreprocessedRequest, index: int, outputs: list[RequestOutput]) -> Completion:
    """One choice's outputs folded into its Completion."""
    whole = merge_outputs(outputs)
    return Completion(pre.request_id, whole.new_text, whole.new_token_ids, whole.finish_reason,
                      len(pre.prompt_token_ids), whole.num_cached_tokens, whole.logprobs, index, whole.stop_reason)


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"
