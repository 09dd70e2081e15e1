"""What the ingress observes of each request itself, as live counters a snapshot reads.

Owns: `Histogram` (fixed bounds, thread-safe) and `IngressMetrics` (time to first token, latency,
request outcomes, retries, tokens), with their bucket bounds and label values; and the gauges of the
ingress's bound on chat requests (`admission_snapshot`). Does not own the metric
data model, the other stages' snapshots or `merge` (metrics.py), nor when the ingress observes (the
ingress deployment).
"""

from __future__ import annotations

import itertools
import threading
from bisect import bisect_left
from typing import Literal

from mmserve.runtime.metrics import (
    HistogramValue,
    LabelValues,
    Metric,
    MetricsSnapshot,
    Value,
    counter,
    gauge,
    histogram,
    snapshot_of,
)

# NOTE: "overloaded" (a 503 the service answers under load: shedding, not a fault) apart from "server_error"
RequestStatus = Literal["ok", "client_error", "overloaded", "server_error", "aborted"]

# Fixed bounds shared by every replica, so histograms merge bucket by bucket.
# NOTE: up to past the default request deadline (600 s): under overload a first token comes late, not never
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                  640.0)
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# a token's time after the first, as vLLM's time_per_output_token buckets: a GPU's few ms to a loaded CPU's second
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_STATUSES: tuple[RequestStatus, ...] = ("ok", "client_error", "overloaded", "server_error", "aborted")
RETRY_PHASES: tuple[str, str] = ("before_first_output", "after_first_output")  # where a lost attempt had got
RETRY_PREPROCESS: tuple[str, str] = ("again", "reused")  # whether the retry preprocessed or kept the lost one's


class Histogram:
    """A mutable histogram over fixed bounds; thread-safe."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bounds must be strictly increasing, got {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect_left(self.bounds, value)] += 1
            self._sum += value

    def value(self) -> HistogramValue:
        with self._lock:
            return HistogramValue(self.bounds, tuple(self._counts), self._sum)


class IngressMetrics:
    """Request outcomes and latencies seen at the HTTP edge; one per ingress replica, thread-safe."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.latency = Histogram(LATENCY_BUCKETS_S)
        self.tpot = Histogram(TPOT_BUCKETS_S)
        self._requests = dict.fromkeys(REQUEST_STATUSES, 0)
        self._retries = dict.fromkeys(itertools.product(RETRY_PHASES, RETRY_PREPROCESS), 0)
        self._prompt_tokens = self._generated_tokens = 0
        self._lock = threading.Lock()

    def observe_ttft(self, seconds: float) -> None:
        """Request arrival to its first content token."""
        self.ttft.observe(seconds)

    def observe_retry(self, after_first_output: bool, reused: bool = False) -> None:
        """A request made again after a lost replica (a non-streamed one is retried whole, even mid-decode),
        from the lost attempt's preprocessed request if `reused`."""
        with self._lock:
            self._retries[RETRY_PHASES[after_first_output], RETRY_PREPROCESS[reused]] += 1

    def observe_request(self, status: RequestStatus, seconds: float, prompt_tokens: int = 0,
                        generated_tokens: int = 0, first_s: float | None = None, choices: int = 1) -> None:
        """A request ended: its outcome, token counts and, for one answered in full, its arrival-to-end latency
        and, from its first token's time `first_s`, its mean time per later token (one choice only: choices end at
        different times, and the total would not say whose tokens took the time).

        NOTE: only those: a refusal or a failure ends at once, and counted there it would make the latency of
        an overloaded server look better (its outcome is in `mmserve_requests_total`)."""
        if status == "ok":
            self.latency.observe(seconds)
            if first_s is not None and choices == 1 and generated_tokens > 1:
                self.tpot.observe((seconds - first_s) / (generated_tokens - 1))
        with self._lock:
            self._requests[status] += 1
            self._prompt_tokens += prompt_tokens
            self._generated_tokens += generated_tokens

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            requests: dict[LabelValues, Value] = {(status,): float(n) for status, n in self._requests.items()}
            retries: dict[LabelValues, Value] = {labels: float(n) for labels, n in self._retries.items()}
            prompt, generated = self._prompt_tokens, self._generated_tokens
        return snapshot_of(
            Metric("mmserve_requests_total", "counter", "Requests ended, by outcome.", ("status",), requests),
            Metric("mmserve_request_retries_total", "counter", "Attempts made again after a lost replica.",
                   ("phase", "preprocess"), retries),
            counter("mmserve_prompt_tokens_total", "Prompt tokens (image tokens included) of requests that had an "
                    "output, counted as each ends (per step: mmserve_decoder_computed_tokens_total).", prompt),
            counter("mmserve_generated_tokens_total", "Tokens generated, counted as their request ends (per step: "
                    "mmserve_decoder_sampled_tokens_total).", generated),
            histogram("mmserve_time_to_first_token_seconds", "Request arrival to first content token.",
                      self.ttft.value()),
            histogram("mmserve_e2e_request_latency_seconds",
                      "Request arrival to its end, of requests answered in full.", self.latency.value()),
            histogram("mmserve_request_time_per_output_token_seconds",
                      "A request's mean time per token after its first, of one-choice requests answered in full.",
                      self.tpot.value()),
        )


def admission_snapshot(in_flight: int, limit: int | None) -> MetricsSnapshot:
    """The ingress's bound on chat requests (mmserve.api.admission) as gauges; `merge` sums them over replicas."""
    metrics = [gauge("mmserve_ingress_requests_in_flight", "Chat requests the ingress is serving now.", in_flight)]
    if limit is not None:
        metrics.append(gauge("mmserve_ingress_requests_limit",
                             "Chat requests the ingress serves at once at most; past it a 503.", limit))
    return snapshot_of(*metrics)
