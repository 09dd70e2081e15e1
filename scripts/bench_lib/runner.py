"""Running a benchmark plan: bring systems up, probe them, run their cells, take them down.

Owns the order of events (and so what runs while what else is up): the in-process Engine is probed
before any server starts; each server is warmed up and probed right after its own start, before the
next one starts; cells run either interleaved (every system up, for each workload and concurrency
each system in turn: drift hits all alike, idle servers tax the busy one a little) or sequentially
(one system up at a time). Servers always stop, also on errors and SIGTERM.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_lib import procs, prom
from bench_lib.loadgen import CellRun, http_sender, run_cell
from bench_lib.probes import run_probe, summarize_probe
from bench_lib.stats import median_dicts, summarize
from bench_lib.systems import HTTP_SYSTEMS, MMSERVE_ARGS, HttpSystem, base_name, http_system
from bench_lib.workloads import BenchRequest


def check(run: CellRun, what: str) -> CellRun:
    """Print the failures of a run (a benchmark of failing requests measures nothing)."""
    failed = [r for r in run.results if not r.ok]
    if failed:
        print(f"  WARNING {what}: {len(failed)}/{len(run.results)} requests failed, e.g. {failed[0].error}")
    return run


@dataclass
class Bench:
    ckpt: Path
    run_dir: Path
    cells: dict[tuple[str, int], list[BenchRequest]]
    plan: list[BenchRequest]  # the probes
    warmup: list[BenchRequest]
    servers: dict[str, HttpSystem] = field(default_factory=dict)
    inproc: dict[str, Any] = field(default_factory=dict)
    probes: dict[str, Any] = field(default_factory=dict)
    runs: dict[tuple[str, str, int], CellRun] = field(default_factory=dict)
    results: dict[str, dict[str, dict[int, dict[str, Any]]]] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=lambda: {"systems": {}, "samples": 0})  # system -> peaks, bounds
    idle_cpu: dict[str, Any] = field(default_factory=dict)
    engine: Any = None  # the probed in-process Engine (its stage timers outlive its shutdown)

    # --- bring up ---------------------------------------------------------------------------------
    def probe_engine(self, keep: bool) -> None:
        """Probe the in-process Engine with nothing else running; keep it if it runs cells too."""
        from bench_lib.inprocess import EngineSystem

        engine = EngineSystem(self.ckpt, MMSERVE_ARGS)
        check(run_probe(self.warmup, engine.one, "engine warm-up"), "engine warm-up")
        run = check(run_probe(self.plan, engine.one, "engine probes"), "engine probes")
        self.probes.update(summarize_probe(run, "engine"))
        self.engine = engine
        self.probes["engine_breakdown_ms"] = {
            kind: median_dicts([engine.breakdown(engine.request_ids[r.key]) for r in run.results
                                if r.ok and r.key.startswith(f"probe-{kind}/")])
            for kind in ("overhead", "repeat", "text")}
        if keep:
            self.inproc["engine"] = engine
        else:
            engine.shutdown()
            engine.engine = None  # NOTE: frees the model; the timers stay
            gc.collect()

    def bring_up(self, name: str) -> None:
        if name == "generate":
            from bench_lib.inprocess import GenerateBaseline

            self.inproc["generate"] = GenerateBaseline(self.ckpt)
            check(self.inproc["generate"].run_cell(self.warmup, 1, "generate warm-up"), "generate warm-up")
        elif base_name(name) in HTTP_SYSTEMS:
            # NOTE: registered before it starts, so that take_down_all stops it even if the start fails
            server = self.servers[name] = http_system(name, self.ckpt, self.run_dir)
            print(f"starting {name} on {server.root} ...", flush=True)
            server.start()
            print(f"  {name} ready in {server.startup_s:.0f} s", flush=True)
            send = http_sender(server.base_url, server.model, self.warmup + self.plan, server.request_kwargs)
            check(run_probe(self.warmup, send, f"{name} warm-up"), f"{name} warm-up")
            run = check(run_probe(self.plan, send, f"{name} probes"), f"{name} probes")
            self.probes.update(summarize_probe(run, name))
            self.probes[f"{name}_probe_run"] = run
        if self.probes.get("mmserve_first_ttft_ms") and self.probes.get("engine_first_ttft_ms"):
            self.probes["engine_ttft_ms"] = self.probes["engine_first_ttft_ms"]
            self.probes["overhead_ratio"] = self.probes["mmserve_first_ttft_ms"] / self.probes["engine_first_ttft_ms"]

    def measure_idle(self, seconds: float = 5.0) -> None:
        """Cores each idle server uses (its background tax on the other systems' cells), top processes."""
        live = {n: s.pid for n, s in self.servers.items() if s.pid is not None}
        before = {n: procs.tree_cpu_by_pid(pid) for n, pid in live.items()}
        time.sleep(seconds)
        for n, pid in live.items():
            per: dict[str, float] = {}
            for child, (name, cpu) in procs.tree_cpu_by_pid(pid).items():
                used = cpu - before[n].get(child, (name, 0.0))[1]
                per[name] = per.get(name, 0.0) + used / seconds
            top = dict(sorted(per.items(), key=lambda kv: -kv[1])[:5])
            self.idle_cpu[n] = {"cores": sum(per.values()), "top": top}
            print(f"  idle {n} uses {sum(per.values()):.2f} cores: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in top.items()))

    # --- cells ------------------------------------------------------------------------------------
    def run_cells(self, systems: list[str]) -> None:
        for (workload, c), reqs in self.cells.items():
            for system in systems:
                own = [s.pid for s in self.servers.values() if s.pid is not None]
                load = procs.ForeignLoad([os.getpid(), *own])
                summary, run = self._run_one(system, workload, c, reqs)
                summary["machine_load"] = load.result()
                self.runs[(system, workload, c)] = run
                self.results.setdefault(workload, {}).setdefault(system, {})[c] = summary
                print(f"  {system:12} {workload:7} c={c}: {summary['req_per_s'] or 0:.2f} req/s, TTFT p50 "
                      f"{1e3 * (summary['ttft_p50_s'] or 0):.0f} ms, ok {summary['ok']}/{summary['requests']}; other "
                      f"processes used {summary['machine_load']['foreign_cores']:.2f} cores meanwhile")

    def _run_one(self, system: str, workload: str, c: int, reqs: list[BenchRequest]) -> tuple[dict[str, Any], CellRun]:
        desc = f"{system} {workload} c={c}"
        if system in self.servers:
            return self._run_http(system, self.servers[system], desc, c, reqs)
        sampler = procs.RssSampler(os.getpid(), recursive=False).start()
        if system == "generate":
            run = self.inproc["generate"].run_cell(reqs, c, desc)
        else:
            run = asyncio.run(run_cell(reqs, c, self.inproc["engine"].one, desc))
        sampler.stop()
        summary = summarize(check(run, desc))
        summary["peak_rss_bytes"] = sampler.window_peak
        return summary, run

    def _run_http(self, system: str, server: HttpSystem, desc: str, c: int,
                  reqs: list[BenchRequest]) -> tuple[dict, CellRun]:
        send = http_sender(server.base_url, server.model, reqs, server.request_kwargs)
        before = poller = None
        if server.has_metrics:
            # NOTE: replicas push their metrics every `metrics_push_interval_s`: a scrape sooner after a cell
            # missed its last requests' counts (and gave them to the next cell)
            time.sleep(server.metrics_lag_s + 0.5)
            before = prom.scrape(server.root)
            poller = prom.GaugePoller(server.root)
        assert server.sampler is not None
        server.sampler.mark()

        async def go() -> CellRun:
            stop = asyncio.Event()
            task = asyncio.create_task(poller.run(stop)) if poller else None
            run = await run_cell(reqs, c, send, desc)
            stop.set()
            if task:
                await task
            return run

        run = check(asyncio.run(go()), desc)
        summary = summarize(run)
        summary["peak_rss_bytes"] = server.sampler.window_peak
        if poller is not None and before is not None:
            time.sleep(server.metrics_lag_s + 0.5)
            summary.update(prom.cache_figures(before, prom.scrape(server.root)))
            summary["gauge_peaks"] = poller.peaks
            self.memory["samples"] += poller.samples
            # NOTE: per system: a variant may set other bounds (e.g. a cache switched off)
            mine = self.memory["systems"].setdefault(system, {"peaks": {}, "bounds": {}})
            mine["bounds"].update(poller.bounds)
            for k, v in poller.peaks.items():
                mine["peaks"][k] = max(mine["peaks"].get(k, 0.0), v)
        return summary, run

    # --- take down --------------------------------------------------------------------------------
    def take_down(self, name: str) -> None:
        if name in self.servers and self.servers[name].proc is not None:
            t = time.perf_counter()
            self.servers[name].stop()
            killed = self.servers[name].killed_on_stop
            print(f"stopped {name} in {time.perf_counter() - t:.1f} s"
                  + (f"; had to kill leftover PIDs {killed}" if killed else "; no process left behind"))
        elif name in self.inproc:
            model = self.inproc.pop(name)
            if hasattr(model, "shutdown"):
                model.shutdown()
            if hasattr(model, "engine"):
                model.engine = None  # NOTE: frees the model (`self.engine` keeps the timers), as probe_engine does
            del model
            gc.collect()

    def take_down_all(self) -> None:
        for name in [*self.servers, *self.inproc]:
            self.take_down(name)
