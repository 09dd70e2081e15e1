"""The benchmark process's own glibc malloc, set as the replicas' environment sets theirs.

Owns: `malloc_as_replicas`. Does not own the replicas' settings (deployments/stage_args.py's DEFAULT_STAGE_ENV,
which glibc reads from the environment when a replica starts).

NOTE: why: an in-process Engine in this process is the baseline that the served path is compared with. Under
glibc's defaults it pays what the replicas no longer pay: a process that has started Ray holds glibc's 16
arenas (8 per core), the Engine's vision forward runs on a new thread each time and is handed the next one,
and blocks above the dynamic mmap threshold are mapped afresh; a forward then faults in its buffers again
(docs/benchmarks.md). The comparison is of the path, not of two allocators, so this process takes the
replicas' values. Set through `mallopt`, not the environment: the environment would also reach the Ray
processes this process starts, which a user's `serve run` starts without them.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from deployments.stage_args import DEFAULT_STAGE_ENV

# glibc's mallopt parameters (malloc.h) for the environment variables that set the same values
_PARAMS = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_ARENA_MAX": -8}


def malloc_as_replicas() -> dict[str, int]:
    """Apply DEFAULT_STAGE_ENV's malloc values to this process -> the values applied (none off glibc).

    NOTE: call it first, before torch or Ray start threads: glibc fixes the arena limit when a thread first
    needs an arena of its own."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to match
        return {}
    applied = {}
    for var, param in _PARAMS.items():
        if var in DEFAULT_STAGE_ENV and mallopt(param, int(DEFAULT_STAGE_ENV[var])) == 1:  # 1: accepted
            applied[var] = int(DEFAULT_STAGE_ENV[var])
    return applied
