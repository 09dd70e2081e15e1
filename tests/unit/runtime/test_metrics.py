"""metrics.py: stage stats -> snapshots, merging replicas, histograms, Prometheus text that parses."""

from __future__ import annotations

import math
import pickle
import threading

import pytest

from mmserve.decoder.stats import DecoderStats
from mmserve.encoder.outputs import EncoderStats
from mmserve.engine import EngineStats
from mmserve.preprocess.processor_cache import ProcessorCacheStats
from mmserve.runtime.ingress_metrics import Histogram, IngressMetrics, admission_snapshot
from mmserve.runtime.metrics import (
    BATCH_SIZE_BUCKETS,
    HistogramValue,
    Metric,
    MetricsSnapshot,
    decoder_snapshot,
    encoder_snapshot,
    engine_snapshot,
    merge,
    preprocess_snapshot,
    processor_cache_snapshot,
    since,
    snapshot_of,
)
from mmserve.runtime.prometheus import CONTENT_TYPE, render_prometheus

parser = pytest.importorskip("prometheus_client.parser")

REQUIRED = [
    "mmserve_processor_cache_queries_total", "mmserve_processor_cache_hits_total",
    "mmserve_encoder_cache_queries_total", "mmserve_encoder_cache_hits_total",
    "mmserve_time_to_first_token_seconds", "mmserve_encoder_batch_size",
    "mmserve_decoder_running_requests", "mmserve_decoder_waiting_requests",
    "mmserve_image_processor_calls_total", "mmserve_encoder_forward_passes_total",
    "mmserve_processor_cache_bytes", "mmserve_encoder_cache_tokens", "mmserve_decoder_kv_blocks_free",
    "mmserve_requests_total", "mmserve_generated_tokens_total", "mmserve_e2e_request_latency_seconds",
    "mmserve_request_time_per_output_token_seconds",
    "mmserve_prefix_cache_queries_total", "mmserve_prefix_cache_hits_total", "mmserve_decoder_kv_blocks_cached",
    "mmserve_decoder_computed_tokens_total", "mmserve_decoder_sampled_tokens_total", "mmserve_decoder_kv_blocks",
]


def cache_stats(queries: int, hits: int, bytes_held: int) -> ProcessorCacheStats:
    return ProcessorCacheStats(capacity_bytes=1000, queries=queries, hits=hits, evictions=1, refused=0,
                               bytes_held=bytes_held, peak_bytes_held=bytes_held, entries=2)


def encoder_stats(queries: int, hits: int, batch_sizes: dict[int, int]) -> EncoderStats:
    return EncoderStats(queries=queries, hits=hits, forward_passes=sum(batch_sizes.values()), items_encoded=3,
                        images_encoded=sum(k * v for k, v in batch_sizes.items()), cached_tokens=512,
                        peak_cached_tokens=600, capacity_tokens=4096, num_cached=2, num_pending=1,
                        batch_sizes=batch_sizes, early_found=1)


def decoder_stats(running: int, waiting: int) -> DecoderStats:
    return DecoderStats(running=running, waiting=waiting, free_blocks=10, total_blocks=64, steps=100,
                        kv_cache_bytes=1 << 20, cached_blocks=5, prefix_queries=300, prefix_hits=256,
                        preemptions=running)


def replica(i: int) -> list[MetricsSnapshot]:
    """Every stage of one replica set, with per-replica numbers."""
    ingress = IngressMetrics()
    ingress.observe_ttft(0.04 * (i + 1))
    ingress.observe_request("ok", 1.5, prompt_tokens=300, generated_tokens=20 + i)
    ingress.observe_request("client_error", 0.01)
    ingress.observe_retry(after_first_output=bool(i), reused=bool(i))
    return [
        preprocess_snapshot(5 + i, cache_stats(queries=10, hits=4 + i, bytes_held=100 * (i + 1))),
        encoder_snapshot(encoder_stats(queries=8, hits=2 + i, batch_sizes={1: 2, 3: 1 + i})),
        decoder_snapshot(decoder_stats(running=3 + i, waiting=i)),
        ingress.snapshot(),
        admission_snapshot(in_flight=2 + i, limit=64),
    ]


