"""The ingress's own bound on chat requests: past it a 503 `overloaded` with Retry-After and OpenAI's error
body at once; a slot is held until the response has ended, however it ends; other routes are never counted."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from typing import Any

import pytest

from mmserve.api.admission import AdmissionMiddleware, bound

CHAT = "/v1/chat/completions"
_names = itertools.count()


def bounded(app: Any, limit: int | None, paths: frozenset[str] = frozenset({CHAT}), **kwargs: Any) -> Any:
    """`app` behind a bound of its own (a fresh name) at `limit` -> (the middleware, the bound)."""
    name = f"test-{next(_names)}"
    admission = bound(name)
    admission.limit = limit
    for key, value in kwargs.items():
        setattr(admission, key, value)
    return AdmissionMiddleware(app, name, paths), admission


class SlowApp:
    """An ASGI app that answers 200 once `release` is set (a request in flight until then)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.started += 1
        await self.release.wait()
        if scope["path"].endswith("/fail"):
            raise RuntimeError("the handler failed")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(app: Any, path: str, root_path: str = "") -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body or raw bytes) of one request to `app`."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": root_path + path, "root_path": root_path, "headers": []}
    await app(scope, receive, send)
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(body) if headers.get("content-type") == "application/json" else body


async def until(condition: Any) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


def test_past_the_bound_a_503_with_retry_after_and_an_openai_body_at_once() -> None:
    async def scenario() -> None:
        inner, refusals = SlowApp(), []
        app, admission = bounded(inner, 2, on_refused=lambda: refusals.append(1))
        held = [asyncio.create_task(call(app, CHAT)) for _ in range(2)]
        await until(lambda: inner.started == 2)
        status, headers, body = await call(app, CHAT)  # answered while both slots are held
        assert status == 503 and headers["retry-after"] == "1", (status, headers)
        assert body["error"]["type"] == "service_unavailable_error" and body["error"]["code"] == "overloaded"
        assert "2 per ingress replica" in body["error"]["message"]
        assert inner.started == 2 and refusals == [1]
        inner.release.set()
        assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]
        assert admission.in_flight == 0
        assert (await call(app, CHAT))[0] == 200  # the slots are free again

    asyncio.run(scenario())


def test_other_routes_are_not_counted_and_the_route_is_matched_below_the_mount_point() -> None:
    async def scenario() -> None:
        inner = SlowApp()
        app, admission = bounded(inner, 1)
        held = asyncio.create_task(call(app, CHAT, root_path="/tight"))  # Serve's route prefix
        await until(lambda: inner.started == 1)
        assert admission.in_flight == 1
        assert (await call(app, CHAT, root_path="/tight"))[0] == 503
        probe = asyncio.create_task(call(app, "/health"))  # not bounded: it gets through while chat is full
        await until(lambda: inner.started == 2)
        assert admission.in_flight == 1
        inner.release.set()
        assert (await held)[0] == 200 and (await probe)[0] == 200

    asyncio.run(scenario())


@pytest.mark.parametrize("ending", ["failed", "cancelled"])
def test_a_request_that_fails_or_is_cancelled_gives_its_slot_back(ending: str) -> None:
    async def scenario() -> None:
        inner = SlowApp()
        app, admission = bounded(inner, 1, frozenset({CHAT, "/fail"}))
        task = asyncio.create_task(call(app, "/fail" if ending == "failed" else CHAT))
        await until(lambda: inner.started == 1)
        assert admission.full()
        if ending == "failed":
            inner.release.set()
            with pytest.raises(RuntimeError, match="the handler failed"):
                await task
        else:  # e.g. Serve cancels the handler of a client that left
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert admission.in_flight == 0 and not admission.full()

    asyncio.run(scenario())


def test_no_bound_until_configured() -> None:
    async def scenario() -> None:
        inner = SlowApp()
        app, admission = bounded(inner, None)
        held = [asyncio.create_task(call(app, CHAT)) for _ in range(5)]
        await until(lambda: inner.started == 5)  # all five in flight at once: none refused
        assert admission.in_flight == 5
        inner.release.set()
        assert [s for s, _, _ in await asyncio.gather(*held)] == [200] * 5

    asyncio.run(scenario())


def test_a_copy_of_the_middleware_counts_against_the_same_bound() -> None:
    # Serve copies an ingress's app, its middleware's arguments too, before the replica's constructor sets the
    # bound: the copy must find the bound that constructor sets, by name
    async def scenario() -> None:
        inner = SlowApp()
        app, admission = bounded(inner, None)
        served = copy.deepcopy(app)
        served.app = inner  # NOTE: the copy's own app, to watch it; the middleware is what is copied here
        admission.limit = 1  # set after the copy, as Ingress.__init__ does
        held = asyncio.create_task(call(served, CHAT))
        await until(lambda: inner.started == 1)
        assert (await call(app, CHAT))[0] == 503  # the original and the copy share the bound
        inner.release.set()
        assert (await held)[0] == 200 and admission.in_flight == 0

    asyncio.run(scenario())
