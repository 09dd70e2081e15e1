"""How the ingress answers and counts a request that fails or whose client leaves before its answer.

Owns: a failure's HTTP answer (OpenAI-shaped, the framework's own 404 and 405 too; a server fault is logged and
never told) and its status in the
request metrics, what a stage's `RequestFailed` value means, reading a body whose client may leave
(`ClientGone`), and a stream that hears of a client gone before its first event (`GuardedStream`). Does not
own: the error bodies themselves (mmserve.api.errors), bounding and decoding a body (mmserve.api.body), nor
which failures are retried (retry.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from deployments.retry import unwrapped
from mmserve.api.body import check_declared_size, check_media, drain, read_bounded
from mmserve.api.deadline import Deadline
from mmserve.api.errors import error_body, error_headers, route_error_body
from mmserve.errors import (
    BodyTimeoutError,
    DeadlineExceededError,
    OverloadedError,
    PayloadTooLargeError,
    ReplicaLostError,
    UnsupportedMediaTypeError,
)
from mmserve.messages import RequestFailed
from mmserve.runtime.ingress_metrics import RequestStatus

log = logging.getLogger(__name__)
# How a client that left while its body was read shows: Starlette's own error, or Serve's when its proxy
# cancels the replica's fetch of the body from it
CLIENT_LEFT = (ClientDisconnect, TaskCancelledError)
CLIENT_CLOSED_REQUEST = 499  # the status access logs give a request whose client left first (nginx's)


class ClientGone(Exception):
    """The client left before its request was read; nobody is left to answer (counted as aborted)."""


async def route_error(request: Request, exc: Exception) -> JSONResponse:
    """The framework's own answers (an unknown path, a wrong method) in OpenAI's error shape, not FastAPI's."""
    assert isinstance(exc, StarletteHTTPException)
    body = route_error_body(exc.status_code, str(exc.detail), request.method, request.url.path)
    headers = dict(exc.headers or {})
    allowed = [m.strip() for m in headers.get("Allow", "").split(",") if m.strip()]
    if allowed and "HEAD" not in allowed and _takes_head(request):  # NOTE: RFC 9110: every method the path takes
        headers["Allow"] = ", ".join([*allowed, "HEAD"])  # (the router names its first route's alone)
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def _takes_head(request: Request) -> bool:
    """Whether a route of the app answers HEAD at the request's path."""
    scope = {**request.scope, "method": "HEAD"}
    return any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes)


async def read_body(request: Request, max_bytes: int, deadline: Deadline) -> bytes:
    """The request's JSON body, up to `max_bytes`, within `deadline` (mmserve.api.body: UnsupportedMediaTypeError
    for a body not sent as JSON, PayloadTooLargeError past the size, each once what is left of a body not far past
    the size has been read and dropped); ClientGone if its client leaves meanwhile, BodyTimeoutError (408) if it
    has not sent it all by the deadline."""
    declared, chunks = request.headers.get("content-length"), request.stream()
    try:
        try:
            check_media(request.headers.get("content-type"), request.headers.get("content-encoding"))
            check_declared_size(declared, max_bytes)
            return await deadline.wait(read_bounded(chunks, max_bytes))
        except (PayloadTooLargeError, UnsupportedMediaTypeError) as exc:
            await drain(chunks, declared, max_bytes if isinstance(exc, PayloadTooLargeError) else 0)
            raise
    except CLIENT_LEFT as exc:
        raise ClientGone(f"the client left while its body was read ({type(exc).__name__})") from None
    except DeadlineExceededError:  # NOTE: the client's slowness, not the server's: a 408, not a 504
        raise BodyTimeoutError(f"the request body did not arrive whole within {deadline.timeout_s:g} s") from None


def failure_status(exc: BaseException) -> RequestStatus:
    """How the request metrics count a request that failed with `exc`: by the HTTP status it gets (a 503 of a
    full queue apart, as load shed), whether the failure came before the first token or after (then reported
    in-band)."""
    exc = unwrapped(exc)
    if isinstance(exc, OverloadedError) and not isinstance(exc, ReplicaLostError):  # load shed, not a fault
        return "overloaded"
    return "client_error" if error_body(exc)[0] < 500 else "server_error"


def raise_failed(message: Any) -> Any:
    """`message`, unless a stage answered with the client's fault as a RequestFailed: then raise it."""
    if isinstance(message, RequestFailed):
        raise message.error
    return message


def error_response(exc: BaseException, request_id: str | None = None) -> JSONResponse:
    """The answer to a request (named `request_id` where it has one yet) that failed with `exc`, before its
    response began."""
    log_fault(exc, request_id)
    exc = unwrapped(exc)
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status, headers=error_headers(exc))


def log_fault(exc: BaseException, request_id: str | None = None) -> None:
    """Log a failure that is the service's, not the client's, by the request's id (the response's `id`).

    NOTE: the client is told nothing of a server fault (a 500, or a stream's error event); the log says what
    it was. A replica lost past the retries (a 503 `replica_lost`) is logged too: the client saw a failure."""
    inner = unwrapped(exc)
    name = f"request {request_id}" if request_id else "a request"
    if isinstance(inner, ReplicaLostError):
        log.warning("%s failed: %s", name, inner)
    elif error_body(inner)[0] == 500:
        log.error("%s failed with a server fault", name, exc_info=exc)


class GuardedStream(StreamingResponse):
    """A streamed answer whose body is made by `body(start)` (which calls `start()` on its first step) and
    that calls `unstarted()` if that step never came.

    NOTE: a body's own cleanup (its generator's `finally`: cancel the decoder's stream, count the request)
    runs only once the generator has started; a client that leaves between the handler's answer and the
    response's first event cancels the response first, and the generator is then never run at all. One that
    started is closed when the response ends however it ends (a failed socket write leaves it at its `yield`),
    so its cleanup runs then, not when the garbage collector finds it.
    """

    def __init__(self, body: Callable[[Callable[[], None]], AsyncIterator[str]], unstarted: Callable[[], None],
                 **kwargs: Any) -> None:
        self._started = False
        self._unstarted = unstarted
        super().__init__(body(self._start), **kwargs)

    def _start(self) -> None:
        self._started = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._started:
                self._unstarted()
            elif isinstance(self.body_iterator, AsyncGenerator):
                await self.body_iterator.aclose()  # a no-op once it ran to its end
