"""StepLoop's fan-out to async consumers: outputs that pile up are merged on request, failures end a stream."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time

import pytest
import torch

from mmserve.messages import RequestFailed, RequestOutput, merge_outputs
from mmserve.runtime.device_errors import DeviceFault, device_fatal
from mmserve.runtime.step_loop import StageStopped, StepLoop


def out(token: int, text: str, *, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [token], text, finished, "length" if finished else None, 5, n)


def idle_loop() -> StepLoop:
    return StepLoop(lambda: [], lambda: False, lambda: None)


def test_merge_outputs_concatenates_deltas_and_keeps_the_last_counts() -> None:
    merged = merge_outputs([out(7, "a", n=1), out(8, "b", n=2), out(9, "c", n=3, finished=True)])
    assert merged.new_token_ids == [7, 8, 9]
    assert merged.new_text == "abc"
    assert (merged.finished, merged.finish_reason, merged.num_output_tokens) == (True, "length", 3)
    single = out(1, "x", n=1)
    assert merge_outputs([single]) is single


async def _collect(loop: StepLoop, items: list, merge) -> list:
    loop.open("r")
    for item in items:  # NOTE: queued before the consumer runs: it "fell behind" by all of them
        loop._deliver("r", item)
    await asyncio.sleep(0)  # call_soon_threadsafe puts run on the next loop iteration
    return [o async for o in loop.outputs("r", merge=merge)]


def test_outputs_that_queued_up_come_as_one_when_merging() -> None:
    items = [out(1, "a", n=1), out(2, "b", n=2), out(3, "c", n=3, finished=True)]
    merged = asyncio.run(_collect(idle_loop(), items, merge_outputs))
    assert [(o.new_token_ids, o.new_text, o.finished) for o in merged] == [([1, 2, 3], "abc", True)]
    plain = asyncio.run(_collect(idle_loop(), items, None))
    assert [o.new_token_ids for o in plain] == [[1], [2], [3]]


@pytest.mark.parametrize(("queued", "sent"), [
    ([out(1, "a", n=1), out(2, "b", n=2), RequestFailed("r", ValueError("boom"))], [[1, 2]]),
    # an action that failed the request (a late fetch of its embeddings), then a step that still ran it: outputs
    # follow the failure in the channel, and are not sent
    ([out(1, "a", n=1), RequestFailed("r", ValueError("boom")), out(2, "b", n=2)], [[1]]),
])
def test_a_failure_delivers_the_outputs_queued_before_it_then_raises(queued: list, sent: list) -> None:
    got: list = []

    async def run() -> None:
        loop = idle_loop()
        loop.open("r")
        for item in queued:
            loop._deliver("r", item)
        await asyncio.sleep(0)
        async for o in loop.outputs("r", merge=merge_outputs):
            got.append(o)

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(run())
    assert [o.new_token_ids for o in got] == sent


class NamedFailure(RuntimeError):
    """A step error naming the requests it failed and carrying what the step finished for others."""

    def __init__(self, request_ids: list[str], outputs: list[RequestOutput]) -> None:
        super().__init__("one item failed")
        self.request_ids, self.outputs = request_ids, outputs


def test_a_step_failure_naming_its_requests_still_delivers_what_it_finished_for_others() -> None:
    pending: set[str] = set()  # the requests added: a step runs once both are

    def step() -> list:
        pending.clear()
        done = RequestOutput("ok", [7], "x", True, "stop", 5, 1)
        raise NamedFailure(["bad"], [done])

    async def run() -> tuple[list, BaseException | None]:
        loop = StepLoop(step, lambda: len(pending) == 2, lambda: None)
        for rid in ("bad", "ok"):
            loop.open(rid)
            loop.submit(rid, functools.partial(pending.add, rid))  # its add: its consumer takes the steps' outputs
        got = [o async for o in loop.outputs("ok")]
        try:
            async for _ in loop.outputs("bad"):
                pass
        except NamedFailure as exc:
            loop.stop()
            return got, exc
        loop.stop()
        return got, None

    got, error = asyncio.run(asyncio.wait_for(run(), 10))
    assert [o.new_token_ids for o in got] == [[7]] and isinstance(error, NamedFailure)


def test_stop_joins_the_thread_and_fails_what_still_waits() -> None:
    started = threading.Event()

    def slow_step() -> list:
        started.set()
        time.sleep(0.05)
        return []

    async def run() -> tuple[StepLoop, BaseException | None]:
        loop = StepLoop(slow_step, lambda: True, lambda: None)
        loop.open("r")
        loop.submit("r", lambda: None)
        await asyncio.to_thread(started.wait, 5)
        await asyncio.to_thread(loop.stop)
        try:
            async for _ in loop.outputs("r"):
                pass
        except StageStopped as exc:
            return loop, exc
        return loop, None

    loop, error = asyncio.run(run())
    assert isinstance(error, StageStopped)
    assert loop._thread is not None and not loop._thread.is_alive()  # joined, not left to interpreter exit


def test_a_submission_after_stop_fails_at_once() -> None:
    async def run() -> None:
        loop = idle_loop()
        loop.stop()
        loop.open("r")
        loop.submit("r", lambda: None)
        loop.submit(None, lambda: None)  # an abort during shutdown: dropped, no error
        async for _ in loop.outputs("r"):
            pass

    with pytest.raises(StageStopped):
        asyncio.run(asyncio.wait_for(run(), 5))


def test_an_interval_sends_the_first_output_at_once_then_one_merged_chunk_per_interval() -> None:
    interval, n = 0.02, 600  # NOTE: >= 1 ms a token, so the stream lasts >= 0.6 s (see the last bound)

    sent: dict[int, float] = {}
    first_taken = threading.Event()

    async def run() -> list[tuple[float, RequestOutput]]:
        loop = idle_loop()
        loop.open("r")

        def produce() -> None:  # a token every millisecond, as a fast decoder would
            for i in range(1, n + 1):
                sent[i] = time.monotonic()
                loop._deliver("r", out(i, str(i % 10), n=i, finished=i == n))
                if i == 1:  # NOTE: on a busy machine the consumer may wake after token 2: not what is tested
                    first_taken.wait(5)
                time.sleep(0.001)

        threading.Thread(target=produce, daemon=True).start()
        got = []
        async for o in loop.outputs("r", merge=merge_outputs, interval_s=lambda: interval):
            got.append((time.monotonic(), o))
            first_taken.set()
        return got

    got = asyncio.run(run())
    assert got[0][1].new_token_ids == [1]  # the first token is not held back
    assert [t for _, o in got for t in o.new_token_ids] == list(range(1, n + 1))  # nothing lost, in order
    assert "".join(o.new_text for _, o in got) == "".join(str(i % 10) for i in range(1, n + 1))
    assert got[-1][1].finished and len(got) < n // 3  # merged: far fewer messages than tokens
    # no token waits more than an interval (plus generous slack for a stalled CI machine) for its chunk;
    # a loop that held tokens back until the end would delay token 2 by the whole stream, >= 0.6 s
    assert max(at - sent[o.new_token_ids[0]] for at, o in got) < interval + 0.3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_health_fails_once_the_step_thread_died_and_not_after_a_stop() -> None:
    def fatal_step() -> list:
        raise SystemExit("the step thread ends")  # a BaseException: nothing in the loop catches it

    loop = StepLoop(fatal_step, lambda: True, lambda: None)
    loop.check_health()  # not started yet: healthy
    loop.submit(None, lambda: None)  # starts the thread, whose first step ends it
    assert loop._thread is not None
    loop._thread.join(5)
    with pytest.raises(RuntimeError, match="step thread died"):
        loop.check_health()
    loop.stop()
    loop.check_health()  # stopped on purpose: nothing to replace


async def _failure(loop: StepLoop, request_id: str, work: list[str]) -> BaseException | None:
    """Add `request_id` (its add puts it in `work`) and read its outputs to the end -> the error they ended with."""
    loop.open(request_id)
    loop.submit(request_id, lambda: work.append(request_id))
    try:
        async for _ in loop.outputs(request_id):
            pass
    except Exception as exc:
        return exc
    return None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_fatal_step_error_fails_its_requests_and_ends_the_thread_so_health_fails() -> None:
    """An accelerator fault is sticky: the loop fails what waits, stops stepping, and check_health reports it;
    any other step error fails what waits and the loop steps on."""
    errors = [RuntimeError("a bad batch"), torch.AcceleratorError("CUDA error: an illegal memory access")]
    aborted: list[int] = []
    work: list[str] = []  # requests added and not yet stepped

    def step() -> list:
        work.clear()
        raise errors.pop(0)

    loop = StepLoop(step, lambda: bool(work), lambda: aborted.append(1), fatal=device_fatal)
    deaths: list[int] = []
    loop.on_death = lambda: deaths.append(1)  # a replica's exit

    first = asyncio.run(_failure(loop, "r1", work))
    assert isinstance(first, RuntimeError) and "bad batch" in str(first) and aborted == [1]
    loop.check_health()  # stepped on
    second = asyncio.run(_failure(loop, "r2", work))
    assert isinstance(second, torch.AcceleratorError)
    assert loop._thread is not None
    loop._thread.join(5)
    with pytest.raises(RuntimeError, match="step thread died"):
        loop.check_health()
    assert deaths == [1]  # once the thread ended, not after the first error
    loop.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_fatal_step_error_naming_its_requests_fails_those_empties_the_books_once_and_stops_the_rest() -> None:
    work: list[str] = []
    aborted: list[int] = []

    def step() -> list:
        work.clear()
        raise DeviceFault(torch.AcceleratorError("CUDA error: an illegal memory access"), ["r1"])

    loop = StepLoop(step, lambda: bool(work), lambda: aborted.append(1), fatal=device_fatal)

    async def both() -> list[BaseException | None]:
        return list(await asyncio.gather(_failure(loop, "r1", work), _failure(loop, "r2", work)))

    first, second = asyncio.run(both())
    assert isinstance(first, DeviceFault) and isinstance(second, StageStopped)  # r2 was not in the step
    assert loop._thread is not None
    loop._thread.join(5)
    assert aborted == [1]
    loop.stop()


def test_health_fails_while_one_step_runs_past_the_bound_and_recovers_once_it_ends() -> None:
    entered, release = threading.Event(), threading.Event()
    pending = [True]

    def hung_step() -> list:  # a forward on a hung device
        entered.set()
        release.wait(10)
        pending.clear()
        return []

    loop = StepLoop(hung_step, lambda: bool(pending), lambda: None)
    try:
        loop.submit(None, lambda: None)
        assert entered.wait(5)
        time.sleep(0.05)
        loop.check_health(stuck_after_s=10.0)  # within the bound: healthy
        with pytest.raises(RuntimeError, match="one step has run for"):
            loop.check_health(stuck_after_s=0.01)
        release.set()
        deadline = time.monotonic() + 5
        while loop._step_started is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.check_health(stuck_after_s=0.01)  # no step under way: healthy again
    finally:
        release.set()
        loop.stop()


def test_an_infinite_interval_sends_the_first_output_then_everything_else_as_one_at_the_end() -> None:
    n = 30
    first_taken = threading.Event()

    async def run() -> list[RequestOutput]:
        loop = idle_loop()
        loop.open("r")

        def produce() -> None:
            for i in range(1, n + 1):
                loop._deliver("r", out(i, str(i % 10), n=i, finished=i == n))
                if i == 1:  # the consumer may wake late on a busy machine: wait until it has the first
                    first_taken.wait(5)
                time.sleep(0.001)

        threading.Thread(target=produce, daemon=True).start()
        got = []
        async for o in loop.outputs("r", merge=merge_outputs, interval_s=lambda: math.inf):
            got.append(o)
            first_taken.set()
        return got

    got = asyncio.run(asyncio.wait_for(run(), 10))
    assert [o.new_token_ids for o in got] == [[1], list(range(2, n + 1))]  # the first at once, then the rest
    assert got[-1].finished and "".join(o.new_text for o in got) == "".join(str(i % 10) for i in range(1, n + 1))


def test_an_action_taken_off_the_queue_counts_as_busy_until_it_has_run() -> None:
    loop, running, release = idle_loop(), threading.Event(), threading.Event()

    def slow_action() -> None:
        running.set()
        release.wait(10)

    loop.submit(None, slow_action)
    try:
        try:
            assert running.wait(10)
            assert loop.busy()  # NOTE: the queue is empty and the stage has no work: only the action in flight
        finally:
            release.set()
        deadline = time.monotonic() + 10
        while loop.busy() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not loop.busy()
    finally:
        loop.stop()


def test_a_step_under_way_when_a_request_is_aborted_does_not_hand_its_output_to_a_new_consumer_of_that_id() -> None:
    """The old request's step ends after its consumer left and a new one opened the same id: the new one gets
    only the outputs of steps after its own add."""
    in_step, release = threading.Event(), threading.Event()
    emitted = [RequestOutput("r", [1], "old", True, "stop", 5, 1)]  # the old request's, from the step under way

    def step() -> list:
        if emitted:
            in_step.set()
            release.wait(5)
            return [emitted.pop()]
        return [RequestOutput("r", [2], "new", True, "stop", 5, 1)]

    async def run() -> list:
        loop = StepLoop(step, lambda: True, lambda: None)
        try:
            loop.open("r")
            loop.submit("r", lambda: None)  # the old request's add; its step starts and is held
            assert await asyncio.to_thread(in_step.wait, 5)
            loop._channels.pop("r")  # the old consumer leaves (aborted) while that step runs
            loop.open("r")  # the same id again, its add queued behind the step under way
            loop.submit("r", lambda: None)
            release.set()
            return [o.new_text async for o in loop.outputs("r")]
        finally:
            loop.stop()

    assert asyncio.run(asyncio.wait_for(run(), 10)) == ["new"]


def test_an_older_action_under_a_reused_id_does_not_make_a_new_consumer_take_the_old_requests_outputs() -> None:
    """An action of the old request (a late fetch's) that the thread took before the id was opened again joins
    the old consumer only: the step run before the old request's abort does not hand its output to the new one."""
    live: list[str] = []  # what the stage holds, by the text its step emits for it
    step_in, step_go = threading.Event(), threading.Event()
    blocker_in, blocker_go = threading.Event(), threading.Event()

    def step() -> list:
        if not step_go.is_set():  # the old request's step under way
            step_in.set()
            step_go.wait(5)
        return [RequestOutput("r", [1], text, text == "new", "stop" if text == "new" else None, 5, 1)
                for text in live]

    def blocker() -> None:  # NOTE: taken in one batch with the stale action; holds it back until the id is reopened
        blocker_in.set()
        blocker_go.wait(5)

    async def run() -> list[str]:
        loop = StepLoop(step, lambda: bool(live), lambda: None)
        try:
            loop.open("r")
            loop.submit("r", lambda: live.append("old"))
            assert await asyncio.to_thread(step_in.wait, 5)
            loop.submit(None, blocker)
            loop.submit("r", lambda: None)  # the old request's late action (e.g. its embeddings arriving)
            step_go.set()
            assert await asyncio.to_thread(blocker_in.wait, 5)
            loop._channels.pop("r")  # the old consumer leaves; its abort and the new request's add are queued
            loop.open("r")
            loop.submit(None, lambda: live.remove("old"))
            loop.submit("r", lambda: live.append("new"))
            blocker_go.set()
            return [o.new_text async for o in loop.outputs("r")]
        finally:
            loop.stop()

    assert asyncio.run(asyncio.wait_for(run(), 10)) == ["new"]


def test_an_older_action_that_fails_under_a_reused_id_fails_neither_the_new_consumer_nor_the_step(
        caplog: pytest.LogCaptureFixture) -> None:
    """The old request's action (its failed encoder call's report) runs after the id was opened again: its error
    goes to the consumer it was submitted for, which has gone (logged), not to the new one."""
    live: list[str] = []
    blocker_in, blocker_go = threading.Event(), threading.Event()

    def step() -> list:
        return [RequestOutput("r", [1], text, True, "stop", 5, 1) for text in live]

    def blocker() -> None:  # holds the queue until the id is reopened
        blocker_in.set()
        blocker_go.wait(5)

    def old_failure() -> None:
        raise ValueError("the old request's encoder call failed")

    async def run() -> list[str]:
        loop = StepLoop(step, lambda: bool(live), lambda: None)
        try:
            loop.submit(None, blocker)
            assert await asyncio.to_thread(blocker_in.wait, 5)
            loop.open("r")
            loop.submit("r", old_failure)
            loop._channels.pop("r")  # the old consumer leaves
            loop.open("r")
            loop.submit("r", lambda: live.append("new"))
            blocker_go.set()
            async with contextlib.aclosing(loop.outputs("r")) as outputs:
                return [o async for o in outputs]
        finally:
            loop.stop()

    caplog.set_level(logging.INFO, logger="mmserve.runtime.step_loop")
    [new] = asyncio.run(asyncio.wait_for(run(), 10))
    assert isinstance(new, RequestOutput) and new.new_text == "new"
    assert "an action for request r failed after its consumer left" in caplog.text  # not silently dropped


def test_a_failure_after_a_finished_output_ends_nothing() -> None:
    """A request finished in one step, its consumer not there yet; the next step failed whole: it finished."""
    got = asyncio.run(_collect(idle_loop(), [out(1, "a", n=1, finished=True), RequestFailed("r", ValueError("x"))],
                               merge_outputs))
    assert [(o.new_token_ids, o.finished) for o in got] == [([1], True)]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
@pytest.mark.parametrize("how", ["step", "abort_all"])
def test_a_step_thread_that_dies_fails_whoever_waits_and_whatever_comes_later(how: str) -> None:
    """A BaseException out of a step, or an abort_all that fails after a failed step (the stage's books broken):
    nothing will step again, so nothing may wait for it: the named requests get the step's error, the rest and
    every later submission or call StageStopped, at once."""
    def step() -> list:
        raise SystemExit("the step thread ends") if how == "step" else RuntimeError("a step failed whole")

    def abort_all() -> None:
        raise ValueError("the books are broken")

    async def run() -> list[BaseException]:
        loop = StepLoop(step, lambda: True, abort_all)
        loop.open("r")
        loop.submit("r", lambda: None)
        errors: list[BaseException] = []
        for rid in ("r", "late"):
            if rid == "late":
                loop.open("late")
                loop.submit("late", lambda: None)
            try:
                async for _ in loop.outputs(rid):
                    pass
            except BaseException as exc:
                errors.append(exc)
        with pytest.raises(StageStopped, match="died"):
            await loop.call(lambda: 42)
        assert loop._thread is not None
        await asyncio.to_thread(loop._thread.join, 5)  # NOTE: its death reported within this test (its filter)
        return errors

    first, late = asyncio.run(asyncio.wait_for(run(), 10))
    if how == "step":
        assert isinstance(first, StageStopped) and "died" in str(first)
    else:
        assert isinstance(first, RuntimeError) and str(first) == "a step failed whole"  # its own error
    assert isinstance(late, StageStopped) and "died" in str(late)


def test_a_call_racing_a_stop_on_another_thread_fails_and_does_not_hang() -> None:
    """stop() on another thread between a call's check and its registration: the call is failed, not left."""
    class Racing(dict):
        def __setitem__(self, key: object, value: object) -> None:
            threading.Thread(target=loop.stop).start()
            time.sleep(0.05)  # NOTE: room for the stop to run to its end, were it not held off
            super().__setitem__(key, value)

    loop = StepLoop(lambda: [], lambda: False, lambda: None)
    loop._calls = Racing()

    async def run() -> object:
        return await asyncio.wait_for(loop.call(lambda: 42), 5)

    try:
        answer = asyncio.run(run())
    except StageStopped:
        answer = None
    assert answer in (42, None)  # run before the stop, or failed by it


def test_a_consumer_whose_loop_closed_while_it_was_not_waiting_loses_its_channel_at_the_next_delivery() -> None:
    """Its loop closed with the consumer parked (not in `take`): what comes for it is not kept for ever, and its
    id can be opened again."""
    loop = idle_loop()
    consumer = asyncio.new_event_loop()

    async def open_it() -> None:
        loop.open("r")

    consumer.run_until_complete(open_it())
    consumer.close()
    loop._deliver("r", out(1, "a", n=1))
    assert not loop.has_consumer("r")
