"""This process's resident memory, as a gauge labelled by replica.

Owns: reading the resident set size and the `mmserve_replica_resident_bytes` metric. Does not own: when
it is reported (deployments/metrics_hub.py pushes it with every replica's snapshot). Labelled by replica,
so summing snapshots over replicas keeps one series per replica instead of adding them up.
"""

from __future__ import annotations

import resource
from pathlib import Path

from mmserve.runtime.metrics import Metric, MetricsSnapshot, snapshot_of

RESIDENT_BYTES = "mmserve_replica_resident_bytes"


def resident_bytes() -> int:
    """Resident memory of this process's own (bytes): its RSS less the shared memory it maps.

    NOTE: less shared memory because Ray's object store is shared memory that every process reading an
    object maps: counted in, a replica's figure would rise and fall with the objects it happens to read
    (the store's own bound covers them), and hide or fake a leak of the process itself. Where
    /proc/self/status is missing, the peak RSS instead.
    """
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        kib = int(fields["VmRSS"].split()[0]) - int(fields.get("RssShmem", "0 kB").split()[0])
        return kib * 1024
    except (OSError, ValueError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def resident_memory_snapshot(replica: str) -> MetricsSnapshot:
    help = "Resident memory of one replica's process, less mapped shared memory (bytes)."
    return snapshot_of(Metric(RESIDENT_BYTES, "gauge", help, ("replica",), {(replica,): float(resident_bytes())}))
