"""The HTTP edge's body reading: size bound (413) and JSON decoding (400 naming what is wrong); the error
bodies and headers of overload (503 + Retry-After) and deadlines (504)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import pytest

from mmserve.api.body import check_declared_size, drain, parse_json, read_bounded
from mmserve.api.errors import error_body, error_headers
from mmserve.errors import DeadlineExceededError, InvalidRequestError, OverloadedError, PayloadTooLargeError


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def test_a_body_over_the_bound_is_refused_by_header_or_as_it_arrives() -> None:
    check_declared_size("100", 100)
    check_declared_size(None, 100)  # chunked: counted as it arrives
    check_declared_size("not a number", 100)  # the HTTP server refuses that itself
    with pytest.raises(PayloadTooLargeError, match="101 bytes; the limit is 100") as info:
        check_declared_size("101", 100)
    assert info.value.status == 413 and error_body(info.value)[0] == 413
    assert asyncio.run(read_bounded(chunks(b"a" * 60, b"b" * 40), 100)) == b"a" * 60 + b"b" * 40
    with pytest.raises(PayloadTooLargeError, match="over 100 bytes"):
        asyncio.run(read_bounded(chunks(b"a" * 60, b"b" * 41), 100))


@pytest.mark.parametrize(("declared", "left", "read"), [
    ("150", [b"x" * 50], 50),  # a little past the bound: read to its end before the 413
    (None, [b"x" * 30] * 3, 90),  # chunked, a little past: the same
    (None, [b"x" * 30] * 10, 210),  # chunked, far past: read just past the limit's worth more, then no further
    ("100000", [b"x" * 30] * 10, 0),  # declared far past: not read at all (its sender sees the reset)
])
def test_the_rest_of_a_refused_body_not_far_past_the_bound_is_read_first(declared: str | None, left: list[bytes],
                                                                         read: int) -> None:
    """A server that answers a 413 and closes with bytes unread resets the connection, and a client still
    sending gets the reset instead of the 413."""
    taken: list[int] = []

    async def rest() -> AsyncIterator[bytes]:
        for part in left:
            taken.append(len(part))
            yield part

    asyncio.run(drain(rest(), declared, 100, limit=200))
    assert sum(taken) == read


def test_a_refused_body_that_never_comes_is_waited_for_a_moment_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Declared a little past the bound and never sent: the 413 goes after DRAIN_S, not at the deadline."""
    from mmserve.api import body

    monkeypatch.setattr(body, "DRAIN_S", 0.1)

    async def never() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""

    async def timed() -> float:
        started = asyncio.get_running_loop().time()
        await drain(never(), "150", 100, limit=200)
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(asyncio.wait_for(timed(), 5)) < 2


