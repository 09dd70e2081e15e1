"""Where the CPU goes while mmserve serves a cell: CPU time per request of every process of the served
app (and, for the busiest, per kind of thread), on the benchmark checkpoint, so that a gap to the
in-process Engine is explained by a measured breakdown rather than by "Ray's overhead".

  python scripts/bench_cpu.py                          # hot at concurrency 8, ~2 min on 2 cores
  python scripts/bench_cpu.py --workload unique --concurrency 1 --requests 16
  python scripts/bench_cpu.py --set decoder.stream_interval_ms=50    # an app argument changed, as serve run k=v
Prints the table; nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import psutil  # noqa: E402
from bench_lib import procs  # noqa: E402
from bench_lib.checkpoint import bench_checkpoint  # noqa: E402
from bench_lib.loadgen import http_sender, run_cell  # noqa: E402
from bench_lib.systems import Mmserve  # noqa: E402
from bench_lib.workloads import cell_requests  # noqa: E402

# split by thread
THREADS_OF = ("mmserve:Ingress", "ProxyActor", "mmserve:Decoder", "mmserve:Preprocess", "mmserve:Encoder")
Key = tuple[int, str]  # (pid, command line)


def process_cpu(root: int) -> dict[Key, float]:
    """CPU seconds (user + system) so far of every process in the tree under `root`."""
    out = {}
    for p in procs.tree(root):
        try:
            times = p.cpu_times()
            out[(p.pid, " ".join(p.cmdline())[:60])] = times.user + times.system
        except psutil.Error:
            continue
    return out


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of one process (threads of one name summed; Python's threads all carry
    the process title they started under, Ray's C++ threads their own names)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def measure(server: Mmserve, workload: str, concurrency: int, n: int, seed: int, tokenizer) -> None:
    reqs = cell_requests(workload, concurrency, n, seed, tokenizer)
    send = http_sender(server.base_url, server.model, reqs, server.request_kwargs)
    assert server.pid is not None
    before = process_cpu(server.pid)
    split = {key: thread_cpu(key[0]) for key in before if any(w in key[1] for w in THREADS_OF)}
    machine0, started = psutil.cpu_times(), time.perf_counter()
    run = asyncio.run(run_cell(reqs, concurrency, send, f"{workload} c={concurrency}"))
    wall, after, machine1 = time.perf_counter() - started, process_cpu(server.pid), psutil.cpu_times()
    ok = sum(r.ok for r in run.results)
    busy = (sum(machine1) - sum(machine0) - (machine1.idle - machine0.idle)) / wall
    print(f"\n{workload} c={concurrency}: {ok}/{len(reqs)} ok in {wall:.1f} s = {ok / wall:.2f} req/s; "
          f"the machine {busy:.2f} cores busy (of {psutil.cpu_count()})")
    for spent, key in sorted(((after[k] - before.get(k, 0.0), k) for k in after), reverse=True)[:12]:
        line = f"  {spent * 1000 / ok:7.1f} ms CPU/request  {spent / wall:4.2f} cores  {key[1]}"
        if key in split:
            now = thread_cpu(key[0])
            threads = sorted(((now[t] - split[key].get(t, 0.0), t) for t in now), reverse=True)[:3]
            line += "  [" + ", ".join(f"{t} {s * 1000 / ok:.1f}" for s, t in threads) + "]"
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="hot")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an app argument on top of the benchmark's (repeatable)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    ckpt = bench_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    overrides = dict(item.split("=", 1) for item in args.set)
    server = Mmserve(ckpt, Path(tempfile.mkdtemp(prefix="mmserve-bench-cpu-")), app_args=overrides)
    server.start()
    try:
        measure(server, args.workload, args.concurrency, 16, 7, tokenizer)  # warm-up: its own images
        measure(server, args.workload, args.concurrency, args.requests, 11, tokenizer)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
