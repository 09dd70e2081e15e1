"""How much of this process's cores others took while it worked: other processes, and the hypervisor.

Owns: reading the busy time of the cores this process may run on (Linux's /proc/stat, steal included: time
the hypervisor gave our vCPU to another guest), over the intervals a caller marks, less this process's own
CPU time; the cores this process may run on, and how many of them it may compute on at once (its CPU
quota). Does not own what a caller makes of it (`step_threads.py`: a thread count measured while others
filled the cores is not trusted; the slots of `preprocess/image_slots.py`).

NOTE: /proc/stat counts in clock ticks (10 ms on Linux), per core, read at each start and stop, so a short
marking reads mostly where the ticks fell (docs/benchmarks.md has a probe by length). Less than MIN_WALL_S
of marked work tells nothing (None); past it, enough to tell a node where other processes start up
(importing torch, loading weights: a whole core each) from a quiet one. Niced time is left out: a niced
process yields its core to ours.

NOTE: nothing is known (`others()` answers None) where /proc/stat is missing (not Linux), names other cores
than this process's affinity (a container's view of it), or counts a whole host that a CPU quota shares
out (cgroup `cpu.max`, on this process's cgroup or one above it, a systemd slice's included): there the
busy time of "our" cores may be other tenants', on other cores.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path, PurePosixPath

PROC_STAT = Path("/proc/stat")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_BUSY_FIELDS = (0, 2, 5, 6, 7)  # user, system, irq, softirq, steal (nice left out; guest is inside user)
MIN_WALL_S = 0.25  # marked work shorter than this measures the ticks, not the company (s)


class CoreCompany:
    """Mark the work with `start()` / `stop()` (any number of times), then `others()`: the cores others kept
    busy on average while it ran."""

    def __init__(self, cores: set[int] | None = None, stat: Path = PROC_STAT,
                 quotas: tuple[Path, ...] | None = None) -> None:
        self.cores = cores if cores is not None else affinity()  # the cores this process may run on
        quota = cgroup_quota_cores(quotas)
        self._unknown = quota is not None and quota < len(self.cores)  # NOTE: a host shared out by quota
        self._stat, self._tick_s = stat, 1 / _ticks_per_second()
        self._started: tuple[float, float, float] | None = None  # (busy, own, wall) at the last start (s)
        self._summed = [0.0, 0.0, 0.0]  # (busy, own, wall) over the marked intervals (s)

    def start(self) -> None:
        busy = self._busy_s()
        self._unknown |= busy is None
        self._started = (busy or 0.0, time.process_time(), time.perf_counter())

    def stop(self) -> None:
        if self._started is None:
            raise RuntimeError("CoreCompany.stop() before start()")
        busy = self._busy_s()
        self._unknown |= busy is None
        now = (busy or 0.0, time.process_time(), time.perf_counter())
        self._summed = [total + end - begin for total, end, begin in zip(self._summed, now, self._started, strict=True)]
        self._started = None

    def others(self) -> float | None:
        """Cores (0 to len(cores)) that others kept busy on average over the marked intervals; None where
        unknown (see the NOTEs above: no counts of our cores, or less than MIN_WALL_S marked)."""
        busy, own, wall = self._summed
        if self._unknown or wall < MIN_WALL_S:
            return None
        return min(max((busy - own) / wall, 0.0), float(len(self.cores)))

    def _busy_s(self) -> float | None:
        """Busy time of `cores` since boot (s); None unless /proc/stat names each of them."""
        try:
            lines = self._stat.read_text().splitlines()
        except OSError:
            return None
        ticks, seen = 0, 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in self.cores:
                continue
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
            seen += 1
        return ticks * self._tick_s if seen == len(self.cores) else None


def affinity() -> set[int]:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def usable_cores(quotas: tuple[Path, ...] | None = None) -> int:
    """How many cores this process may compute on at once: its CPU affinity, bounded by the tightest CPU quota of
    its cgroup and those above it where one is set (a container's CPU limit; at least 1).

    NOTE: a container limited to a few CPUs on a big host sees every core of the host in its affinity. Threads
    past its quota are throttled, all of them at once, for the rest of each period (100 ms by default): a
    thread team sized by the affinity stalls every step."""
    cores = len(affinity())
    quota = cgroup_quota_cores(quotas)
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


def cgroup_quota_cores(paths: tuple[Path, ...] | None = None) -> float | None:
    """The cores the tightest CPU quota over this process allows: of its cgroup and every cgroup above it (v2
    `cpu.max`, v1 `cpu.cfs_quota_us`; `paths`: those files, by default `cgroup_quota_files()`); None: no quota."""
    quotas: list[float] = []
    for path in cgroup_quota_files() if paths is None else paths:
        try:
            text = path.read_text().split()
            period = int(text[1]) if len(text) > 1 else int((path.parent / "cpu.cfs_period_us").read_text())
            if text[0] not in ("max", "-1"):
                quotas.append(int(text[0]) / period)
        except (OSError, ValueError, IndexError, ZeroDivisionError):
            continue
    return min(quotas, default=None)


def cgroup_quota_files(proc: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> tuple[Path, ...]:
    """The CPU quota files of this process's cgroup and of each one above it, by /proc/self/cgroup, and the
    mount's own (a container's, where it sees its cgroup as the root).

    NOTE: a container with a cgroup namespace sees its own cgroup at the mount's root; a quota set on a
    process's own cgroup outside one (systemd's CPUQuota, a container sharing the host's cgroup namespace)
    is found under its path. (A cpuset, as Slurm's, narrows the affinity itself.)"""
    files = [root / "cpu.max", root / "cpu" / "cpu.cfs_quota_us"]  # v2, v1: the mount's own
    try:
        lines = proc.read_text().splitlines()
    except (OSError, ValueError):  # NOTE: ValueError: a cgroup named in bytes that are not UTF-8
        return tuple(files)
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, where = line.split(":", 2)  # hierarchy, its controllers, this process's cgroup
        bases: tuple[Path, ...]
        if controllers == "":  # v2's unified hierarchy
            bases, name = (root,), "cpu.max"
        elif "cpu" in controllers.split(","):
            # NOTE: the mount's name may list the controllers in another order than this line (`cpuacct,cpu`
            # here, `cpu,cpuacct` there): its `cpu` link first
            bases, name = (root / "cpu", root / controllers), "cpu.cfs_quota_us"
        else:
            continue
        parts = PurePosixPath(where).parts[1:]
        for base in bases:
            files += [base.joinpath(*parts[:depth]) / name for depth in range(len(parts), 0, -1)]
    return tuple(dict.fromkeys(files))


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100
