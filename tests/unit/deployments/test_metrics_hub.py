"""metrics_hub.py's reporter and the resident-memory gauge (the hub's rules: test_metrics_board.py)."""

from __future__ import annotations

import asyncio
import logging
import typing
from typing import Any

import pytest

from deployments import metrics_hub
from mmserve.runtime.metrics import Metric, MetricsSnapshot, merge, snapshot_of
from mmserve.runtime.process_memory import RESIDENT_BYTES, resident_bytes, resident_memory_snapshot


def _snap(requests: float, running: float) -> MetricsSnapshot:
    return snapshot_of(Metric("mmserve_requests_total", "counter", "", (), {(): requests}),
                       Metric("mmserve_decoder_running_requests", "gauge", "", (), {(): running}))


def test_resident_memory_is_one_series_per_replica() -> None:
    assert 10 << 20 < resident_bytes() < 1 << 40  # any Python process
    merged = merge([resident_memory_snapshot("Decoder#a"), resident_memory_snapshot("Encoder#b")])
    assert set(merged.metrics[RESIDENT_BYTES].values) == {("Decoder#a",), ("Encoder#b",)}


def test_overlapping_pushes_mirror_each_increment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's push and a GET /metrics' push may overlap; their snapshots reach Ray's mirror in the order
    they were taken, so no counter increment is counted twice."""
    total = iter([1.0, 3.0, 4.0])  # the replica's counter at each snapshot
    increments: list[float] = []

    class Counter:
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

        def inc(self, value: float, tags: dict[str, str]) -> None:
            increments.append(value)

    monkeypatch.setattr(metrics_hub.ray_metrics, "Counter", Counter)
    monkeypatch.setattr(metrics_hub, "resident_memory_snapshot", lambda source: MetricsSnapshot())

    class Hub:  # answers the first report last
        def __init__(self) -> None:
            self.delays = iter([0.05, 0.0, 0.0])

        async def _report(self, source: str, snapshot: MetricsSnapshot, final: bool = False, **order: Any) -> None:
            await asyncio.sleep(next(self.delays))

        @property
        def report(self) -> Any:
            return typing.cast(Any, type("Method", (), {"remote": staticmethod(self._report)}))

    reporter = object.__new__(metrics_hub.MetricsReporter)
    reporter.source, reporter.hub = "Decoder#1", Hub()
    reporter.snapshot = lambda: snapshot_of(Metric("mmserve_requests_total", "counter", "", (), {(): next(total)}))
    reporter.mirror, reporter._pushing = metrics_hub._RayMirror("Decoder"), asyncio.Lock()
    reporter._seq = 0

    async def run() -> None:
        await asyncio.gather(reporter.push(), reporter.push())
        await reporter.push()

    asyncio.run(run())
    assert sum(increments) == 4.0, increments  # the counter's last value: each increment mirrored once


class SilentHub:
    """A hub that is down: its calls never answer (unless `answering`); the reports that did are recorded."""

    def __init__(self) -> None:
        self.answering, self.reports = False, list[tuple[str, bool]]()

    async def _report(self, source: str, snapshot: MetricsSnapshot, final: bool = False, **order: Any) -> None:
        if not self.answering:
            await asyncio.Event().wait()
        self.reports.append((source, final))

    @property
    def report(self) -> Any:
        return typing.cast(Any, type("Method", (), {"remote": staticmethod(self._report)}))


def _reporter(hub: Any) -> metrics_hub.MetricsReporter:
    reporter = object.__new__(metrics_hub.MetricsReporter)
    reporter.source, reporter.hub, reporter._task = "Ingress#1", hub, None
    reporter.snapshot = lambda: _snap(1, 0)
    reporter.mirror, reporter._pushing = metrics_hub._RayMirror("Ingress"), asyncio.Lock()
    reporter._seq = 0
    return reporter


def test_a_push_to_a_hub_that_does_not_answer_ends_at_its_timeout_and_holds_no_later_push(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_hub, "HUB_TIMEOUT_S", 0.05)
    monkeypatch.setattr(metrics_hub, "resident_memory_snapshot", lambda source: MetricsSnapshot())
    hub = SilentHub()
    reporter = _reporter(hub)

    mirrored: list[MetricsSnapshot] = []
    reporter.mirror.update = mirrored.append  # type: ignore[method-assign,assignment]

    async def run() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reporter.push(), 5)
        assert len(mirrored) == 1  # Ray's copy goes on while the hub does not answer
        hub.answering = True
        await asyncio.wait_for(reporter.push(), 5)  # the lock was let go
        await asyncio.wait_for(reporter.close(), 5)

    asyncio.run(run())
    assert hub.reports == [("Ingress#1", False), ("Ingress#1", True)]  # the last push says it is the last


def test_a_hub_that_is_down_is_logged_when_pushes_begin_to_fail_then_once_a_minute_and_when_they_succeed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(metrics_hub, "HUB_TIMEOUT_S", 0.01)
    monkeypatch.setattr(metrics_hub, "FAILURE_LOG_INTERVAL_S", 0.2)
    monkeypatch.setattr(metrics_hub, "resident_memory_snapshot", lambda source: MetricsSnapshot())
    caplog.set_level(logging.INFO, logger="deployments.metrics_hub")
    hub = SilentHub()
    reporter = _reporter(hub)
    reporter.interval_s = 0.01

    def records() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "deployments.metrics_hub"]

    async def run() -> None:
        loop = asyncio.create_task(reporter._loop())
        await asyncio.sleep(0.5)  # ~25 failed pushes (fewer on a busy machine: the logging goes by time)
        hub.answering = True
        for _ in range(500):  # NOTE: until the next push got through, however long a busy machine takes
            if any(r.getMessage().startswith("metrics from Ingress#1 pushed again") for r in records()):
                break
            await asyncio.sleep(0.01)
        loop.cancel()

    asyncio.run(run())
    told = [r.getMessage() for r in records()]
    assert 2 <= len(told) <= 5 and told[0] == "pushing metrics from Ingress#1 failed for 0 s: TimeoutError()", told
    assert all("failed for" in m for m in told[1:-1]) and told[-1].startswith("metrics from Ingress#1 pushed again")
    assert records()[0].exc_info and not any(r.exc_info for r in records()[1:])


def test_a_hub_that_fails_now_and_then_is_logged_at_most_once_an_interval(monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(metrics_hub, "FAILURE_LOG_INTERVAL_S", 60.0)
    monkeypatch.setattr(metrics_hub, "resident_memory_snapshot", lambda source: MetricsSnapshot())
    caplog.set_level(logging.INFO, logger="deployments.metrics_hub")
    reporter = _reporter(SilentHub())
    reporter.interval_s = 0.0
    pushes = iter([False, True] * 20)  # fails, succeeds, fails, ...

    class Done(BaseException):  # NOTE: not an Exception, which the loop takes for a failed push
        pass

    async def push(final: bool = False) -> None:
        ok = next(pushes, None)
        if ok is None:
            raise Done
        if not ok:
            raise TimeoutError

    reporter.push = push  # type: ignore[method-assign]
    with pytest.raises(Done):  # after 40 pushes
        asyncio.run(reporter._loop())
    assert [r.levelname for r in caplog.records if r.name == "deployments.metrics_hub"] == ["WARNING", "INFO"]


def test_closing_with_the_hub_gone_ends_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_hub, "HUB_TIMEOUT_S", 0.05)
    monkeypatch.setattr(metrics_hub, "resident_memory_snapshot", lambda source: MetricsSnapshot())
    asyncio.run(asyncio.wait_for(_reporter(SilentHub()).close(), 5))  # no error: the app may be going too


def _observed_by_ray(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Ray's Histogram replaced by one that records every value observed into the returned list."""
    observed: list[float] = []

    class Histogram:
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

        def observe(self, value: float, tags: dict[str, str]) -> None:
            observed.append(value)

    monkeypatch.setattr(metrics_hub.ray_metrics, "Histogram", Histogram)
    return observed


