"""Calls that survive the loss of the replica answering them.

Owns: which Ray errors mean "the replica (or the node, or the owner of an object the call read) is
gone" rather than "the request is bad", what such an error becomes for the client (a ReplicaLostError;
any other a replica passed on: its own exception), and retrying an idempotent call on a live replica, a
bounded number of times with a short backoff. Does not own which calls are idempotent: the callers choose
(preprocess, encode, a request's way to its first token and a non-streamed request's whole way are; a stream
already under way is not).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import ReplicaUnavailableError

from mmserve.errors import ReplicaLostError

log = logging.getLogger(__name__)
T = TypeVar("T")

ACTOR_LOST = (RayActorError, NodeDiedError, WorkerCrashedError, ReplicaUnavailableError)  # the callee died
REPLICA_LOST = (*ACTOR_LOST, ObjectLostError)  # ...or the replica that made an object the call reads
BACKOFF_S = 0.5  # before the first retry; doubled for each next one (Serve needs a moment to route around)


def replica_lost(exc: BaseException, kinds: tuple[type[BaseException], ...] = REPLICA_LOST) -> bool:
    """True when `exc`, or the error a replica passed on inside a RayTaskError, is one of `kinds`."""
    while True:
        if isinstance(exc, kinds):
            return True
        if not isinstance(exc, RayTaskError) or exc.cause is None or exc.cause is exc:
            return False
        exc = exc.cause


def unwrapped(exc: BaseException) -> BaseException:
    """The replica's own exception, without Ray's wrapper (whose text carries a traceback); a lost
    replica (after the retries) as a ReplicaLostError."""
    if replica_lost(exc):
        return ReplicaLostError(f"a serving replica was lost ({type(exc).__name__}); retry")
    while isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return exc


def attempt_id(request_id: str, attempt: int) -> str:
    """The downstream request id of an attempt: the request's own for the first, a new one per retry."""
    return request_id if not attempt else f"{request_id}/retry-{attempt}"


async def retrying(call: Callable[[int], Awaitable[T]], *, retries: int, what: str,
                   kinds: tuple[type[BaseException], ...] = REPLICA_LOST) -> T:
    """`await call(attempt)` (attempt 0, 1, ...), made again up to `retries` more times while it fails with
    a loss of `kinds`. NOTE: the attempt number lets a caller give each attempt its own request id: a call
    Ray reports lost may still be running on a replica that is only unreachable."""
    for attempt in range(retries + 1):
        try:
            return await call(attempt)
        except Exception as exc:
            if attempt == retries or not replica_lost(exc, kinds):
                raise
            log.warning("%s: replica lost (%s); retry %d of %d", what, type(exc).__name__, attempt + 1, retries)
        await asyncio.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")
