"""Child processes of the benchmark: start in their own session, sample the RSS of their whole
process tree, stop them and make sure no descendant outlives them.

Owns: free ports, waiting for an HTTP endpoint, the RSS sampler thread, and a teardown that kills
only the PIDs this benchmark started (never by name: other people's Ray clusters share the machine).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (never 8000)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 8000:
            return port


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Until GET `url` answers 200; raises if `proc` exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"server exited with {proc.returncode} while starting:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def tree(root: int, recursive: bool = True) -> list[psutil.Process]:
    try:
        parent = psutil.Process(root)
        return [parent, *parent.children(recursive=True)] if recursive else [parent]
    except psutil.NoSuchProcess:
        return []


def tree_rss(root: int, recursive: bool = True) -> tuple[int, dict[str, int]]:
    """(sum of RSS bytes over the process tree, RSS by process name). NOTE: RSS counts pages shared
    between processes (libraries, the Ray object store's shared memory) once per process."""
    total = 0
    by_name: dict[str, int] = {}
    for p in tree(root, recursive):
        try:
            rss = p.memory_info().rss
            name = p.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += rss
        by_name[name] = by_name.get(name, 0) + rss
    return total, by_name


@dataclass
class RssSampler:
    """Samples tree_rss(root) every `interval_s` in a thread; `mark()` starts a new window."""

    root: int
    interval_s: float = 0.5
    recursive: bool = True  # False: the root process alone (the benchmark's own process)
    peak: int = 0  # whole life, bytes
    window_peak: int = 0  # since mark(), bytes
    peak_breakdown: dict[str, int] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)  # pid -> create time of every process seen
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def mark(self) -> None:
        self.sample()
        self.window_peak = 0
        self.sample()

    def sample(self) -> None:
        total, by_name = tree_rss(self.root, self.recursive)
        if self.recursive:
            self.seen.update(_identities(tree(self.root)))
        self.window_peak = max(self.window_peak, total)
        if total > self.peak:
            self.peak, self.peak_breakdown = total, by_name

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen:
    """Start `cmd` in a new session (its own process group), stdout+stderr to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = log.open("wb")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            cwd=cwd, start_new_session=True)


def _identities(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            out[p.pid] = p.create_time()
    return out


def stop(proc: subprocess.Popen, seen: dict[int, float], grace_s: float = 30.0) -> list[int]:
    """SIGTERM the process, wait, then SIGKILL any process of its tree still alive: those seen while
    it ran (pid -> create time, so a recycled PID is never touched) and those alive now.
    Returns the PIDs that had to be killed."""
    known = {**seen, **_identities(tree(proc.pid))}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    alive = []
    for pid, created in sorted(known.items()):
        if pid == proc.pid:
            continue
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) > 0.01:
                continue  # the PID was reused by someone else's process
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except psutil.NoSuchProcess:
            continue
        except psutil.TimeoutExpired:
            alive.append(p)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return [p.pid for p in alive]


def tree_cpu_s(root: int, recursive: bool = True) -> float:
    """CPU seconds (user + system) used so far by the live processes of the tree."""
    total = 0.0
    for p in tree(root, recursive):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def machine_cpu_s() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, all cores, steal excluded; steal seconds) so far."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return busy, getattr(t, "steal", 0.0)


class ForeignLoad:
    """How much CPU other people's processes took while a cell ran (cores, averaged over the cell)."""

    def __init__(self, own_roots: list[int]):
        self.roots = own_roots
        self._start = self._now()
        self._t = time.monotonic()

    def _now(self) -> tuple[float, float, float]:
        busy, steal = machine_cpu_s()
        ours = sum(tree_cpu_s(r) for r in self.roots[1:]) + tree_cpu_s(self.roots[0], recursive=False)
        return busy, steal, ours

    def result(self) -> dict[str, float]:
        (b0, s0, o0), (b1, s1, o1) = self._start, self._now()
        wall = max(1e-9, time.monotonic() - self._t)
        return {"foreign_cores": max(0.0, (b1 - b0) - (o1 - o0)) / wall, "own_cores": (o1 - o0) / wall,
                "steal_cores": (s1 - s0) / wall, "loadavg_1m": os.getloadavg()[0]}


def tree_cpu_by_pid(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds used so far) for the live processes of the tree.

    NOTE: keyed by pid, not name: Ray renames a worker's process title with the method it runs
    (`ray::ServeController` -> `ray::ServeController.listen_for_change`)."""
    out: dict[int, tuple[str, float]] = {}
    for p in tree(root):
        try:
            t = p.cpu_times()
            out[p.pid] = (p.name(), t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out
