"""The metrics every stage reports, as plain data that sums over replicas.

Owns: metric names, help texts, kinds and the fixed histogram bucket bounds; turning each stage's
stats into a picklable `MetricsSnapshot` (no registry, no global state, so a Ray replica can return
one from a method call); `merge` over replicas. Does not own: what the ingress observes itself
(ingress_metrics.py), the text exposition (prometheus.py), gathering snapshots from replicas
(deployments/), nor the stats (each stage keeps its own).
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # NOTE: type-only, so the ingress can import this module without torch
    from mmserve.decoder.embedding_cache import EmbeddingCacheStats
    from mmserve.decoder.stats import DecoderStats
    from mmserve.encoder.outputs import EncoderStats
    from mmserve.engine import EngineStats
    from mmserve.preprocess.processor_cache import ProcessorCacheStats

log = logging.getLogger(__name__)
MetricKind = Literal["counter", "gauge", "histogram"]
LabelValues = tuple[str, ...]

# Fixed bounds shared by every replica, so histograms merge bucket by bucket.
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)  # crops (images) per vision forward


@dataclass(frozen=True)
class HistogramValue:
    bounds: tuple[float, ...]  # finite upper bounds, increasing; +Inf is implied
    counts: tuple[int, ...]  # observations per bucket, NOT cumulative; len(bounds) + 1, last = above all
    sum: float  # sum of the observed values

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"{len(self.bounds)} bounds need {len(self.bounds) + 1} counts, got {len(self.counts)}")

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(le, observations <= le) per bucket, ending with (inf, count), as Prometheus exposes them."""
        out, total = [], 0
        for le, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((le, total))
        return out

    def __add__(self, other: HistogramValue) -> HistogramValue:
        if other.bounds != self.bounds:  # NOTE: replicas of two versions side by side, in a rolling update
            shared = tuple(sorted(set(self.bounds) & set(other.bounds)))
            return self.on(shared) + other.on(shared)
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return HistogramValue(self.bounds, counts, self.sum + other.sum)

    def on(self, bounds: tuple[float, ...]) -> HistogramValue:
        """The same observations in the buckets of `bounds`, a subset of this one's: each new bucket sums the
        buckets it spans, exactly (the cumulative count at a shared bound is the same)."""
        counts, j = [0] * (len(bounds) + 1), 0
        for upper, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            while j < len(bounds) and bounds[j] < upper:
                j += 1
            counts[j] += n
        return HistogramValue(bounds, tuple(counts), self.sum)

    @classmethod
    def from_counts(cls, bounds: tuple[float, ...], observed: Iterable[tuple[float, int]]) -> HistogramValue:
        """From (observed value, times) pairs, e.g. `EncoderStats.batch_sizes.items()`."""
        counts, total = [0] * (len(bounds) + 1), 0.0
        for value, times in observed:
            counts[bisect_left(bounds, value)] += times
            total += value * times
        return cls(bounds, tuple(counts), total)


Value = float | HistogramValue


@dataclass(frozen=True)
class Metric:
    name: str  # the exposed name; a counter's, and only a counter's, ends in "_total"
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()  # label names
    values: Mapping[LabelValues, Value] = field(default_factory=dict)  # label values -> value

    def __post_init__(self) -> None:
        if (self.kind == "counter") != self.name.endswith("_total"):  # NOTE: Prometheus's rule, both ways
            raise ValueError(f"{self.name}: only a counter's name ends in _total, and every counter's does")
        for key, value in self.values.items():
            if len(key) != len(self.labels):
                raise ValueError(f"{self.name}: label values {key} do not match labels {self.labels}")
            if isinstance(value, HistogramValue) != (self.kind == "histogram"):
                raise ValueError(f"{self.name}: a {self.kind} cannot hold {type(value).__name__}")


@dataclass(frozen=True)
class MetricsSnapshot:
    metrics: Mapping[str, Metric] = field(default_factory=dict)  # name -> metric

    def value(self, name: str, *label_values: str) -> Value | None:
        metric = self.metrics.get(name)
        return None if metric is None else metric.values.get(tuple(label_values))


