"""How much of this process's cores others took over an interval: other processes, and the hypervisor.

Owns: reading the busy time of the cores this process may run on (Linux's /proc/stat, steal included: time
the hypervisor gave our vCPU to another guest) and taking this process's own CPU time out of it. Does not
own what a caller makes of it (`step_threads.py`: a thread count measured while others filled the cores is
not trusted).

NOTE: /proc/stat counts in clock ticks (10 ms on Linux), per core; over a measurement of a few hundred
milliseconds on two cores that is a resolution of a few percent of a core, enough to tell a node where
other processes start up (importing torch, loading weights: a whole core each) from a quiet one. Where
/proc/stat is not there (not Linux), nothing is known and `others()` answers None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (guest time is inside user)


@dataclass(frozen=True)
class _Sample:
    busy_s: float | None  # busy time of the cores summed since boot (s); None where unknown
    own_s: float  # this process's CPU time, all its threads (s)
    wall_s: float  # a monotonic clock (s)


class CoreCompany:
    """`start()`, run the work, then `others()`: the cores others kept busy meanwhile, on average."""

    def __init__(self, cores: set[int] | None = None, stat: Path = PROC_STAT) -> None:
        self.cores = cores if cores is not None else _affinity()  # the cores this process may run on
        self._stat, self._tick_s = stat, 1 / _ticks_per_second()
        self._start: _Sample | None = None

    def start(self) -> None:
        self._start = self._sample()

    def others(self) -> float | None:
        """Cores (0 to len(cores)) that others kept busy on average since `start()`; None where unknown."""
        if self._start is None:
            raise RuntimeError("CoreCompany.others() before start()")
        now, then = self._sample(), self._start
        if now.busy_s is None or then.busy_s is None or now.wall_s <= then.wall_s:
            return None
        theirs = (now.busy_s - then.busy_s) - (now.own_s - then.own_s)
        return min(max(theirs / (now.wall_s - then.wall_s), 0.0), float(len(self.cores)))

    def _sample(self) -> _Sample:
        return _Sample(self._busy_s(), time.process_time(), time.perf_counter())

    def _busy_s(self) -> float | None:
        try:
            lines = self._stat.read_text().splitlines()
        except OSError:
            return None
        ticks = 0
        seen = 0
        for line in lines:
            name, _, rest = line.partition(" ")
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in self.cores:
                continue
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
            seen += 1
        return ticks * self._tick_s if seen else None


def _affinity() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100
