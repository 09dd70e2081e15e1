"""Which web origins a browser app may call the API from (CORS), set per serving process.

Owns: an ASGI middleware that, once the serving process has named the allowed origins, answers browsers'
preflight requests and adds the `Access-Control-Allow-*` headers through Starlette's own `CORSMiddleware`;
with no origin named it passes everything through untouched (no CORS headers: a browser on another origin
is refused by the browser itself). Does not own where the origins come from (the app's arguments).

NOTE: found by name, as the admission bound is (mmserve/api/admission.py: Serve copies an ingress's app and
its middleware's arguments into each replica, so an object given to `add_middleware` is not the replica's).
NOTE: none by default, where vLLM allows every origin: a server on a private network would otherwise answer
any web page its users open. Credentials (cookies) are never allowed: clients send an API key header.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware

from mmserve.api.admission import ASGIApp, Receive, Scope, Send


@dataclass
class Origins:
    allowed: tuple[str, ...] = ()  # origins a browser app may call from, e.g. "https://app.example.com"; "*" any


# NOTE: a browser hides every other header from the page: the OpenAI clients read these to decide on a retry
EXPOSED = ("Retry-After", "x-should-retry")
_ORIGINS: dict[str, Origins] = {}  # this process's settings, by name


def origins(name: str) -> Origins:
    """This process's setting called `name` (no origin allowed until set)."""
    return _ORIGINS.setdefault(name, Origins())


class CrossOriginMiddleware:
    """ASGI middleware; on FastAPI: `app.add_middleware(CrossOriginMiddleware, name=...)` as the last one added
    (the outermost: a preflight is answered before any other middleware counts it), and the origins set in the
    serving process through `origins(name)`."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app, self.name = app, name
        self._cors: tuple[tuple[str, ...], CORSMiddleware] | None = None  # built for the origins set last

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        allowed = origins(self.name).allowed
        if not allowed or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._cors is None or self._cors[0] != allowed:
            self._cors = allowed, CORSMiddleware(self.app, allow_origins=list(allowed), allow_methods=["*"],
                                                 allow_headers=["*"], allow_credentials=False,
                                                 expose_headers=list(EXPOSED))
        await self._cors[1](scope, receive, send)
