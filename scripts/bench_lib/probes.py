"""Single-request probes at concurrency 1, on an otherwise idle system.

Owns: the pipeline-overhead probe (one fresh image, TTFT via HTTP and the three deployments vs the
in-process Engine on the same request) and the cache-hit probe (the same image again, with another
prompt, right after its first sighting), plus a text-only pair that isolates the HTTP/ingress cost.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import replace
from typing import Any

from bench_lib.loadgen import CellRun, Send, run_cell
from bench_lib.workloads import BenchRequest, prompt_text


def probe_plan(first: list[BenchRequest], texts: list[BenchRequest], tokenizer, seed: int) -> list[BenchRequest]:
    """first[i], its repeat (same image, new prompt), alternating; then the text-only probes."""
    plan = []
    for i, req in enumerate(first):
        again = replace(req, key=f"probe-repeat/{i}", text=prompt_text(seed * 7919 + i + 17, tokenizer))
        plan += [req, again]
    return plan + texts


def summarize_probe(run: CellRun, prefix: str) -> dict[str, Any]:
    """Median TTFT (ms) of each probe kind in a probe run."""
    out: dict[str, Any] = {}
    for kind in ("overhead", "repeat", "text"):
        ttft = [r.ttft_s * 1e3 for r in run.results if r.ok and r.key.startswith(f"probe-{kind}/") and r.ttft_s]
        name = {"overhead": "first", "repeat": "repeat", "text": "text"}[kind]
        out[f"{prefix}_{name}_ttft_ms"] = statistics.median(ttft) if ttft else None
        out[f"{prefix}_{name}_ttft_ms_all"] = ttft
    return out


def run_probe(plan: list[BenchRequest], send: Send, desc: str) -> CellRun:
    return asyncio.run(run_cell(plan, 1, send, desc))
