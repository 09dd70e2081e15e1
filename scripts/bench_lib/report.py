"""The printed table: per workload, each concurrency and system, with mmserve/peer ratios beside
every peer's figures, and the machine description that goes with it.

Owns formatting only; the figures come from stats.py and prom.py.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

COLUMNS = (  # (key, header, scale, format, higher is better)
    ("req_per_s", "req/s", 1.0, "{:.2f}", True),
    ("out_tok_per_s", "tok/s", 1.0, "{:.1f}", True),
    ("ttft_p50_s", "TTFT p50 ms", 1e3, "{:.0f}", False),
    ("ttft_p99_s", "TTFT p99 ms", 1e3, "{:.0f}", False),
    ("e2e_p50_s", "E2E p50 ms", 1e3, "{:.0f}", False),
    ("e2e_p99_s", "E2E p99 ms", 1e3, "{:.0f}", False),
)


def write_results(results: dict[str, Any], out_dir: str | Path, kind: str) -> Path:
    """`results` as JSON in `out_dir/<kind>-<time>.json` (the folder made if needed); prints and returns the path."""
    out = Path(out_dir)
    out.mkdir(exist_ok=True)
    path = out / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}")
    return path


def machine() -> dict[str, Any]:
    model = "?"
    mem_kb = 0
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        mem_kb = next((int(ln.split()[1]) for ln in meminfo if ln.startswith("MemTotal")), 0)
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": model, "ram_gib": round(mem_kb / 2**20, 1),
            "python": platform.python_version(), "loadavg_at_start": os.getloadavg()}


def _fmt(value: float | None, scale: float, fmt: str) -> str:
    return "-" if value is None else fmt.format(value * scale)


def _ratio(mine: float | None, peer: float | None) -> str:
    return f"x{mine / peer:.2f}" if mine is not None and peer else ""


def cell_table(results: dict[str, dict[str, dict[int, dict[str, Any]]]], systems: list[str]) -> str:
    """results[workload][system][concurrency] = summary (+ cache figures, rss). Peer rows show
    'value (xR)' with R = mmserve / peer."""
    lines = []
    head = f"{'workload':8} {'c':>2} {'system':12} " + " ".join(f"{h:>18}" for _, h, *_ in COLUMNS)
    head += f" {'out tok':>8} {'proc hit':>8} {'enc hit':>8} {'kv hit':>8} {'peak RSS MiB':>12}"
    head += f" {'others':>6} {'steal':>6}"
    lines.append(head)
    lines.append("-" * len(head))
    for workload, by_system in results.items():
        concs = sorted({c for s in by_system.values() for c in s})
        for c in concs:
            mine = by_system.get("mmserve", {}).get(c)
            for system in systems:
                row = by_system.get(system, {}).get(c)
                if row is None:
                    continue
                cells = []
                for key, _, scale, fmt, _ in COLUMNS:
                    text = _fmt(row.get(key), scale, fmt)
                    if system != "mmserve" and mine is not None:
                        text += f" ({_ratio(mine.get(key), row.get(key))})"
                    cells.append(f"{text:>18}")
                toks = (f"{row['output_tokens_min']}-{row['output_tokens_max']}"
                        if row.get("output_tokens_min") is not None else "-")
                if row.get("output_tokens_min") is not None and row.get("prompt_tokens_mean") is None:
                    toks += "?"  # NOTE: no usage came back: non-empty chunks counted, which may be fewer than tokens
                hit = {k: "-" if row.get(k) is None else f"{row[k]:.0%}"
                       for k in ("processor_cache_hit_rate", "encoder_cache_hit_rate", "prefix_cache_hit_rate")}
                rss = row.get("peak_rss_bytes")
                others = row.get("machine_load", {}).get("foreign_cores")
                steal = row.get("machine_load", {}).get("steal_cores")
                lines.append(f"{workload:8} {c:>2} {system:12} " + " ".join(cells)
                             + f" {toks:>8} {hit['processor_cache_hit_rate']:>8} {hit['encoder_cache_hit_rate']:>8}"
                             + f" {hit['prefix_cache_hit_rate']:>8}"
                             + f" {'-' if rss is None else rss >> 20:>12}"
                             + f" {'-' if others is None else format(others, '.2f'):>6}"
                             + f" {'-' if steal is None else format(steal, '.2f'):>6}")
        lines.append("")
    lines.append("Ratios in parentheses are mmserve / that row's system (req/s, tok/s: higher is better for "
                 "mmserve; latencies: lower is better). Peak RSS: serving process tree (mmserve: every Ray "
                 "process; generate/engine: the benchmark process itself). others: CPU cores that processes outside "
                 "this benchmark used during the cell (0 on a quiet machine; the machine has "
                 f"{os.cpu_count()}). steal: CPU cores the hypervisor gave other machines while this one's "
                 "processes waited to run (its /proc/stat steal time; a cell with steal was slowed by the host, "
                 "not compared like with like). out tok ending in '?': the server sent no usage, so its non-empty "
                 "stream chunks were counted (fewer than its tokens where a token decodes to no text).")
    return "\n".join(lines)
