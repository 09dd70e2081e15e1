"""Every replica's latest metrics, summed into one snapshot: what the metrics hub keeps.

Owns: the latest snapshot of each source (a replica), when each came, and the rules for sources gone quiet: past
`STALE_AFTER_S` a source's gauges stop counting (its counters and histograms stay), past `RETIRE_AFTER_S` its
counters are folded into one sum and its entry dropped, so the board does not grow with every replica ever started.
A source that says it is going (`report(..., final=True)`: a replica shutting down) is retired at once with its last
counts; once the buckets a histogram's retired sum is in lack a bound every live source has (a release moved them),
that sum is dropped (one reset). Reports carry their number (`seq`, from 1): one older than the source's last is
dropped (a push that timed out and landed late, or raced the last). A source whose first report here is not its
first report (`seq` > 1) counted before, elsewhere or before it retired here: it counts from that report (its base)
on. So a replaced hub (its node lost, or an edit of the app's arguments, which replaces every replica) is a
restarted exporter whose counters start again from zero, rather than one whose counters fall and then jump back by
every replica's lifetime count (which Prometheus's `rate()` reads as that many new events); and a source retired for
its silence that comes back is not counted twice. Reports without a number (tests) from a retired source are dropped
instead. The names kept for that are bounded (`NAMES_KEPT`).
Thread-safe (the hub's handlers may run in Serve's thread pool).
Does not own what is measured nor the snapshot's arithmetic (metrics.py), nor how snapshots travel
(deployments/metrics_hub.py).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mmserve.runtime.metrics import HistogramValue, Metric, MetricsSnapshot, merge, since

STALE_AFTER_S = 30.0  # a source silent this long is gone: its gauges stop counting, its counters stay (s)
RETIRE_AFTER_S = 600.0  # ...and this long: its counters are folded into one sum and its entry dropped (s)
NAMES_KEPT = 4096  # sources whose latest `seq`, and retired sources whose names, are remembered (sources)


class MetricsBoard:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._latest: dict[str, tuple[float, MetricsSnapshot]] = {}  # source -> (time, its counts here)
        self._retired = MetricsSnapshot()  # the counters of sources long gone, summed into one
        self._retired_sources: OrderedDict[str, None] = OrderedDict()  # the latest NAMES_KEPT retired
        self._bases: dict[str, MetricsSnapshot] = {}  # source -> its counts before its first report here
        self._seqs: OrderedDict[str, int] = OrderedDict()  # source -> its latest report's `seq` (retired too)
        self._lock = threading.Lock()

    @property
    def sources(self) -> list[str]:
        """The sources with an entry (not retired)."""
        with self._lock:
            return list(self._latest)

    def report(self, source: str, snapshot: MetricsSnapshot, final: bool = False, *, seq: int | None = None) -> None:
        """`source`'s latest snapshot; `final`: its last (it is going), retired at once; `seq`: the report's
        number among the source's, from 1."""
        with self._lock:
            self._retire_silent(self._clock())  # NOTE: here too: a board nobody scrapes must not keep the dead
            if seq is None and source in self._retired_sources:  # (its counters are in `_retired` already)
                return
            if seq is not None:
                if seq <= self._seqs.get(source, 0):
                    return
                _keep(self._seqs, source, seq)
            if source not in self._latest:
                self._bases.pop(source, None)
                if seq is not None and seq > 1:  # it counted before this report, not here
                    self._bases[source] = snapshot
            base = self._bases.get(source)
            self._latest[source] = (self._clock(), snapshot if base is None else since(snapshot, base))
            if final:
                self._retire([source])

    def collect(self) -> MetricsSnapshot:
        with self._lock:
            now = self._clock()
            self._retire_silent(now)
            self._retired = _on_bounds(self._retired, self._live_bounds())
            snapshots = [s if now - t < STALE_AFTER_S else _without_gauges(s) for t, s in self._latest.values()]
            return merge([self._retired, *snapshots])

    def _live_bounds(self) -> dict[str, set[tuple[float, ...]]]:
        """Histogram name -> the bucket bounds the live sources report it with."""
        bounds: dict[str, set[tuple[float, ...]]] = {}
        for _, snapshot in self._latest.values():
            for name, metric in snapshot.metrics.items():
                if metric.kind == "histogram":
                    bounds.setdefault(name, set()).update(
                        v.bounds for v in metric.values.values() if isinstance(v, HistogramValue))
        return bounds

    def _retire_silent(self, now: float) -> None:
        """Retire the sources silent past RETIRE_AFTER_S (under the lock)."""
        self._retire([source for source, (t, _) in self._latest.items() if now - t > RETIRE_AFTER_S])

    def _retire(self, sources: list[str]) -> None:
        """Fold the counters of `sources` into the retired sum and drop their entries (under the lock)."""
        if sources:
            self._retired = merge([self._retired, *(_without_gauges(self._latest.pop(s)[1]) for s in sources)])
            for source in sources:
                self._bases.pop(source, None)
                _keep(self._retired_sources, source, None)


def _keep(names: OrderedDict[str, Any], name: str, value: Any) -> None:
    """Set `names[name]` as the newest, forgetting the oldest past NAMES_KEPT."""
    names[name] = value
    names.move_to_end(name)
    while len(names) > NAMES_KEPT:
        names.popitem(last=False)


def _on_bounds(snapshot: MetricsSnapshot, live: dict[str, set[tuple[float, ...]]]) -> MetricsSnapshot:
    """`snapshot` (the retired sum) without its histograms whose buckets lack a bound every live source has.

    NOTE: a release that changed a histogram's buckets: while replicas of both versions live, they and the retired
    sum add up on the bounds they share (`HistogramValue.__add__`); once the last old one is gone, the retired sum,
    kept in the old buckets, would hide the new ones for good. Dropped then, once: one counter reset to Prometheus."""
    def kept(metric: Metric) -> bool:  # NOTE: its bounds hold every bound the live sources share (all they sum on)
        if metric.kind != "histogram" or not live.get(metric.name):
            return True
        shared = set.intersection(*(set(bounds) for bounds in live[metric.name]))
        return all(shared <= set(v.bounds) for v in metric.values.values() if isinstance(v, HistogramValue))

    return MetricsSnapshot({n: m for n, m in snapshot.metrics.items() if kept(m)})


def _without_gauges(snapshot: MetricsSnapshot) -> MetricsSnapshot:
    return MetricsSnapshot({n: m for n, m in snapshot.metrics.items() if m.kind != "gauge"})
