"""The in-process engine: preprocess -> encoder stage -> decoder, wired in one process.

Owns: the hand-offs between the stages (what the Ray app does with handles, done here with
calls), a thread-safe inbox so async callers can submit and abort while the step loop runs, and
the library API (`generate`, `stream`). Does not own: any stage's logic.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from mmserve.config import EngineConfig, ModelConfig
from mmserve.decoder.decoder import Decoder, DecoderStats, LogitsObserver
from mmserve.encoder.runner import EncoderRunner
from mmserve.encoder.stage import EncodedRequest, EncoderStage, EncoderStats, EncoderStepError
from mmserve.errors import InvalidRequestError
from mmserve.messages import (
    ChatRequest,
    DecodeRequest,
    PreprocessedRequest,
    RequestFailed,
    RequestOutput,
)
from mmserve.models.registry import load_family
from mmserve.processing import Preprocessor
from mmserve.processor_cache import InMemoryStorage, ProcessorCache, ProcessorCacheStats
from mmserve.step_loop import StepLoop


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
        runner = EncoderRunner(family.load_vision(), max_batch_items=config.encoder.max_batch_items,
                               device=device, dtype=dtype)
        self.encoder = EncoderStage(runner, config.encoder)
        self.decoder = Decoder(family.load_text(), self.spec, self.preprocessor.tokenizer, config.scheduler,
                               config.kv_cache, dtype=dtype, device=device, on_logits=on_logits)
        family.release_unused()
        self._lock = threading.Lock()
        self._inbox: list[PreprocessedRequest] = []
        self._aborts: list[str] = []
        self._prompts: dict[str, PreprocessedRequest] = {}  # waiting for the encoder
        self._loop = StepLoop(self)

    @classmethod
    def from_model_dir(cls, model_dir: str, **model_kwargs) -> Engine:
        return cls(EngineConfig(model=ModelConfig(model_dir=str(model_dir), **model_kwargs)))

    # ---- thread-safe API -------------------------------------------------------------------
    def preprocess(self, request: ChatRequest) -> PreprocessedRequest:
        """Front end (raises InvalidRequestError subclasses for bad input)."""
        return self.preprocessor.process(request)

    def submit(self, request: PreprocessedRequest) -> None:
        with self._lock:
            self._inbox.append(request)
        self._loop.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._loop.notify()

    # ---- the step, run by one thread ---------------------------------------------------------
    def has_unfinished(self) -> bool:
        with self._lock:
            if self._inbox or self._aborts:
                return True
        return bool(self._prompts) or self.encoder.has_pending() or self.decoder.has_unfinished()

    def step(self) -> list[RequestOutput | RequestFailed]:
        outputs: list[RequestOutput | RequestFailed] = []
        self._drain_inbox(outputs)
        for encoded in self._encoder_step(outputs):
            pre = self._prompts.pop(encoded.request_id)
            self._to_decoder(pre, encoded.embeddings, outputs)
        for out in self.decoder.step():
            outputs.append(out)
            if out.finished:
                self.encoder.release(out.request_id)
        return outputs

    def _encoder_step(self, outputs: list[RequestOutput | RequestFailed]) -> list[EncodedRequest]:
        try:
            return self.encoder.step()
        except EncoderStepError as exc:  # the stage already dropped these requests
            for request_id in exc.request_ids:
                self._prompts.pop(request_id, None)
                outputs.append(RequestFailed(request_id, exc))
            return []

    def abort_all(self) -> None:
        for request_id in list(self._prompts) + self.decoder.request_ids():
            self._abort_now(request_id)

    def _drain_inbox(self, outputs: list[RequestOutput | RequestFailed]) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            out = self._abort_now(request_id)
            if out is not None:
                outputs.append(out)
        for pre in inbox:
            if not pre.features:
                self._to_decoder(pre, [], outputs)
                continue
            try:
                self.encoder.add_request(pre.request_id, pre.features)
                self._prompts[pre.request_id] = pre
            except InvalidRequestError as exc:
                outputs.append(RequestFailed(pre.request_id, exc))

    def _to_decoder(self, pre: PreprocessedRequest, embeddings: list, outputs: list) -> None:
        request = DecodeRequest(pre.request_id, pre.prompt_token_ids, pre.features, embeddings, pre.sampling)
        try:
            self.decoder.add(request)
        except InvalidRequestError as exc:
            self.encoder.release(pre.request_id)
            outputs.append(RequestFailed(pre.request_id, exc))

    def _abort_now(self, request_id: str) -> RequestOutput | None:
        self.encoder.release(request_id)
        pre = self._prompts.pop(request_id, None)
        out = self.decoder.abort(request_id)
        if out is None and pre is not None:
            out = RequestOutput(request_id, [], "", True, "abort", len(pre.prompt_token_ids), 0)
        return out

    # ---- library API ------------------------------------------------------------------------
    def generate(self, requests: list[ChatRequest]) -> list[Completion]:
        """Run requests together through the batching pipeline; for callers without an event loop."""
        pres = [self.preprocess(r) for r in requests]
        return asyncio.run(self._complete_all(pres))

    async def _complete_all(self, pres: list[PreprocessedRequest]) -> list[Completion]:
        for pre in pres:
            self._loop.open(pre.request_id)
        with self._lock:  # one hand-off, so the first step sees them all
            self._inbox.extend(pres)
        self._loop.notify()
        return list(await asyncio.gather(*(self._complete(pre) for pre in pres)))

    async def _complete(self, pre: PreprocessedRequest) -> Completion:
        texts: list[str] = []
        tokens: list[int] = []
        reason = None
        async for out in self._loop.outputs(pre.request_id):
            texts.append(out.new_text)
            tokens += out.new_token_ids
            reason = out.finish_reason
        return Completion(pre.request_id, "".join(texts), tokens, reason, len(pre.prompt_token_ids))

    async def stream(self, request: ChatRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; closing the iterator early aborts the request."""
        pre = await asyncio.to_thread(self.preprocess, request)
        self._loop.open(pre.request_id)
        self.submit(pre)
        finished = False
        try:
            async for out in self._loop.outputs(pre.request_id):
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(pre.request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            image_processor_calls=self.preprocessor.image_processor_calls,
            processor_cache=self.processor_cache.stats(),
            encoder=self.encoder.stats(),
            decoder=self.decoder.stats(),
        )

    def shutdown(self) -> None:
        self._loop.stop()


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"
