"""How many chat requests one ingress replica serves at once; past that, an OpenAI-shaped 503 at once.

Owns: an ASGI middleware that counts the requests on the routes it bounds, from their arrival until their
response has ended (a stream: its last event, or its client gone), and refuses one that arrives past the
bound with `503 overloaded`, `Retry-After` and OpenAI's error body, before its body is read. Does not own:
where the bound comes from (the app's arguments), the bounds of the stages behind the ingress (Serve's
queues, the decoder's waiting queue), nor the other routes (health, metrics, models: never counted).

NOTE: why not Serve's own bound on the ingress (`max_ongoing_requests`, then `max_queued_requests`): Serve
answers its refusals itself, at its proxy or (behind HAProxy) in the replica, with a text body and no
`Retry-After`, which clients written for OpenAI do not read as an overload. The ingress's deployment gets a
Serve bound above this one (deployments/stage_args.py), so that the refusals are these.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from mmserve.api.errors import error_body, error_headers
from mmserve.errors import OverloadedError

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass
class Admission:
    """The bound and its count, for one replica (one event loop: no lock)."""

    limit: int | None = None  # requests served at once on the bounded routes; None = no bound (not configured)
    in_flight: int = 0  # requests on the bounded routes now (requests)
    on_refused: Callable[[], None] = field(default=lambda: None)  # told of each refusal (the request metrics)

    def full(self) -> bool:
        return self.limit is not None and self.in_flight >= self.limit


_BOUNDS: dict[str, Admission] = {}  # this process's bounds, by name


def bound(name: str) -> Admission:
    """This process's bound called `name` (unbounded until its `limit` is set).

    NOTE: found by name in this module, not handed to the middleware as an object: Serve copies an ingress's
    FastAPI app (its middleware's arguments too) when the deployment is declared and again into each
    replica, so an object given to `add_middleware` is not the one the replica's constructor would set.
    """
    return _BOUNDS.setdefault(name, Admission())


class AdmissionMiddleware:
    """ASGI middleware; on FastAPI: `app.add_middleware(AdmissionMiddleware, name=..., paths=...)`, and the
    bound set in the serving process through `bound(name)`."""

    def __init__(self, app: ASGIApp, name: str, paths: frozenset[str]) -> None:
        self.app, self.name, self.paths = app, name, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        admission = bound(self.name)
        if admission.full():
            admission.on_refused()
            await _refuse(send, admission.limit)
            return
        admission.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:  # NOTE: a response that failed, a client gone and a cancelled handler end here too
            admission.in_flight -= 1


def route_path(scope: Scope) -> str:
    """The request's path below the app's mount point (`root_path`: Serve's route prefix), as routes see it."""
    path, root = scope["path"], scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    # NOTE: at a segment's end only, as Starlette routes it: under "/v", "/v1/models" is "/v1/models"
    return path[len(root):] if len(path) == len(root) or path[len(root)] == "/" else path


async def _refuse(send: Send, limit: int | None) -> None:
    """Answer 503 overloaded with Retry-After and OpenAI's error body (the request's body is left unread)."""
    exc = OverloadedError(f"this server is serving as many requests as it takes ({limit} per ingress "
                          f"replica); retry later")
    status, body = error_body(exc)
    await send_json(send, status, body, error_headers(exc))


async def send_json(send: Send, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    """Answer `status` with `body` as JSON and `headers`, from a middleware."""
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