def families(text: str) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """name as exposed -> {(sample name, labels): value}, via the official parser."""
    out: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for fam in parser.text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name  # the parser strips "_total"
        out[name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}
    return out


def scalar(fams: dict, name: str) -> float:
    ((_, value),) = fams[name].items()
    return value


def test_two_replicas_merge_and_render() -> None:
    merged = merge(replica(0) + replica(1))
    text = render_prometheus(merged)
    fams = families(text)
    assert set(REQUIRED) <= set(fams)
    assert scalar(fams, "mmserve_processor_cache_queries_total") == 20
    assert scalar(fams, "mmserve_processor_cache_hits_total") == 4 + 5
    assert scalar(fams, "mmserve_processor_cache_bytes") == 100 + 200
    assert scalar(fams, "mmserve_ingress_requests_in_flight") == 2 + 3  # the ingress's bound, over replicas
    assert scalar(fams, "mmserve_ingress_requests_limit") == 64 + 64
    assert scalar(fams, "mmserve_image_processor_calls_total") == 5 + 6
    assert scalar(fams, "mmserve_encoder_cache_queries_total") == 16
    assert scalar(fams, "mmserve_encoder_cache_hits_total") == 2 + 3
    assert scalar(fams, "mmserve_encoder_forward_passes_total") == 3 + 4
    assert scalar(fams, "mmserve_encoder_early_found_total") == 1 + 1
    assert scalar(fams, "mmserve_decoder_preemptions_total") == 3 + 4
    assert scalar(fams, "mmserve_encoder_cache_tokens") == 1024
    assert scalar(fams, "mmserve_encoder_cache_peak_tokens") == 1200  # per-replica peaks, summed
    assert scalar(fams, "mmserve_processor_cache_peak_bytes") == 100 + 200
    assert scalar(fams, "mmserve_decoder_running_requests") == 3 + 4
    assert scalar(fams, "mmserve_decoder_waiting_requests") == 0 + 1
    assert scalar(fams, "mmserve_decoder_kv_blocks_free") == 20
    assert scalar(fams, "mmserve_generated_tokens_total") == 20 + 21
    requests = fams["mmserve_requests_total"]
    assert requests[("mmserve_requests_total", (("status", "ok"),))] == 2
    assert requests[("mmserve_requests_total", (("status", "client_error"),))] == 2
    assert requests[("mmserve_requests_total", (("status", "server_error"),))] == 0
    latency = fams["mmserve_e2e_request_latency_seconds"]  # of the requests answered in full only
    assert latency[("mmserve_e2e_request_latency_seconds_count", ())] == 2
    assert latency[("mmserve_e2e_request_latency_seconds_sum", ())] == 3.0
    retries = fams["mmserve_request_retries_total"]
    before, after = (("phase", "before_first_output"),), (("phase", "after_first_output"),)
    assert retries[("mmserve_request_retries_total", (*before, ("preprocess", "again")))] == 1
    assert retries[("mmserve_request_retries_total", (*before, ("preprocess", "reused")))] == 0
    assert retries[("mmserve_request_retries_total", (*after, ("preprocess", "reused")))] == 1
    assert retries[("mmserve_request_retries_total", (*after, ("preprocess", "again")))] == 0
    assert "# TYPE mmserve_decoder_running_requests gauge" in text
    assert "# TYPE mmserve_encoder_cache_hits_total counter" in text
    assert "# TYPE mmserve_time_to_first_token_seconds histogram" in text
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def buckets(fams: dict, name: str) -> dict[str, float]:
    return {dict(labels)["le"]: v for (sample, labels), v in fams[name].items() if sample == name + "_bucket"}


