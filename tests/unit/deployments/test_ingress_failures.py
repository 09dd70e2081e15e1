"""The ingress's endings: a stream whose client leaves before its first event still cleans up (its
generator never runs then), and a body whose client leaves is a ClientGone, not a server fault."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, MutableMapping
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import TaskCancelledError

from deployments.ingress_failures import ClientGone, GuardedStream, read_body
from mmserve.api.deadline import Deadline
from mmserve.api.errors import error_body, error_headers


def sse(events: list[str], cleaned: list[str]) -> Callable[[Callable[[], None]], AsyncIterator[str]]:
    """A body as the ingress's `_sse` makes it: `start()` first, its own cleanup in `finally`."""
    async def body(start: Callable[[], None]) -> AsyncIterator[str]:
        start()
        try:
            for event in events:
                yield event
        finally:
            cleaned.append("body")

    return body


def test_a_client_gone_before_the_first_event_is_cleaned_up_by_the_response() -> None:
    async def scenario() -> list[str]:
        cleaned: list[str] = []
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}  # the client has left

        async def send(message: MutableMapping[str, Any]) -> None:
            await never.wait()  # a slow socket: the disconnect wins before the body's first step

        response = GuardedStream(sse(["data: 1\n\n"], cleaned), unstarted=lambda: cleaned.append("unstarted"))
        await response({"type": "http"}, receive, send)
        return cleaned

    assert asyncio.run(scenario()) == ["unstarted"]  # the body's own `finally` never ran: it never started


def test_a_stream_that_ran_cleans_up_once_by_its_body() -> None:
    async def scenario() -> tuple[list[str], list[MutableMapping[str, Any]]]:
        cleaned: list[str] = []
        sent: list[MutableMapping[str, Any]] = []

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the client stays
            return {}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        response = GuardedStream(sse(["data: 1\n\n", "data: 2\n\n"], cleaned),
                                 unstarted=lambda: cleaned.append("unstarted"))
        await response({"type": "http"}, receive, send)
        return cleaned, sent

    cleaned, sent = asyncio.run(scenario())
    assert cleaned == ["body"]
    assert b"".join(m.get("body", b"") for m in sent) == b"data: 1\n\ndata: 2\n\n"


def test_a_stream_whose_socket_write_fails_mid_stream_is_cleaned_up_by_the_time_the_response_ends() -> None:
    """Starlette turns a failed write into ClientDisconnect and leaves the body at its `yield`: the response
    closes it, so its cleanup (aborting the decoder's stream) does not wait for the garbage collector."""
    from starlette.requests import ClientDisconnect

    async def scenario() -> list[str]:
        cleaned: list[str] = []
        body = sse(["data: 1\n\n", "data: 2\n\n"], cleaned)
        kept: list[Any] = []  # NOTE: holds the generator, as a reference cycle would

        def made(start: Callable[[], None]) -> AsyncIterator[str]:
            kept.append(body(start))
            return kept[-1]

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message.get("body"):
                raise OSError("connection reset")

        response = GuardedStream(made, unstarted=lambda: cleaned.append("unstarted"))
        with pytest.raises((ClientDisconnect, OSError)):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return list(cleaned)  # NOTE: now, before asyncio.run's end closes every generator left open

    assert asyncio.run(scenario()) == ["body"]


@pytest.mark.parametrize("left", [TaskCancelledError(), "starlette"])
def test_a_body_whose_client_left_is_client_gone(left: Any) -> None:
    from starlette.requests import ClientDisconnect, Request

    error = ClientDisconnect() if left == "starlette" else left

    async def receive() -> dict[str, Any]:
        raise error  # Serve's receive proxy raises its cancel; Starlette raises on http.disconnect itself

    async def scenario() -> None:
        await read_body(Request({"type": "http", "method": "POST", "headers": JSON}, receive), 1 << 20,
                        Deadline(60))

    with pytest.raises(ClientGone, match=type(error).__name__):
        asyncio.run(scenario())


JSON = [(b"content-type", b"application/json")]


