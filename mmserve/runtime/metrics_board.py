"""Every replica's latest metrics, summed into one snapshot: what the metrics hub keeps.

Owns: the latest snapshot of each source (a replica), when each came, and the rules for sources gone quiet:
past `STALE_AFTER_S` a source's gauges stop counting (its counters and histograms stay), past
`RETIRE_AFTER_S` its counters are folded into one sum and its entry dropped, so the board does not grow with
every replica ever started; a late report from a retired source is dropped (its counts are in the sum) for
`RETIRE_AFTER_S` after it retired (a retired source reports again, if ever, within seconds: a push racing its
last). A source that says it is going (`report(..., final=True)`: a replica shutting down) is retired at once with
its last counts.
A report older than the source's last one (`seq`: a push that timed out and landed late) is dropped. A source
that began counting before the board (`began`: a replica older than a hub that was replaced, as an edit of the
app's arguments replaces every replica) counts from its first report here: the board is then a restarted
exporter whose counters start again from zero, rather than one whose counters fall and then jump back by every
replica's lifetime count (which Prometheus's `rate()` would read as that many new events).
Thread-safe (the hub's handlers may run in Serve's thread pool).
Does not own what is measured nor the snapshot's arithmetic (metrics.py), nor how snapshots travel
(deployments/metrics_hub.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mmserve.runtime.metrics import MetricsSnapshot, merge, since

STALE_AFTER_S = 30.0  # a source silent this long is gone: its gauges stop counting, its counters stay (s)
RETIRE_AFTER_S = 600.0  # ...and this long: its counters are folded into one sum and its entry dropped (s)


class MetricsBoard:
    def __init__(self, clock: Callable[[], float] = time.monotonic, began: float | None = None) -> None:
        self._clock = clock
        self.began = time.time() if began is None else began  # when this board began counting (s, wall clock)
        self._latest: dict[str, tuple[float, MetricsSnapshot]] = {}  # source -> (time, its counts here)
        self._retired = MetricsSnapshot()  # the counters of sources long gone, summed into one
        # source -> when it retired; a late report from one is dropped (names forgotten RETIRE_AFTER_S later)
        self._retired_sources: dict[str, float] = {}
        self._bases: dict[str, MetricsSnapshot] = {}  # source -> its counts before this board began
        self._seqs: dict[str, int] = {}  # source -> the `seq` of its latest report
        self._lock = threading.Lock()

    @property
    def sources(self) -> list[str]:
        """The sources with an entry (not retired)."""
        with self._lock:
            return list(self._latest)

    def report(self, source: str, snapshot: MetricsSnapshot, final: bool = False, *, seq: int | None = None,
               began: float | None = None) -> None:
        """`source`'s latest snapshot; `final`: its last (it is going), retired at once; `seq`: its reports'
        order (increasing); `began`: when the source began counting (s, wall clock)."""
        with self._lock:
            self._retire_silent(self._clock())  # NOTE: here too: a board nobody scrapes must not keep the dead
            if source in self._retired_sources:  # (its counters are in `_retired` already)
                return
            if seq is not None:
                if seq <= self._seqs.get(source, -1):
                    return
                self._seqs[source] = seq
            if source not in self._latest and began is not None and began < self.began:
                self._bases[source] = snapshot
            base = self._bases.get(source)
            self._latest[source] = (self._clock(), snapshot if base is None else since(snapshot, base))
            if final:
                self._retire([source])

    def collect(self) -> MetricsSnapshot:
        with self._lock:
            now = self._clock()
            self._retire_silent(now)
            snapshots = [s if now - t < STALE_AFTER_S else _without_gauges(s) for t, s in self._latest.values()]
            return merge([self._retired, *snapshots])

    def _retire_silent(self, now: float) -> None:
        """Retire the sources silent past RETIRE_AFTER_S, and forget the names retired that long ago (under the
        lock)."""
        self._retire([source for source, (t, _) in self._latest.items() if now - t > RETIRE_AFTER_S])
        for source in [s for s, t in self._retired_sources.items() if now - t > RETIRE_AFTER_S]:
            del self._retired_sources[source]

    def _retire(self, sources: list[str]) -> None:
        """Fold the counters of `sources` into the retired sum and drop their entries (under the lock)."""
        if sources:
            self._retired = merge([self._retired, *(_without_gauges(self._latest.pop(s)[1]) for s in sources)])
            now = self._clock()
            self._retired_sources.update((source, now) for source in sources)
            for source in sources:
                self._bases.pop(source, None)
                self._seqs.pop(source, None)


def _without_gauges(snapshot: MetricsSnapshot) -> MetricsSnapshot:
    return MetricsSnapshot({n: m for n, m in snapshot.metrics.items() if m.kind != "gauge"})
