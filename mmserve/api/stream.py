"""Engine outputs -> OpenAI response bodies: the non-streaming accumulator, stream chunks, SSE framing.

Owns: folding a request's `RequestOutput` deltas into one `ChatCompletionResponse`, turning each delta
into the `ChatCompletionChunk`s to send (a choice's first carries the role, or with n > 1 every choice's
role comes first, in index order; a choice's last carries the finish reason; then an optional usage chunk,
and the usage so far on every chunk if asked; with vLLM's `return_token_ids` the prompt's ids on the first chunk
(each role chunk, with n > 1) and each chunk's own token ids: a token whose text is held back sends its id with
the next chunk, where vLLM sends an empty one), and `data: ...` framing. Does not own: the request/response
schemas and error bodies (protocol.py), reading the engine, nor writing to the socket.
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from mmserve.api.errors import error_body
from mmserve.api.logprobs import ChoiceLogprobs, choice_logprobs
from mmserve.api.protocol import AssistantMessage, ChatCompletionResponse, Choice, PromptTokensDetails, Usage
from mmserve.api.vllm_fields import DROPPED_WHEN_NONE, VllmFields
from mmserve.messages import RequestFailed, RequestOutput, TokenLogprob

SSE_DONE = "data: [DONE]\n\n"
# NOTE: as OpenAI's: a proxy between (nginx, a CDN) must neither cache a stream nor hold its events back
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}  # OpenAI sends `{}`, not nulls


class ChunkChoice(VllmFields):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None  # set on the last content chunk only
    stop_reason: str | int | None = None  # vLLM's, on the last content chunk only (`Choice.stop_reason`)
    logprobs: ChoiceLogprobs | None = None  # the tokens since the last chunk, when the request set `logprobs`
    token_ids: list[int] | None = None  # the token ids since the last chunk, with vLLM's `return_token_ids`


class ChatCompletionChunk(VllmFields):
    id: str  # the same for every chunk of a response
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]  # empty in the usage chunk
    usage: Usage | None = None  # in the usage chunk (stream_options.include_usage; null on the others); on every
    # chunk so far with stream_options.continuous_usage_stats
    prompt_token_ids: list[int] | None = None  # on the first chunk, with `return_token_ids` (images expanded)


class UnaskedUsageChunk(ChatCompletionChunk):
    """A chunk of a stream that did not ask for usage: OpenAI's chunks then have no `usage` field (not a null)."""

    DROPPED: ClassVar[tuple[str, ...]] = (*DROPPED_WHEN_NONE, "usage")