def test_time_per_output_token_is_a_requests_time_after_its_first_token_of_full_one_choice_answers() -> None:
    from mmserve.runtime.ingress_metrics import IngressMetrics

    ingress = IngressMetrics()
    ingress.observe_request("ok", 2.5, 10, 21, first_s=0.5)  # 20 tokens after the first in 2 s: 0.1 s each
    ingress.observe_request("ok", 1.5, 10, 2 * 11, first_s=0.5, choices=2)  # two choices: whose tokens took it?
    ingress.observe_request("ok", 1.0, 10, 1, first_s=0.5)  # one token: no time after the first
    ingress.observe_request("aborted", 9.0, 10, 50, first_s=0.5)  # not answered in full
    ingress.observe_request("ok", 1.0, 10, 30)  # its first token's time unknown (e.g. never came)
    tpot = ingress.tpot.value()
    assert sum(tpot.counts) == 1 and tpot.sum == pytest.approx(0.1)
    assert "mmserve_request_time_per_output_token_seconds" in ingress.snapshot().metrics


def test_batch_size_histogram_is_cumulative_and_summed() -> None:
    fams = families(render_prometheus(merge(replica(0) + replica(1))))
    # replica 0: {1: 2, 3: 1}; replica 1: {1: 2, 3: 2} -> 4 forwards of 1, 3 of 3
    got = buckets(fams, "mmserve_encoder_batch_size")
    assert got == {"1.0": 4, "2.0": 4, "4.0": 7, "8.0": 7, "16.0": 7, "32.0": 7, "64.0": 7, "+Inf": 7}
    samples = fams["mmserve_encoder_batch_size"]
    assert samples[("mmserve_encoder_batch_size_count", ())] == 7
    assert samples[("mmserve_encoder_batch_size_sum", ())] == 4 * 1 + 3 * 3
    ttft = buckets(fams, "mmserve_time_to_first_token_seconds")  # 0.04 and 0.08
    assert (ttft["0.025"], ttft["0.05"], ttft["0.1"], ttft["+Inf"]) == (0, 1, 2, 2)
    values = list(ttft.values())
    assert values == sorted(values)


def test_histogram_bucket_edges() -> None:
    hist = Histogram((1.0, 2.0))
    for x in (0.5, 1.0, 1.5, 2.0, 2.5):
        hist.observe(x)
    value = hist.value()
    assert value.counts == (2, 2, 1)  # le semantics: 1.0 falls in the "<= 1" bucket
    assert value.cumulative() == [(1.0, 2), (2.0, 4), (math.inf, 5)]
    assert (value.count, value.sum) == (5, 7.5)
    from_counts = HistogramValue.from_counts(BATCH_SIZE_BUCKETS, {1: 3, 2: 1, 3: 2, 100: 1}.items())
    assert from_counts.counts == (3, 1, 2, 0, 0, 0, 0, 1) and from_counts.sum == 3 + 2 + 6 + 100
    with pytest.raises(ValueError, match="increasing"):
        Histogram((2.0, 1.0))


def test_histogram_is_thread_safe() -> None:
    hist = Histogram((1.0,))

    def work() -> None:
        for _ in range(2000):
            hist.observe(0.5)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hist.value().count == 16000 and hist.value().sum == 8000.0


def test_engine_snapshot_covers_every_stage_and_pickles() -> None:
    stats = EngineStats(image_processor_calls=2, processor_cache=cache_stats(4, 1, 50),
                        encoder=encoder_stats(4, 1, {2: 1}), decoder=decoder_stats(1, 2))
    snap = engine_snapshot(stats)
    assert snap.value("mmserve_image_processor_calls_total") == 2
    assert snap.value("mmserve_processor_cache_hits_total") == 1
    assert snap.value("mmserve_decoder_waiting_requests") == 2
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_shared_cache_reported_apart_from_replicas() -> None:
    assert list(preprocess_snapshot(3).metrics) == ["mmserve_image_processor_calls_total"]
    store = processor_cache_snapshot(cache_stats(queries=9, hits=3, bytes_held=70))
    merged = merge([preprocess_snapshot(3), preprocess_snapshot(4), store])
    assert merged.value("mmserve_image_processor_calls_total") == 7
    assert merged.value("mmserve_processor_cache_queries_total") == 9  # once, not per replica
    assert merged.value("mmserve_processor_cache_bytes") == 70


