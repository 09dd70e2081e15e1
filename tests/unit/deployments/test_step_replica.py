"""deployments/step_replica.py: an Encoder or Decoder replica's health probe and graceful shutdown."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

from deployments import step_replica
from deployments.step_replica import StepReplica


class Loop:
    def __init__(self) -> None:
        self.dead = False
        self.on_death: Any = None

    def died(self) -> bool:
        return self.dead


class Service:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.loop = Loop()

    def check_health(self, stuck_after_s: float | None = None) -> None:
        self.log.append(f"health {stuck_after_s}")
        if self.loop.dead:
            raise RuntimeError("the step thread died")
        if stuck_after_s is not None and stuck_after_s < 1:
            raise RuntimeError("one step has run too long")

    def stop(self) -> None:
        self.log.append("stop")


class Reporter:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def close(self) -> None:
        self.log.append("last metrics")


# NOTE: Python's collector calls __del__ too, making a coroutine nobody awaits (Serve awaits it on shutdown)
@pytest.mark.filterwarnings("ignore:coroutine 'StepReplica.__del__' was never awaited")
def test_the_probe_passes_the_hung_step_bound_and_shutdown_pushes_the_last_metrics_before_the_thread_stops() -> None:
    log: list[str] = []
    exited = threading.Event()
    replica = StepReplica()
    replica.service, replica.stuck_after_s = Service(log), 60.0
    replica.reporter = Reporter(log)  # type: ignore[attr-defined]

    def exit_process(code: int) -> None:  # NOTE: a stand-in for os._exit
        log.append(f"exit {code}")
        exited.set()

    replica.exit_process = exit_process
    replica.check_health()
    replica.stuck_after_s = 0.5
    with pytest.raises(RuntimeError, match="too long"):  # a long step may still end: the process goes on
        replica.check_health()
    assert not exited.wait(step_replica.EXIT_AFTER_S + 0.5)
    replica.service.loop.dead = True
    with pytest.raises(RuntimeError, match="died"):
        replica.check_health()
    assert exited.wait(10)  # nothing will step again: the process exits, so the calls it holds fail over at once
    asyncio.run(replica.__del__())
    assert log == ["health 60.0", "health 0.5", "health 0.5", "exit 1", "last metrics", "stop"]
    asyncio.run(StepReplica().__del__())  # a replica whose __init__ failed: nothing to close


@pytest.mark.filterwarnings("ignore:coroutine 'StepReplica.__del__' was never awaited")
def test_shutdown_joins_the_step_thread_off_the_loop_which_that_thread_may_be_waiting_on() -> None:
    """The step thread may be inside a call made through the replica's loop (a lost copy asked for again) when
    the shutdown joins it: joined on the loop, each waited for the other (30 s)."""
    class WaitsOnTheLoop(Service):
        def stop(self) -> None:  # the join: done once a call that needs the replica's loop has run there
            ran = threading.Event()
            loops[0].call_soon_threadsafe(ran.set)
            self.log.append("stop" if ran.wait(5) else "stop waited on a blocked loop")

    log: list[str] = []
    loops: list[asyncio.AbstractEventLoop] = []  # the replica's
    replica = StepReplica()
    replica.service, replica.stuck_after_s = WaitsOnTheLoop(log), 60.0

    async def shut_down() -> None:
        loops.append(asyncio.get_running_loop())
        await replica.__del__()

    asyncio.run(shut_down())
    assert log == ["stop"]


@pytest.mark.filterwarnings("ignore:coroutine 'StepReplica.__del__' was never awaited")
def test_the_process_exits_once_the_step_thread_dies_not_at_the_next_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until then every call would be answered StageStopped at once, and routers choosing the least loaded
    replica or a cache's owner would keep sending work there; a probe failing after it starts no second exit."""
    monkeypatch.setattr(step_replica, "EXIT_AFTER_S", 0.01)
    log: list[str] = []
    exited = threading.Event()
    replica = StepReplica()
    replica.service, replica.stuck_after_s = Service(log), 60.0

    def exit_process(code: int) -> None:
        log.append(f"exit {code}")
        exited.set()

    replica.exit_process = exit_process
    replica.watch_step_thread()
    replica.service.loop.dead = True
    replica.service.loop.on_death()  # what StepLoop._run calls as the thread ends
    first = replica._exiting
    assert exited.wait(5)
    with pytest.raises(RuntimeError, match="died"):
        replica.check_health()
    assert replica._exiting is first and log == ["exit 1", "health 60.0"]  # no second exit started
    del replica
    gc.collect()  # NOTE: Python's own call of __del__ (a coroutine nobody awaits) falls inside this test
