"""The in-process engine: preprocess -> encoder stage -> decoder, wired in one process.

Owns: the library API (`generate`, `stream`, `stats`, `shutdown`) over the three stages, which
`StageFactory` builds from one `EngineConfig` exactly as the Ray deployments build theirs. The
hand-offs are the same services the deployments use (`EncoderService`, `DecoderService`), called
directly instead of through handles. Does not own any stage's logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any

from mmserve.config import EngineConfig
from mmserve.decoder.decoder import LogitsObserver
from mmserve.decoder.service import DecoderService
from mmserve.decoder.stats import DecoderStats
from mmserve.encoder.outputs import EncoderStats
from mmserve.encoder.service import EncoderService
from mmserve.messages import (
    ChatRequest,
    EncoderOutput,
    PreprocessedRequest,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    merge_outputs,
)
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
        # NOTE: the step threads hold the stages, not the engine: an engine dropped without `shutdown` (a notebook
        # cell run again) stops them when it is collected, so its weights and KV pool are freed with it
        self._stopper = weakref.finalize(self, _stop_when_collected, self.encoder_service, self.decoder_service)

    @classmethod
    def from_model_dir(cls, model_dir: str, **engine_kwargs) -> Engine:
        return cls(EngineConfig(model=str(model_dir), **engine_kwargs))

    def default_sampling(self, **fields: Any) -> SamplingParams:
        """SamplingParams with the checkpoint's recommended sampling (its generation_config.json, as the served
        app gives a request's unset fields; `EngineConfig.sampling_defaults_from_checkpoint`), then `fields`.

        NOTE: a SamplingParams built directly is taken as it is, with OpenAI's defaults (vLLM's SamplingParams too).
        """
        defaults = {name: value for name, value in vars(self.spec.sampling_defaults).items() if value is not None}
        return SamplingParams(**{**defaults, **fields})

    def preprocess(self, request: ChatRequest,
                   cancelled: Callable[[], bool] = lambda: False) -> PreprocessedRequest:
        """Front end (raises InvalidRequestError subclasses for bad input); `cancelled()` is asked before each
        image's work."""
        return self.preprocessor.process(request, cancelled)

    async def _preprocessed(self, request: ChatRequest) -> PreprocessedRequest:
        """`preprocess` off the event loop; cancelled, its thread stops at the request's next image."""
        left = threading.Event()
        try:
            return await asyncio.to_thread(self.preprocess, request, left.is_set)
        except asyncio.CancelledError:
            left.set()
            raise

    def _serve(self, pre: PreprocessedRequest, admit: bool = True) -> AsyncGenerator[RequestOutput]:
        return self.decoder_service.generate(pre, encode=self._encode, admit=admit)

    async def _encode(self, pre: PreprocessedRequest) -> EncoderOutput:
        return await self.encoder_service.encode(pre.request_id, pre.features)

    async def stream(self, request: ChatRequest) -> AsyncGenerator[RequestOutput]:
        """Outputs of one request as they come; closing the generator early (`aclose`, or leaving an
        `async with contextlib.aclosing(...)`) aborts the request at once."""
        # NOTE: the decoder lets go of a request's pixels once they are encoded; this frame keeps none
        async with contextlib.aclosing(self._serve(await self._preprocessed(request))) as outputs:
            async for out in outputs:
                yield out

    def generate(self, requests: list[ChatRequest]) -> list[Completion]:
        """Run requests together through the batching pipeline; for callers without an event loop (from a
        coroutine, use `stream`). The first request that fails raises, and the others are aborted.

        One Completion per choice: the requests in order, a request's `n` choices by index.
        NOTE: never refused as an overload (the decoder's `max_waiting_requests` is for callers that do not wait
        their turn): it keeps at most `max_num_seqs + max_waiting_requests` sequences in flight itself (the rest
        wait here, not preprocessed), so a request's pixels exist only while it is in flight.
        """
        with contextlib.suppress(RuntimeError):  # NOTE: none running is the case that works
            asyncio.get_running_loop()
            raise TypeError("Engine.generate runs its own event loop; from a coroutine, use Engine.stream")

        async def run_all() -> list[list[Completion]]:
            room = _Room(self.config.decoder.max_num_seqs + self.config.decoder.max_waiting_requests)
            return list(await asyncio.gather(*(self._complete(r, room) for r in requests)))

        return [choice for choices in asyncio.run(run_all()) for choice in choices]

    async def _complete(self, request: ChatRequest, room: _Room) -> list[Completion]:
        n = request.sampling.n
        outputs: dict[int, list[RequestOutput]] = {i: [] for i in range(n)}
        async with room.taken(n):
            pre = await self._preprocessed(request)
            prompt_tokens = len(pre.prompt_token_ids)
            pre = replace(pre, sampling=replace(pre.sampling, final_only=True))  # the whole answer is read at once
            async with contextlib.aclosing(self._serve(pre, admit=False)) as served:
                del pre  # NOTE: the decoder lets go of the pixels once encoded; keep none here
                async for out in served:
                    outputs[out.index].append(out)
        return [_completion(request.request_id, prompt_tokens, index, outs) for index, outs in outputs.items()]

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

        An engine never shut down is stopped when it is collected, or at interpreter exit.
        """
        if self._stopper.detach() is not None:  # NOTE: the first call; its finalizer will not run again
            _stop(self.encoder_service, self.decoder_service)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> Engine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """`async with Engine(...)`: the shutdown's joins run on a worker thread, so the caller's event loop
        (its other tasks, and the streams that learn of the stop) keeps running meanwhile."""
        await asyncio.to_thread(self.shutdown)


def _completion(request_id: str, prompt_tokens: int, index: int, outputs: list[RequestOutput]) -> Completion:
    """One choice's outputs folded into its Completion."""
    whole = merge_outputs(outputs)
    return Completion(request_id, whole.new_text, whole.new_token_ids, whole.finish_reason, prompt_tokens,
                      whole.num_cached_tokens, whole.logprobs, index, whole.stop_reason)


def _stop(encoder: EncoderService, decoder: DecoderService) -> None:
    encoder.stop()
    decoder.stop()


def _stop_when_collected(encoder: EncoderService, decoder: DecoderService) -> None:
    """An engine's finalizer: `_stop` here on the main thread (interpreter exit), else on a thread of its own.

    NOTE: a collection runs finalizers on whichever thread it happened, a step thread too, which must neither
    wait for its own loop's lock nor join another engine's threads in the middle of a step.
    """
    if threading.current_thread() is threading.main_thread():
        _stop(encoder, decoder)
    else:
        threading.Thread(target=_stop, args=(encoder, decoder), name="mmserve-engine-stop", daemon=True).start()


class _Room:
    """Sequences in flight, at most `limit` (a request of more than `limit` goes alone)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def taken(self, n: int) -> AsyncGenerator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
        try:
            yield
        finally:
            async with self._changed:
                self.used -= n
                self._changed.notify_all()


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"
