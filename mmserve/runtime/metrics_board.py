"""Every replica's latest metrics, summed into one snapshot: what the metrics hub keeps.

Owns: the latest snapshot of each source (a replica), when each came, and the rules for sources gone quiet:
past `STALE_AFTER_S` a source's gauges stop counting (its counters and histograms stay), past
`RETIRE_AFTER_S` its counters are folded into one sum and its entry dropped, so the board does not grow with
every replica ever started; a late report from a retired source is dropped (its counts are in the sum).
Does not own what is measured nor the snapshot's arithmetic (metrics.py), nor how snapshots travel
(deployments/metrics_hub.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mmserve.runtime.metrics import MetricsSnapshot, merge

STALE_AFTER_S = 30.0  # a source silent this long is gone: its gauges stop counting, its counters stay (s)
RETIRE_AFTER_S = 600.0  # ...and this long: its counters are folded into one sum and its entry dropped (s)


class MetricsBoard:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._latest: dict[str, tuple[float, MetricsSnapshot]] = {}  # source -> (time, snapshot)
        self._retired = MetricsSnapshot()  # the counters of sources long gone, summed into one
        self._retired_sources: set[str] = set()  # NOTE: names only; a late report from one is dropped

    @property
    def sources(self) -> list[str]:
        """The sources with an entry (not retired)."""
        return list(self._latest)

    def report(self, source: str, snapshot: MetricsSnapshot) -> None:
        if source not in self._retired_sources:  # (its counters are in `_retired` already)
            self._latest[source] = (self._clock(), snapshot)

    def collect(self) -> MetricsSnapshot:
        now = self._clock()
        gone = [source for source, (t, _) in self._latest.items() if now - t > RETIRE_AFTER_S]
        if gone:
            self._retired = merge([self._retired, *(_without_gauges(self._latest.pop(s)[1]) for s in gone)])
            self._retired_sources.update(gone)
        snapshots = [s if now - t < STALE_AFTER_S else _without_gauges(s) for t, s in self._latest.values()]
        return merge([self._retired, *snapshots])


def _without_gauges(snapshot: MetricsSnapshot) -> MetricsSnapshot:
    return MetricsSnapshot({n: m for n, m in snapshot.metrics.items() if m.kind != "gauge"})
