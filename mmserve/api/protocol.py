"""The OpenAI-compatible HTTP schemas of `/v1/chat/completions` and `/v1/models` (and `/v1/models/{model}`).

Owns: the pydantic models at the HTTP edge (nothing past `ChatCompletionRequest.to_chat_request` sees
pydantic), OpenAI's defaults and aliases, the rejection of OpenAI features we do not serve, and the check
that a request names the served model. Does not own: the error bodies (`errors.py`), deep message checks
(reserved tokens, image count, chat template: `mmserve.preprocess.preprocessor`), assembling responses from
engine outputs (`stream.py`), nor the HTTP server.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from mmserve.api.errors import ModelNotFoundError, with_param
from mmserve.api.logprobs import ChoiceLogprobs
from mmserve.api.structured import StructuredFields
from mmserve.api.template_fields import TemplateFields
from mmserve.api.unserved import UNSERVED, check_served, log_unknown
from mmserve.api.vllm_fields import VllmFields
from mmserve.errors import InvalidRequestError, InvalidSamplingError
from mmserve.messages import MAX_TOKEN_ID_ENTRIES, ChatRequest, SamplingDefaults, SamplingParams

_T = TypeVar("_T")

# --- request ------------------------------------------------------------------------------------


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")  # NOTE: unknown fields are ignored, as most OpenAI servers do


class ImageURL(_Lenient):
    url: str
    detail: Literal["auto", "low", "high", "original"] | None = None  # accepted, ignored: Gemma 3 has one resolution


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value  # NOTE: as mmserve.preprocess.preprocessor accepts


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"text": "text_part", "image_url": "image_part"}.get(kind) if isinstance(kind, str) else None


def _content_tag(value: Any) -> str | None:
    return "string" if isinstance(value, str) else "parts" if isinstance(value, list) else None


# NOTE: callable discriminators so that a bad value yields one error under its own name, not one per
# union member; the tags are dropped again from error locations (`protocol_errors.UNION_TAGS`).
ContentPart = Annotated[
    Annotated[TextPart, Tag("text_part")] | Annotated[ImagePart, Tag("image_part")],
    Discriminator(_part_tag, custom_error_type="invalid_content_part",
                  custom_error_message="a content part must have type 'text' or 'image_url'"),
]
Content = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(_content_tag, custom_error_type="invalid_content",
                  custom_error_message="content must be a string or a list of content parts"),
]


class Message(_Lenient):
    role: Literal["system", "user", "assistant", "developer"]  # NOTE: "developer" is served as "system"
    content: Content
    # NOTE: refused when set (tools are not served): dropped, the model would answer a history without the calls
    tool_calls: list[Any] | None = None
    function_call: Any = None  # the same, in OpenAI's older spelling

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _no_tool_calls(cls, value: Any, info: ValidationInfo) -> None:
        if value:
            raise ValueError(f"tool calls are not served: an assistant message may not carry {info.field_name}")
        return None


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, the usage so far on every chunk


def _one_or_many(value: Any) -> Any:
    if value is not None and not isinstance(value, str | list):
        raise ValueError("must be a string or a list of strings")
    return [value] if isinstance(value, str) else value


class ChatCompletionRequest(StructuredFields, TemplateFields):  # NOTE: response_format, guided_*, template options
    # NOTE: unknown fields are kept (in `model_extra`) so that unserved ones are refused and the rest logged
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    stream: bool | None = False  # OpenAI allows null
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None  # wins over max_tokens when both are set
    temperature: float | None = None  # None = 1.0, OpenAI's default
    top_p: float | None = None
    top_k: int | None = None  # extension; 0 or -1 = off
    min_p: float | None = None  # extension (vLLM's): tokens less likely than min_p x the likeliest are dropped
    seed: int | None = None
    stop: Annotated[list[str] | None, BeforeValidator(_one_or_many)] = None  # a string or a list
    ignore_eos: bool = False  # extension
    include_stop_str_in_output: bool = False  # extension (vLLM's): the text keeps what stopped it
    skip_special_tokens: bool = True  # extension (vLLM's)
    mm_processor_kwargs: dict[str, Any] | None = None  # extension, e.g. {"do_pan_and_scan": true}
    cache_salt: str | None = Field(None, min_length=1)  # extension (vLLM's): other salts share no cache
    repetition_penalty: float | None = None  # extension (vLLM's); None = 1.0, off
    min_tokens: int | None = None  # extension (vLLM's): no end before this many tokens
    stop_token_ids: list[int] | None = None  # extension (vLLM's): token ids that end generation too
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    allowed_token_ids: list[int] | None = None  # extension (vLLM's): the only tokens the output may hold
    bad_words: list[str] | None = None  # extension (vLLM's): words the output may not complete
    logprobs: bool | None = None
    top_logprobs: int | None = None  # alternatives per token (0-20); needs logprobs
    n: int | None = None  # choices (1-16); the prompt is computed once
    return_token_ids: bool | None = None  # extension (vLLM's): the prompt's and each choice's token ids too
    # Accepted only at their default (`unserved.UNSERVED`); declared so their types are checked.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)

    def to_chat_request(self, request_id: str, default_max_tokens: int,
                        defaults: SamplingDefaults | None = None) -> ChatRequest:
        """The engine's request, its unset sampling fields from `defaults` (the served model's; None: OpenAI's);
        raises InvalidRequestError subclasses whose `param` names the field."""
        self._check_supported()
        sampling = self._sampling(default_max_tokens, defaults or SamplingDefaults())
        messages = [_message_dict(m) for m in self.messages]
        asked = "max_completion_tokens" if self.max_completion_tokens is not None else \
            "max_tokens" if self.max_tokens is not None else None
        return ChatRequest(request_id, messages, sampling, dict(self.mm_processor_kwargs or {}), self.cache_salt,
                           max_tokens_asked=asked, template=self.template_options())

    def _check_supported(self) -> None:
        extra = self.model_extra or {}
        check_served({**{name: getattr(self, name) for name in UNSERVED if name in type(self).model_fields}, **extra})
        log_unknown(extra)
        if self.top_logprobs and not self.logprobs:  # NOTE: 0 alone is no ask (vLLM's rule; some clients send it)
            raise with_param(InvalidRequestError("top_logprobs requires logprobs: true"), "top_logprobs")
        if self.stream_options is not None and not self.stream:
            raise with_param(InvalidRequestError("stream_options is only allowed when stream is true"),
                             "stream_options")

    def _sampling(self, default_max_tokens: int, defaults: SamplingDefaults) -> SamplingParams:
        max_param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        max_tokens = next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None),
                          default_max_tokens)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_first(self.temperature, defaults.temperature, 1.0),
            top_p=_first(self.top_p, defaults.top_p, 1.0),
            top_k=0 if self.top_k == -1 else _first(self.top_k, defaults.top_k, 0),  # NOTE: -1 is vLLM's "off"
            min_p=_first(self.min_p, defaults.min_p, 0.0),
            seed=None if self.seed == -1 else self.seed,  # NOTE: -1 is vLLM's "no seed" (a fresh draw each time)
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=_first(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            logit_bias=_logit_bias(self.logit_bias),
            # NOTE: each id once (a list may repeat them): the decoder keeps recent requests' lists as tensors
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(dict.fromkeys(self.allowed_token_ids)),
            bad_words=tuple(self.bad_words or ()),
            min_tokens=self.min_tokens or 0,
            stop_token_ids=tuple(dict.fromkeys(self.stop_token_ids or ())),  # each once
            structured=self.structured(),
            n=1 if self.n is None else self.n,
            final_only=not self.stream,
        )
        try:
            params.validate()
        except InvalidSamplingError as exc:
            field = str(exc).split(" ", 1)[0]  # NOTE: SamplingParams' messages start with the field name
            if field == "max_tokens":  # named as the request named it
                field, exc = max_param, InvalidSamplingError(str(exc).replace("max_tokens", max_param, 1))
            raise with_param(exc, field) from None
        return params


def _first(*values: _T | None) -> _T:
    """The first value that is set: the request's, else the served model's default, else OpenAI's (the last)."""
    return next(v for v in values if v is not None)


