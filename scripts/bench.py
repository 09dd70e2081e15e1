"""Benchmark mmserve against the servers its users would pick instead, on one machine, in one run.

Systems (each started and torn down here): `mmserve` (the Ray Serve app, `serve run` on a fresh local
Ray), `transformers` (`transformers serve`, plain mode), `generate` (transformers' generate in this
process, one request at a time) and, optionally, `engine` (mmserve's in-process Engine). The in-process
Engine is always probed for the pipeline-overhead target when mmserve runs.

By default one system runs at a time (`--order sequential`: no idle server beside the busy one, whose idle
processes tax it; the in-process Engine's cells first, right after its probes, and it is freed before any
server starts): the issues' targets are read from such runs. `--order interleaved` runs the cells in turn
(for each workload and concurrency, every system) with all servers up, so that the machine's drift hits every
system alike; an idle Ray app beside `transformers serve` then slows it, and the targets print as such (not
read). Only ratios taken in one run mean anything.

  python scripts/bench.py --requests 16                       # all systems, workloads, concurrencies
  python scripts/bench.py --quick --systems generate --workloads text --concurrency 1 --requests 2
Results: bench-results/<timestamp>/{results.json, table.txt, *.png, server logs}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import plots, profile, report, targets
from bench_lib.allocator import malloc_as_replicas
from bench_lib.checkpoint import BENCH_SIZES, bench_checkpoint, calibrate
from bench_lib.probes import probe_plan
from bench_lib.runner import Bench
from bench_lib.systems import MMSERVE_ARGS
from bench_lib.workloads import WORKLOADS, cell_requests, probe_requests

from mmserve.runtime.passing_thread import in_passing_thread

SYSTEMS = ("mmserve", "transformers", "generate", "engine")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--systems", type=system_list, default=["mmserve", "transformers", "generate"],
                    help=f"comma-separated, from {','.join(SYSTEMS)}; an HTTP system may carry extra environment "
                         "for its server process, e.g. mmserve+OMP_NUM_THREADS=2, and mmserve app arguments, "
                         "e.g. mmserve+decoder.torch_threads=1 (a variant, reported beside plain mmserve)")
    ap.add_argument("--workloads", type=csv, default=list(WORKLOADS), help=f"from {','.join(WORKLOADS)}")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in csv(s)], default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=None, help="requests per cell (default 16; --quick: 2)")
    ap.add_argument("--probes", type=int, default=None, help="single-request probes (default 5; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny cells, one probe, short calibration")
    ap.add_argument("--order", choices=("interleaved", "sequential"), default="sequential",
                    help="interleaved: all systems up, cells alternate (drift-robust; idle servers tax the busy "
                         "one); sequential: one system up at a time")
    ap.add_argument("--replicas", default=None, metavar="E,D",
                    help="also run mmserve with E Encoder and D Decoder replicas under each router: adds the systems "
                         "mmserve+encoder.num_replicas=E+decoder.num_replicas=D (affinity routing) and the same "
                         "with encoder.routing and decoder.routing set to Serve's default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    args = ap.parse_args(argv)
    if args.replicas:
        args.systems += replica_systems(args.replicas)
    bases = [s.split("+", 1)[0] for s in args.systems]  # NOTE: "mmserve+OMP_NUM_THREADS=2" is a variant
    for name, given, known in (("system", bases, SYSTEMS), ("workload", args.workloads, WORKLOADS)):
        if unknown := set(given) - set(known):
            ap.error(f"unknown {name}(s) {sorted(unknown)}; known: {', '.join(known)}")
    args.requests = args.requests or (2 if args.quick else 16)
    args.probes = args.probes or (1 if args.quick else 5)
    return args


def system_list(text: str) -> list[str]:
    """`--systems`, split at the commas outside a variant's JSON value (`mmserve+decoder.env={"A": "1", ...}`)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "{[") - (char in "}]")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [item for item in [*items, text[start:]] if item]


def replica_systems(spec: str) -> list[str]:
    """'2,2' -> the mmserve variants with 2 Encoder and 2 Decoder replicas under affinity and default routing."""
    encoders, decoders = (int(x) for x in spec.split(","))
    scaled = f"mmserve+encoder.num_replicas={encoders}+decoder.num_replicas={decoders}"
    return [scaled, scaled + '+encoder.routing="default"+decoder.routing="default"']


def _sigterm(*_: Any) -> None:
    raise SystemExit("SIGTERM")  # NOTE: unwinds through the finally block that stops the servers


