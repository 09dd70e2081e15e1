"""What Serve's own processes cost the engine's work while they idle, measured on this machine.

Owns: finding the Serve processes of the Ray this process started (its controller, its HTTP proxy and every
replica), counting how often each wakes (voluntary context switches, all threads), and timing the same
in-process work in alternating blocks with those processes running idle and with them stopped (SIGSTOP;
resumed when the block ends, by an exception or Ctrl-C too). Does not own the work timed (the caller's
callables) nor starting Ray.

NOTE: why: Serve's processes wake often while no request is in flight (Ray's core worker checks signals on
every worker's main thread on a fixed period, beside its RPC pollers), and each wake takes a core from the
engine's threads. Stopping them is the only way to see that cost by itself, next to the same work in the same
minute. A stopped Serve answers nothing, so a block is short and runs between probes, with no request in
flight. Ray's own daemons (GCS, raylet, dashboard) stay running (docs/benchmarks.md has what stopping those
gave).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator

import psutil

from bench_lib.procs import tree

SERVE_TITLES = ("ServeController", "ProxyActor", "HAProxyManager", "ServeReplica")  # Ray's titles for Serve's actors
STOP_SETTLE_S = 0.05  # after stopping, before timing: the signals are delivered (s)
# NOTE: longer after resuming: the resumed processes first catch up on the timers and RPCs that came due while
# they were stopped, which would land on a running block that starts at once
RESUME_SETTLE_S = 0.5  # (s)


def serve_processes() -> list[psutil.Process]:
    """Serve's controller, proxy and replicas among this process's descendants: the Ray that
    `ray.init(address="local")` started here (never by name across the machine, where other people's Ray
    clusters may run). Raises if there are none: a tax measured over nothing would read as no tax."""
    found = []
    for proc in tree(os.getpid())[1:]:
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.cmdline())
            if cmd.startswith("ray::") and any(title in cmd for title in SERVE_TITLES):
                found.append(proc)
    if not found:
        raise RuntimeError("no Serve process among this process's descendants: was Ray started here?")
    return found


def wakeups_per_s(procs: list[psutil.Process], seconds: float = 5.0) -> dict[str, float]:
    """Process title -> voluntary context switches per second, all its threads, over `seconds`.
    NOTE: a thread that ends within the window takes its count with it, so a figure errs low, never high."""
    def count() -> dict[int, tuple[str, int]]:
        out = {}
        for proc in procs:
            with contextlib.suppress(psutil.Error, OSError):
                out[proc.pid] = (" ".join(proc.cmdline())[:48], _voluntary_switches(proc.pid))
        return out

    before = count()
    time.sleep(seconds)
    after = count()
    return {f"{title} ({pid})": max(n - before[pid][1], 0) / seconds
            for pid, (title, n) in after.items() if pid in before}


def _voluntary_switches(pid: int) -> int:
    """Summed over the process's threads. NOTE: Linux's /proc/<pid>/status (what psutil reads) counts the main
    thread's alone, and Ray's RPC threads wake as often as it does."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as status:
            total += next((int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches")), 0)
    return total


@contextlib.contextmanager
def stopped(procs: list[psutil.Process]) -> Iterator[None]:
    """`procs` stopped for the block, resumed after it however it ends.
    NOTE: Ctrl-C is held back while signals go out, so that it cannot leave a process stopped halfway through
    either loop; it is delivered once they have all gone. (A SIGTERM must unwind too: the caller installs a
    handler that raises SystemExit, as bench_path.py does.)"""
    try:
        _signal_all(procs, signal.SIGSTOP)
        time.sleep(STOP_SETTLE_S)
        yield
    finally:
        _signal_all(procs, signal.SIGCONT)
        time.sleep(RESUME_SETTLE_S)


def _signal_all(procs: list[psutil.Process], sig: signal.Signals) -> None:
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def idle_tax(work: Callable[[], float], procs: list[psutil.Process], rounds: int = 6,
             per_block: int = 3) -> dict[str, float]:
    """`work()` (returns its own ms) run `per_block` times with `procs` running, and as often with them
    stopped, the order alternating round by round -> each arm's median of its blocks (ms), and `ratio`: the
    median over rounds of the round's running block over its stopped one (not the ratio of the medians)."""
    running: list[float] = []
    halted: list[float] = []
    for r in range(rounds):
        for stop in (False, True) if r % 2 == 0 else (True, False):
            with stopped(procs) if stop else contextlib.nullcontext():
                block = statistics.median(work() for _ in range(per_block))
            (halted if stop else running).append(block)
    return {"running_ms": statistics.median(running), "stopped_ms": statistics.median(halted),
            "ratio": statistics.median(a / b for a, b in zip(running, halted, strict=True))}
