"""mmserve's `/metrics` as numbers: parse the Prometheus text, take counter deltas over a cell, and
follow gauges during it (a poller keeps their peaks).

Owns: the metric names the benchmark reads (they are defined in mmserve/metrics.py) and the cell's
cache figures derived from them. Does not own the metrics themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import urllib.request
from dataclasses import dataclass, field

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")

PEAK_GAUGES = ("mmserve_processor_cache_peak_bytes", "mmserve_encoder_cache_peak_tokens",
               "mmserve_processor_cache_bytes", "mmserve_encoder_cache_tokens", "mmserve_encoder_cache_entries",
               "mmserve_processor_cache_entries", "mmserve_decoder_running_requests",
               "mmserve_encoder_pending_requests")
# NOTE: the caches' own high-water marks, not the polled current values: replicas push their metrics
# every few seconds, so a poller alone could miss a peak between two pushes.
BOUNDS = {  # gauge -> the gauge holding its configured bound
    "mmserve_processor_cache_peak_bytes": "mmserve_processor_cache_capacity_bytes",
    "mmserve_encoder_cache_peak_tokens": "mmserve_encoder_cache_capacity_tokens",
}


def parse(text: str) -> dict[str, float]:
    """{'name{labels}': value}; labels kept verbatim, so 'mmserve_requests_total{status="ok"}'."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = _LINE.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        return parse(r.read().decode())


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def cache_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Hit rates and counts of one cell from counter deltas."""
    def rate(hits: str, queries: str) -> float | None:
        q = delta(after, before, queries)
        return delta(after, before, hits) / q if q > 0 else None

    batches = delta(after, before, "mmserve_encoder_batch_size_count")
    crops = delta(after, before, "mmserve_encoder_batch_size_sum")
    return {
        "processor_cache_hit_rate": rate("mmserve_processor_cache_hits_total", "mmserve_processor_cache_queries_total"),
        "encoder_cache_hit_rate": rate("mmserve_encoder_cache_hits_total", "mmserve_encoder_cache_queries_total"),
        "prefix_cache_hit_rate": rate("mmserve_prefix_cache_hits_total", "mmserve_prefix_cache_queries_total"),
        "processor_cache_queries": delta(after, before, "mmserve_processor_cache_queries_total"),
        "encoder_cache_queries": delta(after, before, "mmserve_encoder_cache_queries_total"),
        "image_processor_calls": delta(after, before, "mmserve_image_processor_calls_total"),
        "encoder_forward_passes": delta(after, before, "mmserve_encoder_forward_passes_total"),
        "encoder_crops_encoded": delta(after, before, "mmserve_encoder_crops_encoded_total"),
        "encoder_mean_batch_crops": crops / batches if batches else None,
        "decoder_steps": delta(after, before, "mmserve_decoder_steps_total"),
        "processor_cache_evictions": delta(after, before, "mmserve_processor_cache_evictions_total"),
    }


@dataclass
class GaugePoller:
    """Polls /metrics every `interval_s` while a cell runs; keeps each gauge's peak and its bound."""

    base: str
    interval_s: float = 1.0
    peaks: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    samples: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
        await self.poll()

    async def poll(self) -> None:
        try:
            values = await asyncio.to_thread(scrape, self.base)
        except OSError:
            return
        self.samples += 1
        for name in PEAK_GAUGES:
            if name in values:
                self.peaks[name] = max(self.peaks.get(name, 0.0), values[name])
        for name, bound in BOUNDS.items():
            if bound in values:
                self.bounds[name] = values[bound]
