"""Calls that survive the loss of the replica answering them.

Owns: which Ray errors mean "the replica (or the node, or the owner of an object the call read) is
gone" rather than "the request is bad", and retrying an idempotent call on a live replica, a bounded
number of times with a short backoff. Does not own which calls are idempotent: the callers choose
(preprocess, encode and a request's way to its first token are; a stream already under way is not).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import ReplicaUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")

REPLICA_LOST = (RayActorError, ObjectLostError, NodeDiedError, WorkerCrashedError, ReplicaUnavailableError)
BACKOFF_S = 0.25  # before the first retry; doubled for each next one (Serve needs a moment to route around)


def replica_lost(exc: BaseException) -> bool:
    """True when `exc`, or the error a replica passed on inside a RayTaskError, is a replica loss."""
    while True:
        if isinstance(exc, REPLICA_LOST):
            return True
        if not isinstance(exc, RayTaskError) or exc.cause is None or exc.cause is exc:
            return False
        exc = exc.cause


async def retrying(call: Callable[[], Awaitable[T]], *, retries: int, what: str) -> T:
    """`await call()`, made again (up to `retries` more times) while it fails with a replica loss."""
    for attempt in range(retries + 1):
        try:
            return await call()
        except Exception as exc:
            if attempt == retries or not replica_lost(exc):
                raise
            log.warning("%s: replica lost (%s); retry %d of %d", what, type(exc).__name__, attempt + 1, retries)
        await asyncio.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")