def sse(obj: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying `obj` as compact JSON."""
    body = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(
        obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error event for a stream whose 200 status is already sent; the official client raises on it.
    NOTE: no `[DONE]` after it (vLLM sends one): a client that reads to `[DONE]` and skips error events must
    not take a failed answer for a whole one."""
    return sse(error_body(exc)[1])


def _ok(out: RequestOutput | RequestFailed) -> RequestOutput:
    if isinstance(out, RequestFailed):
        raise out.error
    return out


class _Choices:
    """The latest output of each of a request's `n` choices."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.last: dict[int, RequestOutput] = {}

    def note(self, out: RequestOutput) -> None:
        self.last[out.index] = out

    @property
    def finished(self) -> bool:
        return len(self.last) == self.n and all(out.finished for out in self.last.values())

    @property
    def tokens(self) -> tuple[int, int]:
        """(prompt tokens, counted once; output tokens of all choices) so far."""
        if not self.last:
            return 0, 0
        return self.last[min(self.last)].num_prompt_tokens, sum(o.num_output_tokens for o in self.last.values())

    def usage(self) -> Usage:
        """`tokens` as OpenAI's usage, with choice 0's cached share of the prompt."""
        prompt, completion = self.tokens
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.last[min(self.last)].num_cached_tokens))


class CompletionBuilder:
    """Accumulates one request's outputs (each of its `n` choices) into the non-streaming response."""

    def __init__(self, response_id: str, model: str, *, n: int = 1, created: int | None = None,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.response_id, self.model = response_id, model
        self.created = int(time.time()) if created is None else created
        self.choices = _Choices(n)
        self._texts: dict[int, list[str]] = {i: [] for i in range(n)}
        self._logprobs: dict[int, list[TokenLogprob]] = {}  # only for choices whose outputs carry them
        self.prompt_token_ids = prompt_token_ids  # None: the request did not ask for token ids
        self._token_ids: dict[int, list[int]] = {i: [] for i in range(n)}

    @property
    def finished(self) -> bool:
        return self.choices.finished

    def add(self, out: RequestOutput | RequestFailed) -> None:
        """Fold one delta in; re-raises a `RequestFailed`'s error."""
        out = _ok(out)
        self._texts[out.index].append(out.new_text)
        self._token_ids[out.index] += out.new_token_ids
        if out.logprobs is not None:
            self._logprobs.setdefault(out.index, []).extend(out.logprobs)
        self.choices.note(out)

    def build(self) -> ChatCompletionResponse:
        if not self.finished:
            raise RuntimeError(f"response {self.response_id} built before its request finished")
        lasts, asked = self.choices.last, self.prompt_token_ids is not None
        choices = [Choice(index=i, message=AssistantMessage(content="".join(self._texts[i])),
                          finish_reason=lasts[i].finish_reason, stop_reason=lasts[i].stop_reason,
                          logprobs=choice_logprobs(self._logprobs[i]) if i in self._logprobs else None,
                          token_ids=self._token_ids[i] if asked else None)
                   for i in sorted(lasts)]
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=choices, usage=self.choices.usage(),
                                      prompt_token_ids=self.prompt_token_ids)


class ChunkBuilder:
    """Turns one request's outputs (each of its `n` choices) into stream chunks; one per streamed response."""

    def __init__(self, response_id: str, model: str, *, n: int = 1, include_usage: bool = False,
                 continuous_usage: bool = False, created: int | None = None,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.response_id, self.model, self.include_usage = response_id, model, include_usage
        self.continuous_usage = continuous_usage  # the usage so far on every chunk too (vLLM's stream option)
        self.created = int(time.time()) if created is None else created
        self.choices = _Choices(n)
        self._sent_role: set[int] = set()
        self._done: set[int] = set()
        self._pending: dict[int, list[TokenLogprob]] = {}  # log-probs of tokens whose text is not sent yet
        # with `return_token_ids` (else None): the prompt's ids, until the first chunk carries them; each
        # choice's token ids not sent yet
        self._prompt_ids = prompt_token_ids
        self._unsent_ids: dict[int, list[int]] | None = None if prompt_token_ids is None else {}

    @property
    def finished(self) -> bool:
        return self.choices.finished

    def chunks(self, out: RequestOutput | RequestFailed) -> list[ChatCompletionChunk]:
        """The chunks for one delta (maybe none); re-raises a `RequestFailed`'s error."""
        out = _ok(out)
        index = out.index
        self.choices.note(out)
        if out.logprobs is not None:
            self._pending.setdefault(index, []).extend(out.logprobs)
        if self._unsent_ids is not None:
            self._unsent_ids.setdefault(index, []).extend(out.new_token_ids)
        if index in self._done or (index in self._sent_role and not out.new_text and not out.finished):
            return []  # NOTE: no empty chunks for steps that produced no text (held back or mid-character)
        opening = self._opening()
        first = index not in self._sent_role
        self._sent_role.add(index)
        if opening and not out.new_text and not out.finished:
            return opening
        delta = Delta(role="assistant" if first else None, content=out.new_text if out.new_text or first else None)
        reason = out.finish_reason if out.finished else None
        if first and not out.new_text and not out.finished:  # the role alone (as vLLM's): its held-back token's
            return [self._chunk([ChunkChoice(index=index, delta=delta)])]  # log-probs and id go with its text
        pending = self._pending.pop(index, None)
        if pending is not None:
            self._pending[index] = []  # NOTE: a held-back token's log-probs go with the next chunk sent
        logprobs = None if pending is None else choice_logprobs(pending)
        token_ids = None if self._unsent_ids is None else self._unsent_ids.pop(index, [])
        choice = ChunkChoice(index=index, delta=delta, finish_reason=reason, logprobs=logprobs, token_ids=token_ids,
                             stop_reason=out.stop_reason)  # NOTE: set on a finished output only (the decoder's)
        chunks = [*opening, self._chunk([choice])]
        if out.finished:
            self._done.add(index)
            if self.include_usage and self.finished:
                chunks.append(self._chunk([], usage=self.choices.usage()))
        return chunks

    def _opening(self) -> list[ChatCompletionChunk]:
        """Before a stream's first content with n > 1: every choice's role chunk, in index order (vLLM's way).

        NOTE: choices reach their first output in any order (their encoder calls or grammars finish when they
        do), and the `openai` client's stream helper finds a choice by its position among those it has seen:
        a first chunk of choice 1 would raise there, one of choice 2 before choice 1's would swap them.
        """
        if self.choices.n == 1 or self._sent_role:
            return []
        self._sent_role.update(range(self.choices.n))
        prompt_ids = self._prompt_ids  # NOTE: on every choice's role chunk, as vLLM sends them
        chunks = [self._chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))], prompt_ids=prompt_ids)
                  for i in range(self.choices.n)]
        self._prompt_ids = None
        return chunks

    def events(self, out: RequestOutput | RequestFailed) -> list[str]:
        """`chunks` as SSE strings, with the closing `[DONE]` after the last."""
        events = [sse(c) for c in self.chunks(out)]
        return [*events, SSE_DONE] if self.finished and events else events

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None,
               prompt_ids: list[int] | None = None) -> ChatCompletionChunk:
        if usage is None and self.continuous_usage and self.choices.last:
            usage = self.choices.usage()
        if prompt_ids is None:  # NOTE: the prompt's ids go on the first chunk only
            prompt_ids, self._prompt_ids = self._prompt_ids, None
        kind = ChatCompletionChunk if self.include_usage else UnaskedUsageChunk
        return kind(id=self.response_id, created=self.created, model=self.model, choices=choices, usage=usage,
                    prompt_token_ids=prompt_ids)