@pytest.mark.parametrize(("headers", "says"), [
    ([], "no Content-Type"), ([(b"content-type", b"text/plain")], "'text/plain'"),
    ([(b"content-type", b"application/x-www-form-urlencoded")], "x-www-form-urlencoded"),
    ([*JSON, (b"content-encoding", b"gzip")], "Content-Encoding 'gzip'"),
])
def test_a_body_not_sent_as_json_is_a_415_read_and_dropped_first(headers: list, says: str) -> None:
    """What a web page may POST without a CORS preflight (text/plain, a form, no type) is not read as JSON, nor a
    compressed body as bytes; what was sent is drained first, so the client sees the 415, not a reset."""
    from starlette.requests import Request

    from mmserve.errors import UnsupportedMediaTypeError

    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    async def scenario() -> None:
        await read_body(Request({"type": "http", "method": "POST", "headers": headers}, receive), 1 << 20,
                        Deadline(60))

    with pytest.raises(UnsupportedMediaTypeError, match=says) as refused:
        asyncio.run(scenario())
    assert sent == []  # drained
    status, _ = error_body(refused.value)
    assert status == 415
    assert error_headers(refused.value) == ({"Accept-Encoding": "identity"} if "gzip" in says else {})


@pytest.mark.parametrize("media", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                   "application/vnd.api+json"])
def test_json_media_types_are_read(media: str) -> None:
    from mmserve.api.body import check_media

    check_media(media, None)
    check_media(media, "identity")


def test_a_body_that_does_not_arrive_by_the_deadline_is_a_408() -> None:
    """The client's slowness, not the server's: 408, not the 504 of a request that ran too long."""
    from starlette.requests import Request

    from mmserve.errors import BodyTimeoutError

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)  # a client that never sends the rest
        return {"type": "http.disconnect"}

    async def scenario() -> None:
        await read_body(Request({"type": "http", "method": "POST", "headers": JSON}, receive), 1 << 20,
                        Deadline(0.05))

    with pytest.raises(BodyTimeoutError, match=r"did not arrive whole within 0\.05 s") as late:
        asyncio.run(scenario())
    assert error_body(late.value)[0] == 408
    assert error_headers(late.value) == {"x-should-retry": "false"}  # the openai client would send it twice more


def test_a_stream_the_decoder_cut_short_ends_with_an_error_event_and_counts_as_a_server_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """The Decoder's stream ended (None) before every choice finished: an error event, no `[DONE]`, as the
    non-streamed path answers a 500; the log says what the fault was (the client is told nothing of it)."""
    from deployments.ingress import Ingress
    from mmserve.api.stream import ChunkBuilder
    from mmserve.messages import RequestOutput

    counted: list[str] = []

    async def ended(outputs: Any, deadline: Any) -> None:
        return None

    # NOTE: no replica, only what `_sse` reads of one: its next output and counting
    ingress = SimpleNamespace(_next=ended, _done=lambda status, started, *rest: counted.append(status))
    sse_of = Ingress.func_or_class._sse  # type: ignore[attr-defined]  # the class Serve's decorator wraps
    first = RequestOutput("r", [5], "Hi", False, None, 3, 1)

    async def scenario() -> list[str]:
        events = sse_of(ingress, ChunkBuilder("r", "m"), first, object(), (0.0, 0.0), None, lambda: None)
        return [e async for e in events]

    with caplog.at_level(logging.ERROR, logger="deployments.ingress_failures"):
        events = asyncio.run(scenario())
    assert '"content":"Hi"' in events[0] and '"error"' in events[-1] and all("[DONE]" not in e for e in events)
    assert counted == ["server_error"]
    assert [str(r.exc_info[1]) for r in caplog.records if r.exc_info] == [
        "the decoder's stream of r ended before its answer"]


def test_failures_the_client_sees_as_the_services_are_logged_by_request_id(caplog: pytest.LogCaptureFixture) -> None:
    """A server fault (500) with its traceback, a replica lost past the retries (503) as a warning, each naming the
    response's id; a client's own error (400) and load shed (503 overloaded) not at all."""
    from deployments.ingress_failures import error_response, log_fault
    from mmserve.errors import InvalidRequestError, OverloadedError, ReplicaLostError

    caplog.set_level(logging.INFO, logger="deployments.ingress_failures")
    log_fault(RuntimeError("boom"), "chatcmpl-a")
    assert error_response(ReplicaLostError("the Decoder replica died"), "chatcmpl-b").status_code == 503
    log_fault(InvalidRequestError("bad"), "chatcmpl-c")
    log_fault(OverloadedError("full"), "chatcmpl-d")
    assert [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        ("ERROR", "request chatcmpl-a failed with a server fault", True),
        ("WARNING", "request chatcmpl-b failed: the Decoder replica died", False)]
