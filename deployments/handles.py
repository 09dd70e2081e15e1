"""How a replica holds handles to the deployments it calls.

Owns: building a handle's router once, when the replica starts, passing ObjectRefs by reference
whatever Ray's transport default, calling a handle from a worker thread (with a timeout), and
cancelling a call whatever became of it. Does not own what is called (the stage files), routing
policy (Serve's default router) nor retries (retry.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

from mmserve.errors import OverloadedError


def hold(handle: Any) -> Any:
    """The handle a replica keeps: its router built now, its calls made by reference.

    Call from the replica's constructor (or its loop), once per handle it was given.

    NOTE: router built now: left to first use, the worker threads of concurrent first requests each ran
    Serve's unlocked lazy init and built a router of their own (seen: 5 per replica), leaking all but
    one. `options()` builds it (Ray 2.60 calls `_init()` there); Serve runs replica constructors on the
    replica's event loop, which a router that shares that loop needs.

    NOTE: by reference: our messages carry ObjectRefs (pixels, embeddings). Under Ray's high-throughput
    mode (`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, i.e. `RAY_SERVE_USE_GRPC_BY_DEFAULT=1`) a handle sends
    its calls by value over gRPC, and Ray pins every ObjectRef serialized that way for the sender's
    life: every image's pixels stayed in the object store (docs/benchmarks.md).
    `_by_reference` is private in Ray 2.60.
    """
    return handle.options(_by_reference=True)


def cancel(response: Any) -> None:
    """Cancel a handle call, whatever became of it.

    NOTE: a DeploymentResponse(Generator)'s `cancel()` first waits for the call's assignment to a replica
    and re-raises what that raised (a BackPressureError): called while handling that very error, it
    turned a 503 into a 500.
    """
    with contextlib.suppress(Exception):
        response.cancel()


async def awaited(response: Any) -> Any:
    """A handle call's result; a caller cancelled while it waits cancels the call too.

    NOTE: awaiting a DeploymentResponse does not cancel it when the awaiting task is cancelled, and Serve's
    own cancellation of a request's child calls reaches only calls made in that request's task context
    (not, e.g., those started from a worker thread's coroutine): the callee would run on.
    """
    try:
        return await response
    except asyncio.CancelledError:
        cancel(response)
        raise


def shed(exc: BaseException, stage: str = "a stage") -> OverloadedError:
    """Serve's BackPressureError (the calls waiting for `stage`'s replicas at their bound) as the 503 it answers."""
    return OverloadedError(f"{stage}'s queue is full ({exc}); retry later")


LOOP_GRACE_S = 5.0  # how long past its own timeout a thread waits for the loop to report a call's end (s)


class FromThread:
    """Calls on a DeploymentHandle made from a worker thread, run on the replica's event loop.

    NOTE: a handle's blocking `.result()` works only while its router runs on a loop of its own (Ray's
    default). With `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` (Ray's high-throughput mode) or
    `RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0` the router runs on the replica's loop and `.result()`
    raises "Sync methods should not be called from within an asyncio event loop", even in a worker
    thread: every image request failed with a 500. A call made and awaited on the loop works in both.
    """

    def __init__(self, handle: Any):
        self._handle = hold(handle)
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self) -> None:
        """Note the running loop; call from the replica's async method before handing work to a thread."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        """`await handle.method.remote(*args)` on the loop; blocks this (worker) thread for the answer,
        at most `timeout_s` (then TimeoutError, and the call is cancelled).

        NOTE: this thread waits a little past `timeout_s` itself: the timeout runs on the loop, and a loop held
        up (a shutdown joining this very thread) would otherwise leave it waiting for ever."""
        answer = self.submit(method, *args, timeout_s=timeout_s)
        try:
            return answer.result(timeout_s + LOOP_GRACE_S)
        except concurrent.futures.TimeoutError:
            answer.cancel()
            raise

    def submit(self, method: str, *args: Any, timeout_s: float) -> concurrent.futures.Future[Any]:
        """As `call`, without waiting: the answer's future (TimeoutError after `timeout_s`)."""
        async def remote() -> Any:
            response = getattr(self._handle, method).remote(*args)
            try:
                return await asyncio.wait_for(response, timeout_s)
            except (TimeoutError, asyncio.CancelledError):  # NOTE: the thread gave up (`call`) or the loop ends
                cancel(response)  # on the replica too, if it got there
                raise

        return asyncio.run_coroutine_threadsafe(remote(), self._bound())

    def _bound(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("bind() the handle caller from the replica's event loop first")
        return self._loop
