"""Prometheus text exposition of a `MetricsSnapshot`.

Owns: turning mmserve's plain metric data into prometheus_client metric families and the text format
0.0.4 (and its content type). Does not own the metrics themselves (metrics.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from mmserve.runtime.metrics import HistogramValue, Metric, MetricsSnapshot

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric as PromFamily

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what `render_prometheus` produces


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: MetricsSnapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[PromFamily]:
        for name in sorted(self._snapshot.metrics):
            yield _family(self._snapshot.metrics[name])


def _family(metric: Metric) -> PromFamily:
    if metric.kind == "histogram":
        hist = HistogramMetricFamily(metric.name, metric.help, labels=metric.labels)
        for key, value in metric.values.items():
            assert isinstance(value, HistogramValue)
            buckets = [(floatToGoString(le), float(n)) for le, n in value.cumulative()]
            hist.add_metric(list(key), buckets, value.sum)
        return hist
    # NOTE: CounterMetricFamily strips "_total" from the name and the exposition adds it back.
    family_type = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
    family = family_type(metric.name, metric.help, labels=metric.labels)
    for key, value in metric.values.items():
        assert isinstance(value, float | int)
        family.add_metric(list(key), value)
    return family


def render_prometheus(snapshot: MetricsSnapshot) -> str:
    """Prometheus text exposition format 0.0.4 (serve it with `CONTENT_TYPE`), metrics sorted by name."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot))
    return generate_latest(registry).decode("utf-8")
