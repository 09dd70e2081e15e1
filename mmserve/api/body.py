"""A request body as the HTTP edge reads it: bounded in size, then JSON.

Owns: refusing a body over the configured size (413, before reading it when its Content-Length says
so, else as soon as the bytes read pass the bound) and decoding JSON with a 400 naming what is wrong
(not JSON, not UTF-8, nested too deep). Does not own: what the JSON must hold (protocol.py) nor the
socket (the ingress hands in the body's chunks).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from mmserve.errors import InvalidRequestError, PayloadTooLargeError


def check_declared_size(content_length: str | None, max_bytes: int) -> None:
    """Raise PayloadTooLargeError if the Content-Length header already says the body is too big."""
    if content_length is not None and content_length.strip().isdigit() and int(content_length) > max_bytes:
        raise PayloadTooLargeError(f"the request body is {int(content_length)} bytes; the limit is {max_bytes}")


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


def parse_json(raw: bytes) -> Any:
    """The body's JSON value; InvalidRequestError (400) if it is empty, not UTF-8 or not JSON."""
    if not raw.strip():
        raise InvalidRequestError("the request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidRequestError(f"the request body is not UTF-8 (byte {err.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidRequestError(f"the request body is not valid JSON: {err.msg} at line {err.lineno} "
                                  f"column {err.colno}") from None
    except RecursionError:  # NOTE: json's C decoder recurses per nesting level
        raise InvalidRequestError("the request body's JSON is nested too deeply") from None
