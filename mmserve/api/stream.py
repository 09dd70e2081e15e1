"""Engine outputs -> OpenAI response bodies: the non-streaming accumulator, stream chunks, SSE framing.

Owns: folding a request's `RequestOutput` deltas into one `ChatCompletionResponse`, turning each delta
into the `ChatCompletionChunk`s to send (first carries the role, last the finish reason, then an
optional usage chunk), and `data: ...` framing. Does not own: the request/response schemas and error
bodies (protocol.py), reading the engine, nor writing to the socket.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from mmserve.api.errors import error_body
from mmserve.api.logprobs import ChoiceLogprobs, choice_logprobs
from mmserve.api.protocol import AssistantMessage, ChatCompletionResponse, Choice, PromptTokensDetails, Usage
from mmserve.messages import RequestFailed, RequestOutput, TokenLogprob

SSE_DONE = "data: [DONE]\n\n"


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}  # OpenAI sends `{}`, not nulls


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None  # set on the last content chunk only
    logprobs: ChoiceLogprobs | None = None  # the tokens since the last chunk, when the request set `logprobs`


class ChatCompletionChunk(BaseModel):
    id: str  # the same for every chunk of a response
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]  # empty in the usage chunk
    usage: Usage | None = None  # only in the usage chunk (stream_options.include_usage)


def sse(obj: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    body = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(
        obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error event for a stream whose 200 status is already sent; the official client raises on it."""
    return sse(error_body(exc)[1])


def _usage(out: RequestOutput) -> Usage:
    return Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                 total_tokens=out.num_prompt_tokens + out.num_output_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def _ok(out: RequestOutput | RequestFailed) -> RequestOutput:
    if isinstance(out, RequestFailed):
        raise out.error
    return out


class CompletionBuilder:
    """Accumulates one request's outputs into the non-streaming response."""

    def __init__(self, response_id: str, model: str, *, created: int | None = None) -> None:
        self.response_id, self.model = response_id, model
        self.created = int(time.time()) if created is None else created
        self._texts: list[str] = []
        self._logprobs: list[TokenLogprob] | None = None  # None while the request asked for none
        self._last: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self._last is not None and self._last.finished

    def add(self, out: RequestOutput | RequestFailed) -> None:
        """Fold one delta in; re-raises a `RequestFailed`'s error."""
        out = _ok(out)
        self._texts.append(out.new_text)
        if out.logprobs is not None:
            self._logprobs = self._logprobs if self._logprobs is not None else []
            self._logprobs.extend(out.logprobs)
        self._last = out

    def build(self) -> ChatCompletionResponse:
        last = self._last
        if last is None or not last.finished:
            raise RuntimeError(f"response {self.response_id} built before its request finished")
        choice = Choice(message=AssistantMessage(content="".join(self._texts)), finish_reason=last.finish_reason,
                        logprobs=None if self._logprobs is None else choice_logprobs(self._logprobs))
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=[choice], usage=_usage(last))


class ChunkBuilder:
    """Turns one request's outputs into stream chunks; one instance per streamed response."""

    def __init__(self, response_id: str, model: str, *, include_usage: bool = False,
                 created: int | None = None) -> None:
        self.response_id, self.model, self.include_usage = response_id, model, include_usage
        self.created = int(time.time()) if created is None else created
        self._sent_role = False
        self._done = False
        self._pending: list[TokenLogprob] | None = None  # log-probs of tokens whose text is not sent yet

    def chunks(self, out: RequestOutput | RequestFailed) -> list[ChatCompletionChunk]:
        """The chunks for one delta (maybe none); re-raises a `RequestFailed`'s error."""
        out = _ok(out)
        if out.logprobs is not None:
            self._pending = self._pending if self._pending is not None else []
            self._pending.extend(out.logprobs)
        if self._done or (self._sent_role and not out.new_text and not out.finished):
            return []  # NOTE: no empty chunks for steps that produced no text (held back or mid-character)
        first, self._sent_role = not self._sent_role, True
        delta = Delta(role="assistant" if first else None, content=out.new_text if out.new_text or first else None)
        reason = out.finish_reason if out.finished else None
        pending, self._pending = self._pending, None if self._pending is None else []
        logprobs = None if pending is None else choice_logprobs(pending)  # NOTE: a held-back token's go later
        chunks = [self._chunk([ChunkChoice(delta=delta, finish_reason=reason, logprobs=logprobs)])]
        if out.finished:
            self._done = True
            if self.include_usage:
                chunks.append(self._chunk([], usage=_usage(out)))
        return chunks

    def events(self, out: RequestOutput | RequestFailed) -> list[str]:
        """`chunks` as SSE strings, with the closing `[DONE]` after the last."""
        events = [sse(c) for c in self.chunks(out)]
        return [*events, SSE_DONE] if out.finished and events else events

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                   choices=choices, usage=usage)
