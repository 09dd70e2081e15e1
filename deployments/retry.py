"""Calls that survive the loss of the replica answering them.

Owns: which Ray errors mean "the replica (or the node, or the owner of an object the call read) is
gone" rather than "the request is bad", what such an error becomes for the client (a ReplicaLostError;
any other a replica passed on: its own exception), retrying an idempotent call on a live replica, a
bounded number of times with a short backoff, and which of an attempt's results the next attempt may
start from (`Kept`). Does not own which calls are idempotent: the callers choose
(preprocess, encode, a request's way to its first token and a non-streamed request's whole way are; a stream
already under way is not).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve.exceptions import ReplicaUnavailableError

from mmserve.errors import ReplicaLostError
from mmserve.runtime.step_loop import StageStopped

log = logging.getLogger(__name__)
T = TypeVar("T")

# the callee died, or its stage did (a step thread ended by an accelerator fault, or stopped for its replica's
# shutdown: the replica answers StageStopped until Serve replaces it, and a live one can serve the call)
ACTOR_LOST = (RayActorError, NodeDiedError, WorkerCrashedError, ReplicaUnavailableError, StageStopped)
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


def attempt_id(request_id: str, attempt: int, kind: str = "retry") -> str:
    """The downstream request id of an attempt: the request's own for the first, a new one per retry.

    NOTE: each caller that retries a call names its retries its own `kind`, so that ids stay unique where
    retries nest (the ingress's second attempt, `r/retry-1`, against its first's encode retried once by the
    Decoder, `r/encode-retry-1`): a stage that met one id twice would answer only one of the two calls.
    """
    return request_id if not attempt else f"{request_id}/{kind}-{attempt}"


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


class Kept(Generic[T]):
    """What an attempt made on its way (the preprocessed request), for the next attempt to start from when the
    attempt was lost only with a replica after that point (its Decoder died): made again it would cost the
    same work and, for an image URL, another fetch.

    NOTE: kept only when no object was reported lost: the value's ObjectRefs (pixels) belong to the replica that
    made it, and an attempt that failed with an ObjectLostError, or for any other reason, starts again from
    scratch. A kept value whose maker died since is lost at its next use, and the attempt after that starts
    from scratch: a replica lost with its node costs one retry more.
    """

    def __init__(self) -> None:
        self._value: T | None = None  # the last attempt's, once it made it
        self._ready = False  # whether the next attempt may start from it

    @property
    def ready(self) -> bool:
        return self._ready

    def take(self) -> T | None:
        """The value kept for this attempt, or None (then it makes its own); the next attempt gets a value only
        if this one hands it to `made` (the kept one or its own) and then is lost as `lost_after` allows."""
        value, self._value, self._ready = (self._value if self._ready else None), None, False
        return value

    def made(self, value: T) -> None:
        self._value = value

    def lost_after(self, exc: BaseException) -> None:
        """The attempt failed after `made` with `exc`: keep its value if a replica died and no object was lost."""
        self._ready = (self._value is not None and replica_lost(exc, ACTOR_LOST)
                       and not replica_lost(exc, (ObjectLostError,)))
