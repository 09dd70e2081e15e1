"""A request body as the HTTP edge reads it: bounded in size, then JSON.

Owns: refusing a body not sent as JSON or sent compressed (415, `check_media`), refusing a body over the
configured size (413, before reading it when its Content-Length says
so, else as soon as the bytes read pass the bound; the rest of a body not far past it read and dropped
first, `drain`), decoding JSON with a 400 naming what is wrong
(not JSON, not UTF-8, nested too deep, a number too long, text that is not valid Unicode), and validating it as a
model (a big body off the event loop, `validated`). Does not own: what the JSON must
hold (protocol.py) nor the socket (the ingress hands in the body's chunks).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pydantic import BaseModel

from mmserve.errors import InvalidRequestError, PayloadTooLargeError, UnsupportedMediaTypeError

M = TypeVar("M", bound=BaseModel)

DRAIN_BYTES = 1 << 20  # bytes of a refused body still read before its 413 (bytes)
DRAIN_S = 5.0  # the longest a refused body is waited for before its 413 (s)
THREAD_BYTES = 1 << 20  # bodies past this are parsed and validated in a worker thread (bytes)


# a JSON media type: application/json, or a structured suffix (application/problem+json); parameters after ';'
_JSON_MEDIA = re.compile(r"application/(?:[\w.-]+\+)?json", re.IGNORECASE)


def check_media(content_type: str | None, content_encoding: str | None) -> None:
    """Raise UnsupportedMediaTypeError (415) unless the body is sent as JSON (its Content-Type) and as it is (no
    Content-Encoding but `identity`).

    NOTE: as FastAPI's own body parsing: a page in a browser may POST text/plain, a form or no type at all
    to any address without asking first (no CORS preflight); read as JSON anyway, it would start a generation
    and the image fetches it names on the server, whatever the CORS settings (which only keep the answer from
    that page). A gzip body is refused by name rather than read as bytes that are not UTF-8.
    """
    encoding = (content_encoding or "").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaTypeError(f"the request body's Content-Encoding {content_encoding!r} is not accepted; "
                                        "send it uncompressed", encoding=True)
    media = (content_type or "").split(";", 1)[0].strip()
    if not _JSON_MEDIA.fullmatch(media):
        raise UnsupportedMediaTypeError("the request body must be JSON, sent with Content-Type: application/json; "
                                        f"got {media or 'no Content-Type'!r}")


def declared_size(content_length: str | None) -> int | None:
    """The body's size by its Content-Length header (bytes); None when absent (chunked) or not a number (the
    HTTP server refuses that itself)."""
    return int(content_length) if content_length is not None and content_length.strip().isdigit() else None


def check_declared_size(content_length: str | None, max_bytes: int) -> None:
    """Raise PayloadTooLargeError if the Content-Length header already says the body is too big."""
    if (size := declared_size(content_length)) is not None and size > max_bytes:
        raise PayloadTooLargeError(f"the request body is {size} bytes; the limit is {max_bytes}")


async def read_bounded(chunks: AsyncIterator[bytes], max_bytes: int) -> bytes:
    """The body's bytes; raises PayloadTooLargeError once more than `max_bytes` have arrived."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLargeError(f"the request body is over {max_bytes} bytes, the limit")
        parts.append(chunk)
    return b"".join(parts)


async def drain(chunks: AsyncIterator[bytes], declared: str | None, max_bytes: int, limit: int = DRAIN_BYTES) -> None:
    """Read and drop what is left of a body refused for passing `max_bytes`, unless it declares (Content-Length
    `declared`) more than `limit` bytes past that bound; at most `limit` bytes more are read, for DRAIN_S at most.

    NOTE: a server that answers and closes with a body's bytes unread resets the connection, and a client
    still sending sees the reset, not the 413 (nginx's lingering close reads on for the same reason). A body
    far past the limit is not read: its sender gets the reset.
    """
    if (size := declared_size(declared)) is not None and size - max_bytes > limit:
        return
    drained = 0
    with contextlib.suppress(TimeoutError):  # NOTE: a body declared and not sent gets its 413 all the same
        async with asyncio.timeout(DRAIN_S):
            async for chunk in chunks:
                drained += len(chunk)
                if drained > limit:
                    return


