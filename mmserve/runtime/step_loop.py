"""Drives one stage's `step()` in a worker thread and fans its outputs out to asyncio consumers.

Owns: the bridge between a synchronous, single-threaded stage and many concurrent async callers:
actions that touch the stage (add, abort) are queued and run by the loop thread between
steps, so the stage itself needs no locks; each output goes to its request's `OutputChannel`.
An optional batch window lets requests arriving together share the first step. Does not own what a
step does. Used alike by the in-process Engine and by the Ray deployments.

Failure contract: an action's exception fails its request only. A step's exception with a
`request_ids` attribute fails those requests only (the stage has already dropped them), and the outputs it
carries (`outputs`: what the step finished for others) are delivered as a step's would be; any other
step exception fails every waiting request and calls `abort_all`, and the loop carries on (if `abort_all`
raises too, the stage's books are broken and the thread ends, as below), unless `fatal` says the exception
left the stage unable to step again (an accelerator fault): then, its requests (those it names, else all) failed
and `abort_all` called, the thread ends, failing every other waiting request with StageStopped. A step's outputs
and failures reach a consumer only once an action submitted for its channel (its add) has run: an id opened
again right after an abort does not receive what a step or an older action of the old request brings.

Lifetime: `stop()` ends the thread after the step under way and joins it; requests still waiting then
fail with `StageStopped`, and later submissions fail at once; the same when a BaseException ends the thread
(`check_health` then fails: its host replaces the stage). A loop its owner never stopped is
stopped at interpreter exit (an `atexit` hook), so no step thread is still inside torch while the
interpreter tears down (which aborts the process).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable
from typing import Any

from mmserve.messages import RequestFailed
from mmserve.runtime.output_channel import OutputChannel, read

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 30.0  # how long `stop` waits for the step under way to end (s)
_LIVE: weakref.WeakSet[StepLoop] = weakref.WeakSet()  # loops with a thread, for the exit hook


class StageStopped(RuntimeError):
    """The stage's loop was stopped (shutdown) before the request finished."""


