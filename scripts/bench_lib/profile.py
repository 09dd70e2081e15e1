"""Where mmserve's time to first token goes: per cell and per probe kind, from Ray Serve's replica
logs (the app) and from the stage timers of the in-process Engine; and how to print it.

Owns assembling those breakdowns after a run (raylogs.py owns the log format, inprocess.py the timers).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from bench_lib import raylogs
from bench_lib.loadgen import CellRun
from bench_lib.stats import median_dicts
from bench_lib.systems import base_name, serve_request_id


def collect(bench: Any, run_dir: Path) -> dict[str, Any]:
    """{'mmserve <workload> c=<c>' | 'mmserve probe-<kind>' | 'engine ...': component medians in ms}."""
    out: dict[str, Any] = {}
    for name, server in bench.servers.items():
        if base_name(name) == "mmserve":
            out.update(_from_serve_logs(name, server, bench, run_dir))
    for kind, row in bench.probes.get("engine_breakdown_ms", {}).items():
        out[f"engine probe-{kind}"] = row
    engine = bench.engine
    if engine is not None:
        for (system, workload, c), run in bench.runs.items():
            if system == "engine":
                out[f"engine {workload} c={c}"] = median_dicts(
                    [engine.breakdown(engine.request_ids[r.key]) for r in run.results if r.ok])
        out["engine_vision_forward_ms_per_crop"] = engine.median_forward_ms_per_crop()
    return out


def _from_serve_logs(name: str, server: Any, bench: Any, run_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    logs = server.ray_session_logs()
    if logs is not None:
        keep = run_dir / f"{server.log.stem}_serve_logs"
        shutil.copytree(logs / "serve", keep, ignore=shutil.ignore_patterns("proxy_*", "controller_*"),
                        dirs_exist_ok=True)
        calls = raylogs.parse_serve_logs(keep)

        def rows(run: CellRun, prefix: str = "") -> list[dict[str, float]]:
            found = [raylogs.breakdown(calls.get(serve_request_id(r.key), {}), run.epoch0 + r.start_s,
                                       run.epoch0 + r.start_s + r.ttft_s)
                     for r in run.results if r.ok and r.ttft_s and r.key.startswith(prefix)]
            return [r for r in found if r]

        probe_run = bench.probes.get(f"{name}_probe_run")
        if probe_run is not None:
            for kind in ("overhead", "repeat", "text"):
                out[f"{name} probe-{kind}"] = raylogs.median_breakdown(rows(probe_run, f"probe-{kind}/"))
        for (system, workload, c), run in bench.runs.items():
            if system == name:
                out[f"{name} {workload} c={c}"] = raylogs.median_breakdown(rows(run))
    return out


def print_probes(probes: dict[str, Any], profile: dict[str, Any]) -> None:
    fmt = lambda k: "-" if probes.get(k) is None else f"{probes[k]:.0f}"  # noqa: E731
    rows = [n for n in ("engine", "mmserve", "transformers") if probes.get(f"{n}_first_ttft_ms") is not None]
    if rows:
        print("single-request probes (c=1, median TTFT ms):")
    for name in rows:
        print(f"  {name:12} new image {fmt(f'{name}_first_ttft_ms'):>6}   same image again "
              f"{fmt(f'{name}_repeat_ttft_ms'):>6}   text only {fmt(f'{name}_text_ttft_ms'):>6}")
    tables = {k: v for k, v in profile.items() if isinstance(v, dict) and v}
    if tables:
        print("TTFT breakdown, medians in ms (mmserve: Ray Serve replica logs; engine: stage timers):")
    for key, row in tables.items():
        print(f"  {key:24} " + "  ".join(f"{k}={v:.0f}" for k, v in row.items() if k != "requests"))
    if profile.get("engine_vision_forward_ms_per_crop"):
        per_crop = profile["engine_vision_forward_ms_per_crop"]
        print(f"  engine vision forward: {per_crop:.0f} ms per crop (median over forwards)")
