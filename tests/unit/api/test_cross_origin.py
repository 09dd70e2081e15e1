"""CORS at the ingress: no origin allowed by default (no header, the app answers as before), and once origins
are set, preflights answered and responses marked for those origins only."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from mmserve.api.cross_origin import CrossOriginMiddleware, origins

_names = itertools.count()


async def plain_app(scope: Any, receive: Any, send: Any) -> None:
    """Answers a POST 200 and anything else 405, as the ingress's routes do."""
    status = 200 if scope["method"] == "POST" else 405
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"answer"})


def ask(allowed: tuple[str, ...], method: str, origin: str, preflight: bool = False) -> tuple[int, dict[str, str]]:
    name = f"test-{next(_names)}"
    origins(name).allowed = allowed
    app = CrossOriginMiddleware(plain_app, name)
    headers = [(b"origin", origin.encode())]
    if preflight:
        headers += [(b"access-control-request-method", b"POST"), (b"access-control-request-headers", b"authorization")]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": "/v1/chat/completions", "root_path": "", "headers": headers,
             "query_string": b""}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], {k.decode(): v.decode() for k, v in sent[0]["headers"]}


def test_no_origin_is_allowed_by_default_and_the_app_answers_untouched():
    status, headers = ask((), "OPTIONS", "https://page.example", preflight=True)
    assert status == 405 and not any(k.startswith("access-control") for k in headers)
    status, headers = ask((), "POST", "https://page.example")
    assert status == 200 and "access-control-allow-origin" not in headers


def test_an_allowed_origin_gets_its_preflight_and_its_answers_marked_and_another_does_not():
    status, headers = ask(("https://chat.example",), "OPTIONS", "https://chat.example", preflight=True)
    assert status == 200 and headers["access-control-allow-origin"] == "https://chat.example"
    assert "POST" in headers["access-control-allow-methods"] and "authorization" in headers[
        "access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in headers
    status, headers = ask(("https://chat.example",), "POST", "https://chat.example")
    assert status == 200 and headers["access-control-allow-origin"] == "https://chat.example"
    # NOTE: the page may read the headers the OpenAI clients decide retries by
    assert {"retry-after", "x-should-retry"} <= set(headers["access-control-expose-headers"].lower().split(", "))
    status, headers = ask(("https://chat.example",), "OPTIONS", "https://other.example", preflight=True)
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers = ask(("*",), "POST", "https://any.example")
    assert status == 200 and headers["access-control-allow-origin"] == "*"