_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")  # a logit_bias key: a token id, in a 64-bit integer


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as (id, bias) pairs; a key that is no token id is a 400."""
    if len(bias or {}) > MAX_TOKEN_ID_ENTRIES:  # NOTE: before the per-key work, on the event loop
        raise with_param(InvalidSamplingError(f"logit_bias may hold {MAX_TOKEN_ID_ENTRIES} token ids at most, got "
                                              f"{len(bias or {})}"), "logit_bias")
    pairs = []
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):  # NOTE: ASCII digits only (str.isdigit takes "²", which int() refuses)
            raise with_param(InvalidSamplingError(f"logit_bias keys must be token ids, got {key[:40]!r}"),
                             "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(dict(pairs).items())  # NOTE: "7" and "007" name one token: the later bias stands, as in a dict


def _message_dict(message: Message) -> dict[str, Any]:
    """Plain OpenAI-shaped dict for `ChatRequest.messages`; unknown keys and `detail: null` dropped."""
    return message.model_dump(exclude_none=True)  # NOTE: a "developer" message is served as "system" (chat_messages)


# --- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int  # image tokens included
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(VllmFields):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None  # "stop" | "length" | "abort"; NOTE: "abort" is vLLM's, not OpenAI's
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended a "stop"; else null
    logprobs: ChoiceLogprobs | None = None  # when the request set `logprobs`
    token_ids: list[int] | None = None  # the output's token ids, with vLLM's `return_token_ids`


class ChatCompletionResponse(VllmFields):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # the prompt's (images expanded), with `return_token_ids`


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mmserve"
    max_model_len: int | None = None  # extension, as vLLM reports it


def check_model(asked: str | None, served: str, *, empty_is_any: bool = True) -> None:
    """A request or lookup naming another model than the one served: 404 model_not_found (None, or "" where
    `empty_is_any`: any, as vLLM takes a chat body's)."""
    if asked != served and asked is not None and (asked or not empty_is_any):
        raise ModelNotFoundError(f"model {asked!r} is not served here; try {served!r}")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