async def validated(raw: bytes, model: type[M]) -> M:
    """The body parsed (`parse_json`) and validated as `model`; a body past `THREAD_BYTES` in a worker thread.

    NOTE: a body of millions of values (a 64 MiB one of empty text parts) took seconds to validate, every other
    request of the replica waiting on the event loop meanwhile; in a thread the event loop runs between the
    validation's Python callbacks (the JSON decode itself, in C, still holds the GIL while it runs).
    """
    def parse() -> M:
        return model.model_validate(parse_json(raw))

    return parse() if len(raw) <= THREAD_BYTES else await asyncio.to_thread(parse)


def parse_json(raw: bytes) -> Any:
    """The body's JSON value; InvalidRequestError (400) if it is empty, not UTF-8 or not JSON."""
    body = raw.removeprefix(codecs.BOM_UTF8)  # NOTE: a leading byte-order mark (Notepad) skipped, as json.loads does
    if not body.strip():
        raise InvalidRequestError("the request body is empty; expected a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        offset = err.start + len(raw) - len(body)  # in the body as sent
        raise InvalidRequestError(f"the request body is not UTF-8 (byte {offset})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidRequestError(f"the request body is not valid JSON: {err.msg} at line {err.lineno} "
                                  f"column {err.colno}") from None
    except RecursionError:  # NOTE: json's C decoder recurses per nesting level
        raise InvalidRequestError("the request body's JSON is nested too deeply") from None
    except ValueError as err:  # NOTE: Python's cap on an integer's digits (4,300), which json.loads enforces
        raise InvalidRequestError(f"the request body holds a number too long to read: {err}") from None
    if _LONE_SURROGATE_ESCAPE.search(text):  # NOTE: the checks below only for bodies that may hold one at all
        # NOTE: the path is found by a walk over every value, for a body small enough; a bigger one is checked
        # whole at C speed (a 64 MiB body's walk held the event loop for seconds) and named as a whole
        where = _lone_surrogate(value) if len(raw) <= WALKED_BYTES else None if _encodes_whole(value) else ""
        if where is not None:
            raise InvalidRequestError(f"{where or 'the request body'}: text that is not valid Unicode (a lone "
                                      "surrogate escape such as \\ud800)", param=where or None)
    return value


# JSON's escape of a UTF-16 surrogate that no other completes: a high one not followed by a low one, or a low one
# not after a high one (a pair is one character, an emoji; a lone one no character at all). NOTE: a backslash
# before another is ambiguous (an escaped backslash, then text "ud83d"): it counts as a match, and only the check
# below runs (a false positive costs that check; a miss would be a 500 later)
# NOTE: one branch opening with the literal `\u`, which `re` skips to at C speed; a low surrogate's look back
# comes after it (a look back tried at every position of the body, an image's base64 included, held the event
# loop for a time that was most of an image request's parse: docs/benchmarks.md)
_LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                                    r"|[c-fC-F][0-9a-fA-F]{2}(?<![^\\]\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}))")
WALKED_BYTES = 1 << 20  # bodies up to this size are walked for the path of a lone surrogate (bytes)


def _encodes_whole(value: Any) -> bool:
    """Whether every string of `value`, keys included, is valid Unicode (one C-speed pass)."""
    try:
        return _encodes(json.dumps(value, ensure_ascii=False))
    except RecursionError:  # NOTE: dumps recurses a level deeper than loads did
        raise InvalidRequestError("the request body's JSON is nested too deeply") from None


def _lone_surrogate(value: Any) -> str | None:
    """The path (`messages[0].content`) of the first string, key included, that holds a lone surrogate, "" for
    the top level; None if none does. NOTE: a loop, not recursion: the body may nest as deep as JSON allows."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str) and not _encodes(item):
            return path
        if isinstance(item, dict):
            for key, child in item.items():
                if not _encodes(key):
                    return path
                stack.append((f"{path}.{key}" if path else key, child))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
