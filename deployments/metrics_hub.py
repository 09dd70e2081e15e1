"""Metrics of every replica, summed: a hub deployment and the reporter each replica runs.

Owns the Ray side of metrics: each replica pushes its `MetricsSnapshot` to the one `MetricsHub`
replica every `metrics_push_interval_s` (and the ingress right before it answers `GET /metrics`);
the hub keeps the latest snapshot of every replica on a `MetricsBoard`. Each push also mirrors the values into
`ray.util.metrics`, so a Ray cluster's Prometheus/Grafana sees them too. Does not own what is measured
(mmserve/runtime/metrics.py) nor the board's rules for replicas gone quiet (mmserve/runtime/metrics_board.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ray import serve
from ray.util import metrics as ray_metrics

from deployments.handles import awaited, hold
from deployments.replica_logs import route_logs
from mmserve.runtime.metrics import HistogramValue, Metric, MetricsSnapshot, merge
from mmserve.runtime.metrics_board import MetricsBoard
from mmserve.runtime.process_memory import resident_memory_snapshot

log = logging.getLogger(__name__)
# NOTE: a hub call answers in about a millisecond: this long means the hub is down or being replaced, and a push
# (or a scrape) that waited on would hold the next ones behind it
HUB_TIMEOUT_S = 2.0
FAILURE_LOG_INTERVAL_S = 60.0  # failing pushes are logged when they begin, then at most this often (s)
MIRROR_REPLAY = 1000  # observations of one histogram bucket replayed into Ray's mirror per push
MIRROR_BACKLOG = 10 * MIRROR_REPLAY  # observations of one bucket left for later pushes at most; the rest dropped


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  logging_config={"enable_access_log": False})  # NOTE: internal calls; no per-call log line
class MetricsHub:
    def __init__(self) -> None:
        route_logs()
        self.board = MetricsBoard()

    def report(self, source: str, snapshot: MetricsSnapshot, final: bool = False, seq: int | None = None) -> None:
        self.board.report(source, snapshot, final, seq=seq)

    def collect(self) -> MetricsSnapshot:
        return self.board.collect()


class MetricsReporter:
    """Runs in a replica: pushes `snapshot()` to the hub periodically and mirrors it into Ray."""

    def __init__(self, hub: Any, deployment: str, snapshot: Callable[[], MetricsSnapshot], interval_s: float):
        context = serve.get_replica_context()
        self.source = f"{deployment}#{context.replica_id.unique_id}"
        self.hub, self.snapshot, self.interval_s = hold(hub), snapshot, interval_s
        self.mirror = _RayMirror(deployment)
        # pushes made; each carries its number: the hub drops one that lands late, and counts a replica whose first
        # push there is not its first from that push on (MetricsBoard)
        self._seq = 0
        self._task: asyncio.Task | None = None
        # NOTE: one push at a time (the loop's and a GET /metrics' may overlap): the mirror turns successive
        # snapshots into increments, and an older one applied after a newer one counted the gap twice
        self._pushing = asyncio.Lock()

    def ensure_started(self) -> None:
        """Start the push loop if it is not running; a no-op off the replica's event loop thread.

        NOTE: Serve runs replica constructors on the user event loop's thread, so calling this at the
        end of `__init__` starts reporting before the first request; handlers call it again, cheaply.
        """
        if self._task is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a sync method in Serve's thread pool
            return
        self._task = loop.create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        """On the replica's graceful shutdown (its requests have ended): stop, and push the last counts, which
        the hub folds into its sum of gone replicas at once (its gauges no longer count)."""
        self.stop()
        try:
            await self.push(final=True)
        except Exception as exc:  # NOTE: the hub may be going too (the whole app is)
            log.info("the last metrics of %s were not pushed: %r", self.source, exc)

    async def push(self, final: bool = False) -> None:
        """This replica's snapshot to the hub (TimeoutError past HUB_TIMEOUT_S), then into Ray's metrics."""
        async with self._pushing:
            snapshot = merge([self.snapshot(), resident_memory_snapshot(self.source)])
            self._seq += 1
            try:
                sent = self.hub.report.remote(self.source, snapshot, final, seq=self._seq)
                await asyncio.wait_for(awaited(sent), HUB_TIMEOUT_S)
            finally:  # NOTE: Ray's copy goes on while the hub is unreachable: the one view left then
                self.mirror.update(snapshot)

    async def _loop(self) -> None:
        failing_since: float | None = None  # when the pushes began to fail (monotonic s); None = they succeed
        told = -FAILURE_LOG_INTERVAL_S  # when a failure was last logged (monotonic s)
        logged = False  # whether a failure of the present run of them was logged
        while True:
            try:
                await self.push()
                if failing_since is not None and logged:
                    log.info("metrics from %s pushed again after %.0f s", self.source, time.monotonic() - failing_since)
                failing_since, logged = None, False
            except Exception as exc:  # metrics must never take a replica down
                now = time.monotonic()
                first = failing_since is None
                if failing_since is None:
                    failing_since = now
                # NOTE: at most once a minute, the first of a run with its traceback: every replica pushes every few
                # seconds, and a hub that is down (being replaced) or slow now and then would fill every log
                if now - told >= FAILURE_LOG_INTERVAL_S:
                    log.warning("pushing metrics from %s failed for %.0f s: %r", self.source, now - failing_since, exc,
                                exc_info=first)
                    told, logged = now, True
            await asyncio.sleep(self.interval_s)


class _RayMirror:
    """Keeps `ray.util.metrics` objects in step with successive snapshots of one replica."""

    def __init__(self, deployment: str):
        self.tags = {"stage": deployment}
        self._objects: dict[str, Any] = {}
        self._last: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._dropping: set[tuple[str, tuple[str, ...]]] = set()  # histograms whose excess was dropped (logged once)

    def update(self, snapshot: MetricsSnapshot) -> None:
        for metric in snapshot.metrics.values():
            for labels, value in metric.values.items():
                tags = {**self.tags, **dict(zip(metric.labels, labels, strict=True))}
                self._apply(metric, labels, value, tags)

    def _apply(self, metric: Metric, labels: tuple[str, ...], value: Any, tags: dict[str, str]) -> None:
        obj = self._object(metric)
        key = (metric.name, labels)
        last = self._last.get(key)
        if metric.kind == "gauge":
            obj.set(value, tags=tags)
        elif metric.kind == "counter":
            delta = value - (last or 0.0)
            if delta > 0:
                obj.inc(delta, tags=tags)
        else:  # histogram: replay the new observations bucket by bucket at the bucket's bound
            # NOTE: at most MIRROR_REPLAY a bucket per push (each is a call on the replica's event loop); the rest
            # go with the next pushes, so the mirror's counts catch up after a burst. Past MIRROR_BACKLOG left over
            # (a sustained rate no push keeps up with) the excess is dropped: the mirror under-counts that bucket
            # rather than falling further behind for ever. Its sums are approximate (bounds).
            previous = last or replace(value, counts=(0,) * len(value.counts), sum=0.0)
            new = _diff(value, previous)
            replayed = [min(n, MIRROR_REPLAY) for n in new]
            dropped = [max(0, n - r - MIRROR_BACKLOG) for n, r in zip(new, replayed, strict=True)]
            for bound, n in zip((*value.bounds, value.bounds[-1] * 2), replayed, strict=True):
                for _ in range(n):
                    obj.observe(bound, tags=tags)
            if any(dropped) and key not in self._dropping:
                self._dropping.add(key)
                log.warning("Ray's copy of %s falls behind its observations: the excess is dropped", metric.name)
            value = replace(value, counts=tuple(p + r + d for p, r, d in zip(previous.counts, replayed, dropped,
                                                                            strict=True)))
        self._last[key] = value

    def _object(self, metric: Metric) -> Any:
        if metric.name not in self._objects:
            keys = ("stage", *metric.labels)
            if metric.kind == "counter":
                # NOTE: Ray appends "_total" to counters itself.
                obj: Any = ray_metrics.Counter(metric.name.removesuffix("_total"), metric.help, tag_keys=keys)
            elif metric.kind == "gauge":
                obj = ray_metrics.Gauge(metric.name, metric.help, tag_keys=keys)
            else:
                first = next(iter(metric.values.values()), None)
                bounds = list(first.bounds) if isinstance(first, HistogramValue) else [1.0]
                obj = ray_metrics.Histogram(metric.name, metric.help, boundaries=bounds, tag_keys=keys)
            self._objects[metric.name] = obj
        return self._objects[metric.name]


def _diff(a: HistogramValue, b: HistogramValue) -> list[int]:
    return [x - y for x, y in zip(a.counts, b.counts, strict=True)]
