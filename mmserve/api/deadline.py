"""A request's deadline at the HTTP edge: every wait of the request ends by it.

Owns: awaiting one step of a request (the Preprocess call, each message of the Decoder's stream) with
the time the request has left, and saying so with a DeadlineExceededError (504) when it runs out. Does
not own what is awaited, nor cancelling it downstream (the caller cancels the stream it gave up on,
which aborts the request and frees its holds).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from mmserve.errors import DeadlineExceededError

T = TypeVar("T")


class Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = asyncio.get_running_loop().time() + timeout_s  # loop time

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """`await awaitable`, or DeadlineExceededError (the awaitable cancelled) once the deadline passes."""
        try:
            async with asyncio.timeout_at(self.at) as scope:  # NOTE: no task per wait, unlike wait_for
                return await awaitable
        except TimeoutError:
            if not scope.expired():  # the awaitable's own TimeoutError, not the deadline
                raise
            raise DeadlineExceededError(f"the request took longer than its deadline of {self.timeout_s:g} s "
                                        "(ingress.request_timeout_s)") from None