def test_a_burst_of_observations_reaches_rays_mirror_over_the_next_pushes(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmserve.runtime.metrics import HistogramValue

    observed = _observed_by_ray(monkeypatch)
    monkeypatch.setattr(metrics_hub, "MIRROR_REPLAY", 10)
    mirror = metrics_hub._RayMirror("Ingress")

    def snap(counts: tuple[int, int, int]) -> MetricsSnapshot:
        value = HistogramValue((1.0, 2.0), counts, 0.0)
        return snapshot_of(Metric("mmserve_ttft_seconds", "histogram", "", (), {(): value}))

    mirror.update(snap((25, 3, 0)))  # more in one bucket than a push replays
    assert (observed.count(1.0), observed.count(2.0)) == (10, 3)
    mirror.update(snap((25, 3, 1)))
    mirror.update(snap((25, 3, 1)))
    assert (observed.count(1.0), observed.count(2.0), observed.count(4.0)) == (25, 3, 1)  # caught up, none lost
    mirror.update(snap((25, 3, 1)))
    assert len(observed) == 29  # nothing replayed twice


def test_a_rate_no_push_keeps_up_with_leaves_rays_mirror_a_bounded_backlog(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three pushes' worth of observations every push: the mirror replays its share each time and drops what is past
    its backlog, instead of falling further behind (and replaying more) for ever."""
    from mmserve.runtime.metrics import HistogramValue

    observed = _observed_by_ray(monkeypatch)
    monkeypatch.setattr(metrics_hub, "MIRROR_REPLAY", 10)
    monkeypatch.setattr(metrics_hub, "MIRROR_BACKLOG", 50)
    mirror = metrics_hub._RayMirror("Ingress")
    for push in range(1, 101):
        value = HistogramValue((1.0,), (30 * push, 0), 0.0)
        mirror.update(snapshot_of(Metric("mmserve_ttft_seconds", "histogram", "", (), {(): value})))
        assert len(observed) == 10 * push  # the same share replayed every push
        last = mirror._last[("mmserve_ttft_seconds", ())]
        assert 30 * push - last.counts[0] <= 50  # left for later: bounded
