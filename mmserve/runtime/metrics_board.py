"""Every replica's latest metrics, summed into one snapshot: what the metrics hub keeps.

Owns: the latest snapshot of each source (a replica), when each came, and the rules for sources gone quiet:
past `STALE_AFTER_S` a source's gauges stop counting (its counters and histograms stay), past
`RETIRE_AFTER_S` its counters are folded into one sum and its entry dropped, so the board does not grow with
every replica ever started; a late report from a retired source is dropped (its counts are in the sum). A source
that says it is going (`report(..., final=True)`: a replica shutting down) is retired at once with its last counts.
Thread-safe (the hub's handlers may run in Serve's thread pool).
Does not own what is measured nor the snapshot's arithmetic (metrics.py), nor how snapshots travel
(deployments/metrics_hub.py).
"""

from __future__ import annotations

import threading
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
        self._lock = threading.Lock()

    @property
    def sources(self) -> list[str]:
        """The sources with an entry (not retired)."""
        with self._lock:
            return list(self._latest)

    def report(self, source: str, snapshot: MetricsSnapshot, final: bool = False) -> None:
        """`source`'s latest snapshot; `final`: its last (it is going), retired at once."""
        with self._lock:
            if source in self._retired_sources:  # (its counters are in `_retired` already)
                return
            self._latest[source] = (self._clock(), snapshot)
            if final:
                self._retire([source])

    def collect(self) -> MetricsSnapshot:
        with self._lock:
            now = self._clock()
            self._retire([source for source, (t, _) in self._latest.items() if now - t > RETIRE_AFTER_S])
            snapshots = [s if now - t < STALE_AFTER_S else _without_gauges(s) for t, s in self._latest.values()]
            return merge([self._retired, *snapshots])

    def _retire(self, sources: list[str]) -> None:
        """Fold the counters of `sources` into the retired sum and drop their entries (under the lock)."""
        if sources:
            self._retired = merge([self._retired, *(_without_gauges(self._latest.pop(s)[1]) for s in sources)])
            self._retired_sources.update(sources)


def _without_gauges(snapshot: MetricsSnapshot) -> MetricsSnapshot:
    return MetricsSnapshot({n: m for n, m in snapshot.metrics.items() if m.kind != "gauge"})