def sequential_groups(systems: list[str]) -> list[list[str]]:
    """One system per group, the in-process Engine's first: it is up from its probes on (loaded in this process),
    so its cells run then and it is taken down (stopped and freed) before any server starts.

    NOTE: an Engine kept loaded in this process while a server's cells ran went with ~100 ms slower first 7-11
    vision forwards of that server in each such run measured, and with none in the runs without it, on an AMD
    VM; on an Intel VM a plain client saw them too, and their cause there was the replicas' malloc arenas,
    gone since an Encoder replica runs its forwards in its step thread with two arenas (deployments/stage_args.py,
    docs/benchmarks.md). "Sequential" means one system up."""
    return [[s] for s in sorted(systems, key=lambda s: s != "engine")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # NOTE: the in-process systems (Engine, generate) under the replicas' malloc settings (allocator.py)
    malloc = malloc_as_replicas()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # NOTE: in order with tqdm's stderr
    signal.signal(signal.SIGTERM, _sigterm)
    run_dir = args.out / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    doc: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "machine": report.machine(), "checkpoint_sizes": BENCH_SIZES, "mmserve_args": MMSERVE_ARGS}
    print(f"machine: {doc['machine']}; this process's malloc as the replicas': {malloc}")
    ckpt = bench_checkpoint()
    doc["checkpoint"] = str(ckpt)
    # NOTE: in a thread that ends: transformers' forwards in this (the main) thread would leave it an OpenMP pool
    # beside the in-process Engine's step thread's, and a second pool slows the Engine's steps
    # (mmserve/runtime/passing_thread.py; docs/benchmarks.md)
    doc["calibration"] = cal = in_passing_thread(lambda: calibrate(ckpt, repeats=1 if args.quick else 3))
    print(f"checkpoint {ckpt.name}: {cal['parameters_millions']:.1f} M parameters; sizes {BENCH_SIZES}")
    print(f"calibration: vision encoder {cal['encoder_ms_per_image']:.0f} ms per {cal['image_size']}-px image "
          "(target 100-500), "
          f"decoder step {cal['decoder_step_ms_b1']:.1f} ms at batch 1 (target 5-30), "
          f"296-token prefill {cal['prefill_ms_296_tokens']:.0f} ms")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    cells = {(w, c): cell_requests(w, c, args.requests, args.seed, tok) for w in args.workloads
             for c in args.concurrency}
    plan = probe_plan(probe_requests(args.seed, tok, args.probes, "overhead"),
                      probe_requests(args.seed, tok, args.probes, "text", image=False), tok, args.seed)
    # warm-up: a text request, an image request if a workload has images, one with crops for `multi`
    warmup = probe_requests(args.seed, tok, 1, "warmup-text", image=False)
    if set(args.workloads) - {"text"} or {"mmserve", "engine"} & set(args.systems):  # (probes send images)
        warmup += probe_requests(args.seed, tok, 1, "warmup")
    if "multi" in args.workloads:
        warmup += [replace(r, pan_and_scan=True) for r in probe_requests(args.seed, tok, 1, "warmup-crops")]
    bench = Bench(ckpt, run_dir, cells, plan, warmup, results={w: {} for w in args.workloads})
    try:
        if "mmserve" in args.systems or "engine" in args.systems:
            bench.probe_engine(keep="engine" in args.systems)
        groups = sequential_groups(args.systems) if args.order == "sequential" else [args.systems]
        for group in groups:
            for name in group:
                bench.bring_up(name)
            if len([n for n in group if n in bench.servers]) > 1:
                bench.measure_idle()
            bench.run_cells(group)
            if args.order == "sequential":
                for name in group:
                    bench.take_down(name)
    finally:
        bench.take_down_all()
    doc["profile"] = profile.collect(bench, run_dir)
    for server in bench.servers.values():  # NOTE: our own private RAY_TMPDIRs only (logs copied by profile)
        ray_tmp = getattr(server, "ray_tmp", None)
        if ray_tmp is not None:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    doc["probes"] = {k: v for k, v in bench.probes.items() if not k.endswith("_probe_run")}
    doc["idle_cpu"] = bench.idle_cpu
    doc["memory"] = bench.memory
    doc["results"] = bench.results
    doc["startup_s"] = {n: s.startup_s for n, s in bench.servers.items()}
    doc["peak_rss_bytes_whole_run"] = {n: s.sampler.peak for n, s in bench.servers.items() if s.sampler}
    doc["peak_rss_breakdown"] = {n: s.sampler.peak_breakdown for n, s in bench.servers.items() if s.sampler}
    checks = targets.evaluate(bench.results, bench.probes, bench.memory)
    if args.order == "interleaved":  # NOTE: an idle app beside the busy system taxes one side only: not read
        checks = [replace(t, status="SKIP", detail=f"{t.detail}; interleaved run: read targets from "
                                                   "--order sequential") for t in checks]
    doc["targets"] = [t.__dict__ for t in checks]
    doc["elapsed_s"] = time.perf_counter() - t_start
    table = report.cell_table(bench.results, args.systems)
    print("\n" + table + "\n")
    profile.print_probes(bench.probes, doc["profile"])
    print("\n".join(t.line() for t in checks))
    (run_dir / "table.txt").write_text(table + "\n\n" + "\n".join(t.line() for t in checks) + "\n")
    (run_dir / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    pngs = [plots.throughput(bench.results, run_dir), plots.ttft_cdf(bench.results, run_dir)]
    pngs += [p for p in [plots.ttft_breakdown(doc["profile"], run_dir)] if p is not None]
    print(f"\nwrote {run_dir}/results.json, table.txt, {', '.join(p.name for p in pngs)} "
          f"in {doc['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
