"""API keys: when the serving process has any, every `/v1` request must carry one (`Authorization: Bearer`).

Owns: an ASGI middleware that refuses a `/v1` request without an accepted key with OpenAI's 401 answer
(`invalid_api_key`, a `WWW-Authenticate: Bearer` header) before its body is read, and the keys' parsing from
the environment variable `MMSERVE_API_KEY` (one key, or several separated by commas: one per client, or an
old and a new one while clients move). Does not own the other routes: `/health` (probes) and `/metrics`
(scrapers) are never asked for a key, as vLLM's `--api-key` leaves them.

NOTE: found by name, as the admission bound is (mmserve/api/admission.py: Serve copies an ingress's app and
its middleware's arguments into each replica, so an object given to `add_middleware` is not the replica's).
NOTE: from the environment, not the app's arguments: Serve shows an app's arguments to anyone who can read its
config (the dashboard, `serve status`), and a Kubernetes Secret reaches a pod as an environment variable.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from mmserve.api.admission import ASGIApp, Receive, Scope, Send, route_path, send_json
from mmserve.api.errors import ErrorInfo, ErrorResponse

ENV = "MMSERVE_API_KEY"
GUARDED_PREFIX = "/v1"  # the OpenAI routes; health and metrics stay open


@dataclass
class ApiKeys:
    accepted: tuple[bytes, ...] = ()  # keys a request may carry; none = every request is served

    def admits(self, authorization: bytes | None) -> bool:
        """Whether an `Authorization` header value carries an accepted key (compared in constant time)."""
        if not self.accepted:
            return True
        scheme, _, key = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        key = key.strip()
        return any([hmac.compare_digest(key, accepted) for accepted in self.accepted])  # NOTE: all compared


def parse_keys(value: str | None) -> tuple[bytes, ...]:
    """The keys in `MMSERVE_API_KEY`'s value: comma-separated, blanks around each dropped; none if unset."""
    return tuple(key.strip().encode() for key in (value or "").split(",") if key.strip())


_KEYS: dict[str, ApiKeys] = {}  # this process's keys, by name


def api_keys(name: str) -> ApiKeys:
    """This process's keys called `name` (none, so no check, until set)."""
    return _KEYS.setdefault(name, ApiKeys())


class ApiKeyMiddleware:
    """ASGI middleware; on FastAPI: `app.add_middleware(ApiKeyMiddleware, name=...)` after the admission bound
    (outside it: a request without a key takes no slot) and before CORS (inside it: a browser's preflight carries
    no key), with the keys set in the serving process through `api_keys(name)`."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app, self.name = app, name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = api_keys(self.name)
        if scope["type"] != "http" or not keys.accepted or not route_path(scope).startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope.get("headers", []) if k.lower() == b"authorization"), None)
        if keys.admits(authorization):
            await self.app(scope, receive, send)
            return
        info = ErrorInfo(message="a valid API key is required: send it as `Authorization: Bearer <key>`",
                         type="invalid_request_error", code="invalid_api_key")
        await send_json(send, 401, ErrorResponse(error=info).model_dump(), {"WWW-Authenticate": "Bearer"})