def snapshot_of(*metrics: Metric) -> MetricsSnapshot:
    names = [m.name for m in metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate metric names in {names}")
    return MetricsSnapshot({m.name: m for m in metrics})


def counter(name: str, help: str, value: float) -> Metric:
    return Metric(name, "counter", help, (), {(): float(value)})


def gauge(name: str, help: str, value: float) -> Metric:
    return Metric(name, "gauge", help, (), {(): float(value)})


def histogram(name: str, help: str, value: HistogramValue) -> Metric:
    return Metric(name, "histogram", help, (), {(): value})


# --- per stage ----------------------------------------------------------------------------------


def preprocess_snapshot(image_processor_calls: int, cache: ProcessorCacheStats | None = None) -> MetricsSnapshot:
    """One preprocess replica; `cache` only if the replica owns its cache index (see below)."""
    calls = counter("mmserve_image_processor_calls_total", "HF image processor invocations.", image_processor_calls)
    return merge([snapshot_of(calls)] + ([processor_cache_snapshot(cache)] if cache is not None else []))


def processor_cache_snapshot(cache: ProcessorCacheStats) -> MetricsSnapshot:
    """One ProcessorCache index. NOTE: report each index once: where replicas share one (a store
    actor), the store reports it, not every replica, or `merge` counts it once per replica."""
    return snapshot_of(
        counter("mmserve_processor_cache_queries_total", "Processor cache lookups.", cache.queries),
        counter("mmserve_processor_cache_hits_total", "Processor cache lookups that hit.", cache.hits),
        counter("mmserve_processor_cache_evictions_total", "Processor cache entries evicted.", cache.evictions),
        counter("mmserve_processor_cache_refused_total", "Items larger than the processor cache.", cache.refused),
        gauge("mmserve_processor_cache_bytes", "Bytes held by the processor cache.", cache.bytes_held),
        gauge("mmserve_processor_cache_peak_bytes", "The most bytes the processor cache held (its index's own peak).",
              cache.peak_bytes_held),
        gauge("mmserve_processor_cache_capacity_bytes", "Processor cache capacity in bytes.", cache.capacity_bytes),
        gauge("mmserve_processor_cache_entries", "Items held by the processor cache.", cache.entries),
    )


def replica_cache_snapshot(cache: ProcessorCacheStats) -> MetricsSnapshot:
    """A Preprocess replica's own ProcessorCache entries (the items it made). Its hits never reach the
    shared store, so they are added to the store's lookups and hits here: the merged hit rate stays one
    over every lookup; its misses are the store's lookups."""
    return snapshot_of(
        counter("mmserve_processor_cache_queries_total", "Processor cache lookups.", cache.hits),
        counter("mmserve_processor_cache_hits_total", "Processor cache lookups that hit.", cache.hits),
        counter("mmserve_processor_cache_replica_hits_total",
                "Processor cache hits on the items the answering Preprocess replica made.", cache.hits),
        gauge("mmserve_processor_cache_replica_bytes",
              "Bytes of the items Preprocess replicas made and still hold references to.", cache.bytes_held),
    )


def encoder_snapshot(stats: EncoderStats) -> MetricsSnapshot:
    return snapshot_of(
        counter("mmserve_encoder_cache_queries_total", "Encoder cache lookups (hits + encoded misses).",
                stats.queries),
        counter("mmserve_encoder_cache_hits_total", "Encoder cache lookups that hit.", stats.hits),
        counter("mmserve_encoder_forward_passes_total", "Vision encoder forward passes.", stats.forward_passes),
        counter("mmserve_encoder_items_encoded_total", "Multimodal items (images) encoded.", stats.items_encoded),
        counter("mmserve_encoder_crops_encoded_total", "Image crops encoded.", stats.images_encoded),
        counter("mmserve_encoder_early_found_total",
                "Encoder lookups that found their item encoded early for them (a miss run ahead).", stats.early_found),
        gauge("mmserve_encoder_cache_tokens", "Embedding rows booked in the encoder cache.", stats.cached_tokens),
        gauge("mmserve_encoder_cache_peak_tokens",
              "The most embedding rows an encoder cache booked, each replica's peak summed.", stats.peak_cached_tokens),
        gauge("mmserve_encoder_cache_capacity_tokens", "Encoder cache capacity in embedding rows.",
              stats.capacity_tokens),
        gauge("mmserve_encoder_cache_entries", "Items in the encoder cache.", stats.num_cached),
        gauge("mmserve_encoder_pending_requests", "Requests waiting for embeddings.", stats.num_pending),
        histogram("mmserve_encoder_batch_size", "Crops (images) per vision encoder forward pass.",
                  HistogramValue.from_counts(BATCH_SIZE_BUCKETS, stats.batch_sizes.items())),
    )


def decoder_snapshot(stats: DecoderStats) -> MetricsSnapshot:
    return snapshot_of(
        gauge("mmserve_decoder_running_requests", "Sequences holding KV blocks.", stats.running),
        gauge("mmserve_decoder_waiting_requests",
              "Sequences queued or preempted, and requests awaiting their embeddings before that.", stats.waiting),
        gauge("mmserve_decoder_kv_blocks_free", "KV cache pages no sequence holds, unheld prefix-cache entries "
              "included (one layer's block each).", stats.free_blocks),
        gauge("mmserve_decoder_kv_blocks", "KV cache pages overall (blocks x layers).", stats.total_blocks),
        gauge("mmserve_decoder_kv_cache_bytes", "Bytes of KV cache tensors.", stats.kv_cache_bytes),
        counter("mmserve_decoder_steps_total", "Decoder forward steps.", stats.steps),
        counter("mmserve_decoder_computed_tokens_total",
                "Positions the decoder's forwards computed (prompt chunks and decodes), counted each step.",
                stats.computed_tokens),
        counter("mmserve_decoder_sampled_tokens_total", "Tokens sampled, counted each step (rate(): decode "
                "throughput while requests run).", stats.sampled_tokens),
        counter("mmserve_decoder_preemptions_total",
                "Sequences sent back to the queue for KV room (their computed tokens are redone).", stats.preemptions),
        gauge("mmserve_decoder_kv_blocks_cached", "Prefix-cache entries (a layer kind's block each).",
              stats.cached_blocks),
        counter("mmserve_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                stats.prefix_queries),
        counter("mmserve_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", stats.prefix_hits),
        *_embedding_cache_metrics(stats.embedding_cache),
    )


def _embedding_cache_metrics(stats: EmbeddingCacheStats | None) -> tuple[Metric, ...]:
    if stats is None:
        return ()
    return (
        counter("mmserve_decoder_embedding_cache_queries_total",
                "Items whose embeddings the decoder looked up in its own cache.", stats.queries),
        counter("mmserve_decoder_embedding_cache_hits_total",
                "Of those, found there (no call to the encoder).", stats.hits),
        gauge("mmserve_decoder_embedding_cache_bytes", "Bytes of embeddings the decoder keeps.", stats.bytes),
    )


def engine_snapshot(stats: EngineStats) -> MetricsSnapshot:
    """The in-process engine: every stage, one replica each."""
    return merge([preprocess_snapshot(stats.image_processor_calls, stats.processor_cache),
                  encoder_snapshot(stats.encoder), decoder_snapshot(stats.decoder)])


# --- merge and render ---------------------------------------------------------------------------


def merge(snapshots: Iterable[MetricsSnapshot]) -> MetricsSnapshot:
    """Sum over replicas: counters, gauges (running, waiting and bytes add up) and histogram buckets.

    NOTE: a metric whose kind or labels differ between snapshots (two versions side by side in a rolling
    update) is summed over the snapshots of the last one's shape alone, the others dropped, logged: refusing
    would fail every scrape until the old version's counts were retired, and keeping whichever shape came last
    in turn made the sum jump with the order of the sources. Under other labels it is another series to
    Prometheus, so the dropped one reads as ended, not as a counter reset; a board lists the newest sources
    last (and the gone ones' sum first).
    """
    snapshots = list(snapshots)
    shapes = {name: (m.kind, m.labels) for snap in snapshots for name, m in snap.metrics.items()}  # the last's
    merged: dict[str, Metric] = {}
    for snap in snapshots:
        for name, metric in snap.metrics.items():
            if (metric.kind, metric.labels) != shapes[name]:
                log.warning("metric %s is a %s%s in one replica and a %s%s in a later one: the latter kept",
                            name, metric.kind, metric.labels, *shapes[name])
                continue
            seen = merged.get(name)
            merged[name] = metric if seen is None else _add(seen, metric)
    return MetricsSnapshot(merged)


def since(snapshot: MetricsSnapshot, base: MetricsSnapshot) -> MetricsSnapshot:
    """`snapshot`'s counts since `base` (an earlier snapshot of the same source): counters and histograms less
    the base's (never below zero), gauges as they are; a metric whose kind or labels changed is kept whole."""
    out: dict[str, Metric] = {}
    for name, metric in snapshot.metrics.items():
        old = base.metrics.get(name)
        if metric.kind == "gauge" or old is None or (old.kind, old.labels) != (metric.kind, metric.labels):
            out[name] = metric
            continue
        values = {key: value if key not in old.values else _less(value, old.values[key])
                  for key, value in metric.values.items()}
        out[name] = Metric(metric.name, metric.kind, metric.help, metric.labels, values)
    return MetricsSnapshot(out)


def _less(value: Value, base: Value) -> Value:
    if isinstance(value, HistogramValue) and isinstance(base, HistogramValue) and base.bounds == value.bounds:
        counts = tuple(max(0, a - b) for a, b in zip(value.counts, base.counts, strict=True))
        return HistogramValue(value.bounds, counts, max(0.0, value.sum - base.sum))
    if isinstance(value, float | int) and isinstance(base, float | int):
        return max(0.0, value - base)
    return value


def _add(a: Metric, b: Metric) -> Metric:
    values = dict(a.values)
    for key, value in b.values.items():
        old = values.get(key)
        values[key] = value if old is None else old + value  # type: ignore[operator]
    return Metric(a.name, a.kind, a.help, a.labels, values)
