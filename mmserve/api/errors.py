"""OpenAI-shaped errors of the HTTP edge: the exceptions only the API raises and every error body.

Owns: mapping any exception to (HTTP status, OpenAI error body) — client faults keep their message and
the offending field (`param`), server faults never leak theirs — and pydantic validation errors to a 400
naming the field. Does not own: the request schemas (`protocol.py`) nor the engine's errors
(`mmserve.errors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from mmserve.errors import (
    BodyTimeoutError,
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    UnsupportedMediaTypeError,
)

# The tags of protocol.py's discriminated unions: pydantic puts them in error locations; we drop them.
UNION_TAGS = frozenset({"text_part", "image_part", "string", "parts"})


class UnsupportedParameterError(InvalidRequestError):
    """An OpenAI parameter we accept only at its default (tools unless tool_choice is none, echo, beam search,
    ...: mmserve/api/unserved.py)."""

    code = "unsupported_parameter"


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve."""

    code = "model_not_found"
    status = 404


E = TypeVar("E", bound=InvalidRequestError)


def with_param(exc: E, param: str | None) -> E:
    """Attach the offending request field; `error_body` reports it as OpenAI's `param`."""
    exc.param = param
    return exc


class ErrorInfo(BaseModel):
    message: str
    type: str  # "invalid_request_error" (4xx), "service_unavailable_error" (503/504) or "server_error" (500: OpenAI's)
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body). Client faults keep their message; server faults never leak one."""
    if isinstance(exc, ValidationError):  # NOTE: before InvalidRequestError; both are ValueErrors
        return validation_error_body(exc.errors())
    if isinstance(exc, InvalidRequestError):
        info = ErrorInfo(message=str(exc), type="invalid_request_error", code=exc.code,
                         param=getattr(exc, "param", None))
        return exc.status, ErrorResponse(error=info).model_dump()
    if isinstance(exc, (OverloadedError, DeadlineExceededError)):  # ours, but said: the client may retry
        info = ErrorInfo(message=str(exc), type="service_unavailable_error", code=exc.code)
        return exc.status, ErrorResponse(error=info).model_dump()
    info = ErrorInfo(message="internal server error", type="server_error", code="internal_error")
    return 500, ErrorResponse(error=info).model_dump()


def route_error_body(status: int, detail: str, method: str, path: str) -> dict[str, Any]:
    """OpenAI's error body for an answer of the HTTP framework itself (an unknown path: 404, a method the path
    does not take: 405), e.g. "Not Found (POST /v1/completions)"."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    info = ErrorInfo(message=f"{detail} ({method} {path})", type="invalid_request_error", code=code)
    return ErrorResponse(error=info).model_dump()


def error_headers(exc: BaseException) -> dict[str, str]:
    """HTTP headers an error answer carries: `Retry-After` when the service is overloaded; `x-should-retry:
    false` past a request's deadline.

    NOTE: the official `openai` client sends a 5xx again by itself (twice by default) unless told not to: a
    request that already took the whole `ingress.request_timeout_s` would take it three times over.
    """
    if isinstance(exc, OverloadedError):
        return {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, (DeadlineExceededError, BodyTimeoutError)):  # NOTE: the client retries a 408 too
        return {"x-should-retry": "false"}
    if isinstance(exc, UnsupportedMediaTypeError) and exc.encoding:
        return {"Accept-Encoding": "identity"}  # NOTE: RFC 7694: the encodings a 415 for one would take
    return {}


def validation_error_body(errors: Sequence[Any]) -> tuple[int, dict[str, Any]]:
    """400 body for pydantic's `ValidationError.errors()` (or FastAPI's RequestValidationError.errors())."""
    if not errors:
        return 400, ErrorResponse(error=ErrorInfo(message="invalid request", type="invalid_request_error",
                                                  code="invalid_request")).model_dump()
    first = errors[0]
    param = _loc(first.get("loc", ()))
    message = f"{param}: {_error_message(first)}" if param else _error_message(first)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    info = ErrorInfo(message=message, type="invalid_request_error", code="invalid_request", param=param or None)
    return 400, ErrorResponse(error=info).model_dump()


def _loc(loc: Sequence[Any]) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; union tags dropped."""
    out = ""
    for i, part in enumerate(loc):
        if (i == 0 and part == "body") or part in UNION_TAGS:
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _error_message(error: Any) -> str:
    ctx = error.get("ctx") or {}
    if error.get("type") == "value_error" and "error" in ctx:
        return str(ctx["error"])  # drop pydantic's "Value error, " prefix
    return str(error.get("msg", "invalid value"))