def test_a_metric_whose_labels_differ_between_replicas_is_taken_from_the_later_one(caplog) -> None:
    """Two versions side by side in a rolling update must not fail every scrape."""
    a = MetricsSnapshot({"x_total": Metric("x_total", "counter", "h", (), {(): 1.0})})
    b = MetricsSnapshot({"x_total": Metric("x_total", "counter", "h", ("k",), {("v",): 2.0})})
    c = MetricsSnapshot({"x_total": Metric("x_total", "counter", "h", ("k",), {("v",): 3.0})})
    merged = merge([a, b, c])
    assert merged.metrics["x_total"].labels == ("k",) and merged.value("x_total", "v") == 5.0
    assert "x_total" in caplog.text
    # the order of the sources does not change the sum: every snapshot of the kept shape counts
    assert merge([b, a, c]).value("x_total", "v") == 5.0 and merge([b, c, a, b]).value("x_total", "v") == 7.0


def test_since_subtracts_counts_and_keeps_gauges() -> None:
    def snap(n: float, gauge: float, counts: tuple[int, ...]) -> MetricsSnapshot:
        return snapshot_of(Metric("x_total", "counter", "h", (), {(): n}), Metric("g", "gauge", "h", (), {(): gauge}),
                           Metric("h_seconds", "histogram", "h", (), {(): HistogramValue((1.0,), counts, 3.0 * n)}))
    later = since(snap(10, 4, (5, 7)), snap(4, 9, (2, 3)))
    assert later.value("x_total") == 6 and later.value("g") == 4
    assert later.value("h_seconds") == HistogramValue((1.0,), (3, 4), 18.0)


def test_histograms_of_other_bounds_merge_on_the_bounds_they_share() -> None:
    """Replicas of two versions side by side (a rolling update) must not break /metrics."""
    old = HistogramValue((1.0, 2.0), (3, 4, 5), 20.0)  # 3 <= 1, 4 in (1, 2], 5 above
    new = HistogramValue((1.0, 2.0, 4.0), (1, 2, 3, 4), 30.0)
    both = merge([MetricsSnapshot({"h": Metric("h", "histogram", "h", (), {(): v})}) for v in (old, new)])
    value = both.metrics["h"].values[()]
    assert isinstance(value, HistogramValue) and value.bounds == (1.0, 2.0)
    assert value.cumulative() == [(1.0, 4), (2.0, 10), (float("inf"), 22)] and value.sum == 50.0
    assert new.on((2.0,)).counts == (3, 7) and old.on(()).counts == (12,)


def test_metric_checks_its_shape() -> None:
    with pytest.raises(ValueError, match="_total"):
        Metric("x", "counter", "h")
    with pytest.raises(ValueError, match="_total"):  # a gauge named as a counter would be rate()d
        Metric("x_total", "gauge", "h")
    with pytest.raises(ValueError, match="label values"):
        Metric("x_total", "counter", "h", ("a",), {(): 1.0})
    with pytest.raises(ValueError, match="cannot hold"):
        Metric("g", "gauge", "h", (), {(): HistogramValue((1.0,), (0, 0), 0.0)})
    with pytest.raises(ValueError, match="counts"):
        HistogramValue((1.0,), (0,), 0.0)


def test_label_values_are_escaped() -> None:
    tricky = 'a "quoted"\\ \nvalue'
    snap = MetricsSnapshot({"x_total": Metric("x_total", "counter", "help\nline", ("k",), {(tricky,): 2.0})})
    fams = families(render_prometheus(snap))
    assert fams["x_total"] == {("x_total", (("k", tricky),)): 2.0}


def test_empty_snapshot_renders_nothing() -> None:
    assert render_prometheus(merge([])) == ""
