"""What Serve's own processes cost the engine's work while they idle, measured on this machine.

Owns: finding Serve's processes (its controller, its HTTP proxy and every replica), counting how often each
wakes (voluntary context switches), and timing the same in-process work in alternating blocks with those
processes running idle and with them stopped (SIGSTOP, always resumed, even when the work raises). Does not
own the work timed (the caller's callables) nor starting Ray.

NOTE: why: on a small node Serve's processes wake hundreds of times a second each while no request is in
flight (Ray's core worker checks signals on every worker's main thread every 10 ms, beside its RPC pollers),
and each wake takes a core from the engine's threads. Stopping them is the only way to see that cost by
itself, next to the same work in the same minute. A stopped Serve answers nothing, so a block is short and
runs between probes, with no request in flight. Ray's own daemons (GCS, raylet, dashboard) stay running:
stopping them as well moved nothing beyond the noise (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator

import psutil

SERVE_TITLES = ("ServeController", "ProxyActor", "ServeReplica")  # Ray's process titles for Serve's actors
PAUSE_S = 0.05  # after stopping or resuming, before timing: signals are delivered, wakes settle (s)


def serve_processes() -> list[psutil.Process]:
    """Serve's controller, proxy and replicas on this machine (not this process)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] != os.getpid() and any(title in cmd for title in SERVE_TITLES):
            found.append(proc)
    return found


def wakeups_per_s(procs: list[psutil.Process], seconds: float = 5.0) -> dict[str, float]:
    """Process title -> voluntary context switches per second, all its threads, over `seconds`."""
    def count() -> dict[int, tuple[str, int]]:
        out = {}
        for proc in procs:
            with contextlib.suppress(psutil.Error, OSError):
                out[proc.pid] = (" ".join(proc.cmdline())[:48], _voluntary_switches(proc.pid))
        return out

    before = count()
    time.sleep(seconds)
    after = count()
    return {f"{title} ({pid})": (n - before[pid][1]) / seconds for pid, (title, n) in after.items() if pid in before}


def _voluntary_switches(pid: int) -> int:
    """Summed over the process's threads. NOTE: Linux's /proc/<pid>/status (what psutil reads) counts the main
    thread's alone, and Ray's RPC threads wake as often as it does."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as status:
            total += next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
    return total


@contextlib.contextmanager
def stopped(procs: list[psutil.Process]) -> Iterator[None]:
    """`procs` stopped for the block, resumed after it whatever happens."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGCONT)
        time.sleep(PAUSE_S)


def idle_tax(work: Callable[[], float], procs: list[psutil.Process], rounds: int = 6,
             per_block: int = 3) -> dict[str, float]:
    """`work()` (returns its own ms) run `per_block` times with `procs` running, and as often with them
    stopped, the order alternating round by round -> medians (ms) and the median of the rounds' ratios."""
    running: list[float] = []
    halted: list[float] = []
    for r in range(rounds):
        for stop in (False, True) if r % 2 == 0 else (True, False):
            with stopped(procs) if stop else contextlib.nullcontext():
                block = statistics.median(work() for _ in range(per_block))
            (halted if stop else running).append(block)
    return {"running_ms": statistics.median(running), "stopped_ms": statistics.median(halted),
            "ratio": statistics.median(a / b for a, b in zip(running, halted, strict=True))}