@pytest.mark.parametrize(("raw", "says"), [
    (b"", "empty"),
    (b"  \n", "empty"),
    (b'{"messages": [', "not valid JSON"),
    (b"{'single': 'quotes'}", "not valid JSON"),
    (b'{"text": "\xff\xfe"}', r"not UTF-8 \(byte 10\)"),
    (b'\xef\xbb\xbf{"text": "\xff\xfe"}', r"not UTF-8 \(byte 13\)"),  # counted in the body as sent, its BOM too
    (b"\xef\xbb\xbf \n", "empty"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"seed": ' + b"1" * 5000 + b"}", "a number too long to read"),  # Python's cap on an int's digits: a 500
])
def test_a_body_that_is_not_json_is_a_400_saying_why(raw: bytes, says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says) as info:
        parse_json(raw)
    assert error_body(info.value)[0] == 400


def test_json_decodes_as_is() -> None:
    assert parse_json(b'{"a": [1, "\xc3\xa9"]}') == {"a": [1, "é"]}
    assert parse_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}  # a surrogate pair is one character
    assert parse_json(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}  # a UTF-8 byte-order mark first, as json.loads(bytes)


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"messages": [{"content": "hi \\ud800"}]}', "messages[0].content"),
    (b'{"cache_salt": "\\udfff", "x": "\\ud83d\\ude00"}', "cache_salt"),
    (b'{"stop": ["ok", "\\uDC00"]}', "stop[1]"),
    (b'{"\\ud800": 1}', None),
    # an escaped backslash, the text "ud83d", then a lone low surrogate: no pair, though it reads like one
    (b'{"a": "\\\\ud83d\\ude00"}', "a"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(raw: bytes, param: str | None) -> None:
    """JSON may escape half a character; no text may hold one (the tokenizer, hashing and cache keys raise)."""
    with pytest.raises(InvalidRequestError, match="not valid Unicode") as info:
        parse_json(raw)
    status, body = error_body(info.value)
    assert status == 400 and body["error"]["param"] == param


def test_a_big_body_is_neither_walked_for_valid_pairs_nor_for_a_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk over every value (a 64 MiB body's took seconds on the event loop) only for a small body that may
    hold a lone surrogate: not for one with only pairs (an emoji), and a big one is checked whole, unnamed."""
    from mmserve.api import body

    walked: list[int] = []
    real = body._lone_surrogate

    def walk(value: object) -> str | None:
        walked.append(1)
        return real(value)

    monkeypatch.setattr(body, "_lone_surrogate", walk)
    pad = b"0," * (body.WALKED_BYTES // 2)
    assert parse_json(b'{"a": "\\ud83d\\ude00", "pad": [' + pad + b'0]}')["a"] == "\U0001f600"
    with pytest.raises(InvalidRequestError) as info:
        parse_json(b'{"pad": [' + pad + b'0], "a": "\\ud800"}')
    assert walked == [] and getattr(info.value, "param", None) is None
    with pytest.raises(InvalidRequestError) as info:
        parse_json(b'{"a": ["\\ud800"]}')
    assert walked == [1] and info.value.param == "a[0]"  # a small one: named


def test_a_big_body_too_deep_to_check_whole_is_a_400(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmserve.api import body

    def too_deep(*args: object, **kwargs: object) -> str:
        raise RecursionError

    monkeypatch.setattr(body.json, "dumps", too_deep)  # NOTE: dumps recurses a level deeper than loads
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        parse_json(b'{"pad": "' + b"x" * body.WALKED_BYTES + b'", "a": "\\ud800"}')


def test_a_big_body_is_validated_off_the_event_loop() -> None:
    import threading

    from pydantic import BaseModel

    from mmserve.api import body

    class Seen(BaseModel):
        text: str

        def model_post_init(self, context: object) -> None:
            threads.append(threading.current_thread())

    threads: list[threading.Thread] = []
    small, big = b'{"text": "hi"}', b'{"text": "' + b"x" * (body.THREAD_BYTES + 1) + b'"}'
    assert asyncio.run(body.validated(small, Seen)).text == "hi"
    assert len(asyncio.run(body.validated(big, Seen)).text) == body.THREAD_BYTES + 1
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()


def test_overload_is_a_503_with_retry_after_and_a_deadline_a_504() -> None:
    status, body = error_body(OverloadedError("queue full"))
    assert status == 503 and body["error"]["code"] == "overloaded" and body["error"]["message"] == "queue full"
    assert error_headers(OverloadedError("queue full")) == {"Retry-After": "1"}
    status, body = error_body(DeadlineExceededError("too slow"))
    assert status == 504 and body["error"]["code"] == "deadline_exceeded"
    # NOTE: the openai client would send a request that took its whole deadline twice more
    assert error_headers(DeadlineExceededError("too slow")) == {"x-should-retry": "false"}
    assert error_headers(ValueError("x")) == {}
    assert error_body(RuntimeError("secret"))[1]["error"]["message"] == "internal server error"


def test_the_lone_surrogate_filter_misses_none_and_flags_only_escapes_that_may_be_lone() -> None:
    """The pattern that decides whether a body is checked at all: every body holding a lone surrogate matches
    it, and one without matches only where an escaped backslash precedes a `u` (the rule's ambiguity)."""
    from mmserve.api import body

    rng = random.Random(7)
    pieces = ["\ud83d", "\ude00", "\U0001f600", "\\", "u", "d", "D", "8", "c", "e", "0", "é", "x", " "]
    for _ in range(20_000):
        value = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        text = json.dumps({"a": value}, ensure_ascii=rng.random() < 0.8)  # NOTE: non-ASCII raw or escaped
        if "\ud83d" in text or "\ude00" in text:
            continue  # NOTE: a raw lone surrogate is not UTF-8: the decode refuses that body first
        matched = body._LONE_SURROGATE_ESCAPE.search(text) is not None
        if not body._encodes(json.loads(text)["a"]):  # NOTE: an escaped pair decodes to one character
            assert matched, text
        elif "\\\\u" not in text:
            assert not matched, text
