"""The in-process engine: preprocess -> encoder stage -> decoder, wired in one process.

Owns: building the three stages from one `EngineConfig` and the library API (`generate`, `stream`,
`stats`). The hand-offs are the same services the Ray deployments use (`EncoderService`,
`DecoderService`), called directly instead of through handles. Does not own any stage's logic.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from mmserve.config import EngineConfig, ModelConfig
from mmserve.decoder.decoder import Decoder, DecoderStats, LogitsObserver
from mmserve.decoder.service import DecoderService
from mmserve.encoder.runner import EncoderRunner
from mmserve.encoder.service import EncoderService
from mmserve.encoder.stage import EncoderStage, EncoderStats
from mmserve.messages import ChatRequest, PreprocessedRequest, RequestOutput
from mmserve.models.registry import load_family
from mmserve.processing import Preprocessor
from mmserve.processor_cache import InMemoryStorage, ProcessorCache, ProcessorCacheStats


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str  # generated text, stop string excluded
    token_ids: list[int]  # generated tokens (tokens)
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int  # prompt tokens, image tokens included (tokens)


@dataclass(frozen=True)
class EngineStats:
    image_processor_calls: int  # HF image-processor invocations (calls)
    processor_cache: ProcessorCacheStats
    encoder: EncoderStats
    decoder: DecoderStats


class Engine:
    def __init__(self, config: EngineConfig, *, on_logits: LogitsObserver | None = None):
        self.config = config
        family = load_family(config.model)
        self.spec = family.spec
        dtype, device = getattr(torch, config.model.dtype), torch.device(config.model.device)
        self.processor_cache = ProcessorCache(config.processor_cache.capacity_bytes, InMemoryStorage())
        self.preprocessor = Preprocessor(
            config.model.model_dir, media=config.media, cache=self.processor_cache, rule=family.prompt_rule,
            model_id=self.spec.model_id, max_model_len=self.spec.max_model_len,
        )
        runner = EncoderRunner(family.load_vision(), max_batch_items=config.encoder.max_batch_items, device=device)
        self.encoder = EncoderStage(runner, config.encoder)
        self.decoder = Decoder(family.load_text(), self.spec, self.preprocessor.tokenizer, config.scheduler,
                               config.kv_cache, dtype=dtype, device=device, on_logits=on_logits,
                               threads=config.decoder_threads)
        family.release_unused()
        self.encoder_service = EncoderService(self.encoder)
        self.decoder_service = DecoderService(self.decoder)

    @classmethod
    def from_model_dir(cls, model_dir: str, **model_kwargs) -> Engine:
        return cls(EngineConfig(model=ModelConfig(model_dir=str(model_dir), **model_kwargs)))

    def preprocess(self, request: ChatRequest) -> PreprocessedRequest:
        """Front end (raises InvalidRequestError subclasses for bad input)."""
        return self.preprocessor.process(request)

    def _serve(self, pre: PreprocessedRequest) -> AsyncIterator[RequestOutput]:
        encode = lambda p: self.encoder_service.encode(p.request_id, p.features)  # noqa: E731
        return self.decoder_service.generate(pre, encode=encode, release=self.encoder_service.release)

    async def stream(self, request: ChatRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; closing the iterator early aborts the request."""
        pre = await asyncio.to_thread(self.preprocess, request)
        async for out in self._serve(pre):
            yield out

    def generate(self, requests: list[ChatRequest]) -> list[Completion]:
        """Run requests together through the batching pipeline; for callers without an event loop."""
        pres = [self.preprocess(r) for r in requests]

        async def run_all() -> list[Completion]:
            return list(await asyncio.gather(*(self._complete(pre) for pre in pres)))

        return asyncio.run(run_all())

    async def _complete(self, pre: PreprocessedRequest) -> Completion:
        texts: list[str] = []
        tokens: list[int] = []
        reason = None
        async for out in self._serve(pre):
            texts.append(out.new_text)
            tokens += out.new_token_ids
            reason = out.finish_reason
        return Completion(pre.request_id, "".join(texts), tokens, reason, len(pre.prompt_token_ids))

    def has_unfinished(self) -> bool:
        return self.encoder_service.busy() or self.decoder_service.busy()

    def stats(self) -> EngineStats:
        return EngineStats(
            image_processor_calls=self.preprocessor.image_processor_calls,
            processor_cache=self.processor_cache.stats(),
            encoder=self.encoder.stats(),
            decoder=self.decoder.stats(),
        )

    def shutdown(self) -> None:
        """Stop and join the stages' step threads; requests still running fail. Idempotent.

        An engine never shut down is stopped at interpreter exit (mmserve.step_loop's exit hook).
        """
        self.encoder_service.stop()
        self.decoder_service.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"