class StepLoop:
    def __init__(
        self,
        step: Callable[[], list[Any]],  # returns outputs carrying `.request_id` and `.finished`
        has_work: Callable[[], bool],
        abort_all: Callable[[], None],
        *,
        batch_wait_s: float = 0.0,  # seconds to wait for company after waking up idle
        name: str = "mmserve-step-loop",
        fatal: Callable[[BaseException], bool] = lambda exc: False,  # a step error after which none can succeed
    ):
        self._step, self._has_work, self._abort_all = step, has_work, abort_all
        self._fatal = fatal
        self.on_death: Callable[[], object] | None = None  # called once a BaseException ended the thread (its host's
        # exit, so that callers see the replica gone at once rather than a loop that answers StageStopped)
        self.batch_wait_s = batch_wait_s
        self.name = name
        self._channels: dict[str, OutputChannel] = {}  # request id -> its outputs, to its consumer's loop
        # (request id, action, its consumer's channel when it was submitted: the one the action joins)
        self._actions: list[tuple[str | None, Callable[[], Any], OutputChannel | None]] = []
        self._running_actions = False  # taken off the queue by the loop thread and not all run yet (under _lock)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._dead = False  # the step thread died (a BaseException escaped it): nothing runs any more
        self._step_started: float | None = None  # when the step under way began (s, time.monotonic); None: none
        self._calls: dict[asyncio.Future, asyncio.AbstractEventLoop] = {}  # `call`s not answered yet

    # ---- called from any thread / event loop ---------------------------------------------------
    def open(self, request_id: str) -> None:
        """Register interest in a request's outputs (from its consumer's event loop), before submitting.

        Raises ValueError for an id that already has a consumer here: that one keeps its outputs (replacing its
        channel would leave it waiting for ever).
        """
        channel = OutputChannel(asyncio.get_running_loop())
        # NOTE: one atomic check-and-insert: two threads' loops opening one id at once must not both pass
        if self._channels.setdefault(request_id, channel) is not channel:
            raise ValueError(f"request {request_id} already has a consumer in {self.name}")

    def has_consumer(self, request_id: str) -> bool:
        """Whether `request_id` has a consumer here (opened, its outputs not closed)."""
        return request_id in self._channels

    def submit(self, request_id: str | None, action: Callable[[], Any]) -> None:
        """Run `action` in the loop thread before the next step; its exception fails `request_id`.

        After `stop()` nothing runs: the request fails with StageStopped (an anonymous action is dropped).
        """
        channel = None if request_id is None else self._channels.get(request_id)
        with self._lock:
            closed = self._stopped or self._dead
            if not closed:
                self._actions.append((request_id, action, channel))
                if self._thread is None:
                    # NOTE: a daemon, so a forgotten loop cannot keep the interpreter alive; the exit
                    # hook joins it before teardown.
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
                    _LIVE.add(self)
        if closed and request_id is not None:
            self._deliver(request_id, RequestFailed(request_id, StageStopped(self._closed_why())))
        self._wake.set()

    def _closed_why(self) -> str:
        return f"the step thread of {self.name} died" if self._dead else f"{self.name} is stopped"

    async def call(self, action: Callable[[], Any]) -> Any:
        """Run `action` in the loop thread before the next step and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result, error = action(), None
            except Exception as exc:
                result, error = None, exc
            loop.call_soon_threadsafe(_settle, future, result, error)

        with self._lock:  # NOTE: with stop()'s flag: a call registered here is failed by stop() if not run
            closed = self._stopped or self._dead
            if not closed:
                self._calls[future] = loop
        if closed:
            raise StageStopped(self._closed_why())
        future.add_done_callback(lambda f: self._calls.pop(f, None))
        self.submit(None, run)
        return await future

    def busy(self) -> bool:
        """Actions queued or running, or work in the stage (racy by nature; for tests and draining).

        NOTE: an action taken off the queue and not yet run counts: an add run after an abort's check would
        otherwise leave a moment where neither the queue nor the stage shows the request."""
        with self._lock:
            if self._actions or self._running_actions:
                return True
        return self._has_work()

    async def outputs(self, request_id: str, merge: Callable[[list[Any]], Any] | None = None,
                      interval_s: Callable[[], float] = lambda: 0.0) -> AsyncGenerator[Any]:
        """Outputs of one request until (and including) its finished one; failures are raised. With `merge`,
        those that queued up come as one, paced by `interval_s` (`output_channel.read`)."""
        try:
            async with contextlib.aclosing(read(self._channels[request_id], merge, interval_s)) as outputs:
                async for item in outputs:
                    yield item
        finally:
            self._channels.pop(request_id, None)

    def check_health(self, stuck_after_s: float | None = None) -> None:
        """Raise RuntimeError if the step thread started and died (only a BaseException ends it early), or if
        one step has run for over `stuck_after_s` (a hung device or collective): the stage can serve nothing
        more, and its host (Serve's `check_health`) should replace it."""
        if self.died():
            raise RuntimeError(f"{self.name}: the step thread died")
        started = self._step_started
        if stuck_after_s is not None and started is not None and time.monotonic() - started > stuck_after_s:
            raise RuntimeError(f"{self.name}: one step has run for {time.monotonic() - started:.0f} s "
                               f"(over {stuck_after_s:.0f} s)")

    def died(self) -> bool:
        """Whether the step thread started and died without being stopped: nothing will run a step again."""
        with self._lock:
            thread, stopped = self._thread, self._stopped
        return thread is not None and not thread.is_alive() and not stopped

    def stop(self, timeout_s: float | None = JOIN_TIMEOUT_S) -> None:
        """End the loop after the step under way, join its thread, fail what still waits. Idempotent."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("%s: step thread still running %s s after stop", self.name, timeout_s)
        self._fail_waiting(f"{self.name} stopped")

    def _fail_waiting(self, why: str) -> None:
        """Fail every request and call still waiting with StageStopped(why); queued actions never run."""
        with self._lock:
            self._actions.clear()  # never run: their requests and calls fail below
            calls = list(self._calls.items())
        for request_id in list(self._channels):
            self._deliver(request_id, RequestFailed(request_id, StageStopped(why)))
        for future, loop in calls:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                loop.call_soon_threadsafe(_settle, future, None, StageStopped(why))

    # ---- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._wake.wait()
                self._wake.clear()
                if self.batch_wait_s > 0:
                    time.sleep(self.batch_wait_s)
                while not self._stopped and (self._run_actions() or self._has_work()):
                    self._one_step()
        except BaseException as exc:
            # NOTE: nothing will run a step again: whoever waits, or submits from now on, fails at once
            # (check_health reports it, and a Ray replica then exits to be replaced)
            log.critical("%s: the step thread died (%r); failing every request", self.name, exc)
            with self._lock:
                self._dead = True
            self._fail_waiting(f"the step thread of {self.name} died ({exc!r})")
            if self.on_death is not None:
                try:
                    self.on_death()
                except Exception:
                    log.exception("%s: on_death failed", self.name)
            raise

    def _run_actions(self) -> bool:
        with self._lock:
            actions, self._actions = self._actions, []
            self._running_actions = bool(actions)
        if not actions:
            return False
        try:
            for request_id, action, channel in actions:
                if channel is not None:
                    channel.joined = True  # NOTE: its own consumer's: an older action under a reused id joins none
                self._run_action(request_id, action, channel)
        finally:
            with self._lock:
                self._running_actions = False
        return True

    def _run_action(self, request_id: str | None, action: Callable[[], Any], channel: OutputChannel | None) -> None:
        """Run one action; its exception fails `request_id` through `channel`, the consumer it was submitted
        for, if that one still listens (an anonymous action's is logged, one whose consumer has gone noted).

        NOTE: not through whichever consumer has the id now: one that reopened it after the old one left
        must not fail with the old request's error."""
        try:
            action()
        except Exception as exc:
            if request_id is None:
                log.exception("%s: action failed", self.name)
            elif channel is not None and self._channels.get(request_id) is channel:
                self._deliver(request_id, RequestFailed(request_id, exc))
            else:  # NOTE: e.g. the end of a request whose consumer's loop closed (expected: no traceback)
                log.info("%s: an action for request %s failed after its consumer left: %r", self.name, request_id,
                         exc)

    def _one_step(self) -> None:
        if not self._has_work():
            return
        started = time.perf_counter()
        self._step_started = time.monotonic()
        try:
            outputs = self._step()
        except Exception as exc:
            named = getattr(exc, "request_ids", None)
            aborted = named is None
            try:
                if named is None:
                    named = list(self._channels)
                    log.exception("%s: step failed; aborting every request (%d: %s)", self.name, len(named),
                                  ", ".join(named[:8]) + (", ..." if len(named) > 8 else ""))
                    self._abort_all()  # NOTE: if this raises too, the stage's books are broken: the thread ends
            finally:
                for out in getattr(exc, "outputs", ()):
                    self._deliver(out.request_id, out, from_step=True)
                for request_id in named or ():
                    self._deliver(request_id, RequestFailed(request_id, exc), from_step=True)
            if self._fatal(exc):
                if not aborted:  # NOTE: the stage's books (host only) emptied, as after a step error naming no one
                    try:
                        self._abort_all()
                    except Exception:
                        log.exception("%s: abort_all after a fatal step failed", self.name)
                raise  # NOTE: the thread ends (`_run`): every later step would fail too; whoever still waits gets
                # StageStopped; check_health reports it
            return
        finally:
            self._step_started = None
        for out in outputs:
            self._deliver(out.request_id, out, from_step=True)
        if not outputs and time.perf_counter() - started < 1e-3:
            # NOTE: the stage has work but could do nothing now (e.g. waiting for cache space that a
            # handover or an abort will free): yield the core instead of spinning; an action wakes us at once.
            self._wake.wait(0.002)
            self._wake.clear()

    def _deliver(self, request_id: str, item: Any, from_step: bool = False) -> None:
        """Hand `item` to the request's consumer, if it still listens.

        NOTE: a step's item goes only to a consumer whose own action has run (`joined`): after an abort, a
        step already under way may still emit the old request's output, and a consumer that has just
        opened the same id again must not take it as its own."""
        channel = self._channels.get(request_id)
        if channel is None or (from_step and not channel.joined):
            return  # nobody listens (any more), or not yet
        try:
            channel.put(item)
        except RuntimeError:  # the consumer's event loop has closed; it is gone
            self._channels.pop(request_id, None)


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@atexit.register
def _stop_live_loops() -> None:
    for loop in list(_LIVE):
        loop.stop()
