"""Cache-affinity routing: which replica should take a request so that it finds its caches warm.

Owns: the rendezvous (highest-random-weight) owner of content keys among the live replicas, the
bounded-load rule, an approximate per-replica index of the prompt blocks each replica was sent (aged out
as its prefix cache would evict them), and the count of decisions. Does not own: how replicas are known,
probed or sent a request (the Ray Serve routers, `deployments/routers.py`), nor any cache.

Rendezvous hashing: each (key, replica) pair gets a pseudo-random weight and a key belongs to the replica
of highest weight, so a replica joining or leaving moves only the keys it gains or held. A request with
several items goes to the replica owning most of its embedding rows.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

from mmserve.runtime.metrics import LabelValues, Metric, MetricsSnapshot, Value, snapshot_of

Decision = str  # "affinity" | "load_fallback" | "no_key" | "no_match"


def weight(key: bytes, replica: str) -> int:
    """The pair's rendezvous weight: a 64-bit digest, the same in every process."""
    return int.from_bytes(hashlib.blake2b(key + b"\0" + replica.encode(), digest_size=8).digest(), "little")


def owner(keys: Sequence[tuple[bytes, int]], replicas: Sequence[str]) -> str | None:
    """The replica owning the most rows of `keys` ((key, rows) pairs), ties to the smaller name; None if
    there is no key or no replica."""
    if not replicas:
        return None
    rows: Counter[str] = Counter()
    for key, n in keys:
        rows[max(replicas, key=lambda r: weight(key, r))] += n
    if not rows:
        return None
    return min(rows, key=lambda r: (-rows[r], r))


def overloaded(load: int | None, loads: Sequence[int | None], margin: int) -> bool:
    """Whether a replica with `load` ongoing requests is busier than the least loaded of `loads` by more than
    `margin`. An unknown load (None: the caller has not heard from that replica lately) counts as idle.

    NOTE: a caller hears a replica's load only when it probes it, and it probes only the replicas it ranks
    first: were an unknown one left out, a preferred replica would keep every request (up to its own bound)
    while the others stay unheard of; counted idle, the request goes to the fallback, whose probe tells.
    An unknown `load` is not overloaded: the probe of the preferred replica tells whether it takes more."""
    return load is not None and bool(loads) and load > min(x or 0 for x in loads) + margin


class PrefixIndex:
    """Per replica, the prompt block hashes most recently sent there, at most `capacity` each (LRU).

    NOTE: approximate by design: it records what was routed, not what the replica still caches; the
    capacity stands for the replica's prefix cache, which evicts least-recently-used blocks too.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}
        self._lock = threading.Lock()  # NOTE: a router's callbacks and its routing may run on other threads

    def record(self, replica: str, hashes: Sequence[bytes]) -> None:
        """Note a prompt's chain sent to `replica`. NOTE: its tail first, so that the head, which every later
        turn needs, is the most recent and the last to age out (as the cache frees tail blocks first)."""
        with self._lock:
            blocks = self._blocks.setdefault(replica, OrderedDict())
            for h in reversed(hashes):
                blocks[h] = None
                blocks.move_to_end(h)
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)

    def best(self, hashes: Sequence[bytes], replicas: Sequence[str]) -> tuple[list[str], int]:
        """The replicas holding the longest leading run of `hashes` (all those tied) and its length."""
        best: list[str] = []
        longest = 0
        with self._lock:
            for replica in replicas:
                blocks = self._blocks.get(replica)
                n = 0
                while blocks and n < len(hashes) and hashes[n] in blocks:
                    n += 1
                if n and n == longest:
                    best.append(replica)
                elif n > longest:
                    best, longest = [replica], n
        return best, longest

    def forget(self, replica: str) -> None:
        with self._lock:
            self._blocks.pop(replica, None)

    def retain(self, replicas: set[str]) -> None:
        """Drop every replica not in `replicas` (gone by a scale-down)."""
        with self._lock:
            for gone in set(self._blocks) - replicas:
                del self._blocks[gone]


class RoutingDecisions:
    """How routers in this process decided, per deployment; thread-safe."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, Decision]] = Counter()
        self._lock = threading.Lock()

    def add(self, deployment: str, decision: Decision) -> None:
        with self._lock:
            self._counts[(deployment, decision)] += 1

    def counts(self) -> dict[tuple[str, Decision], int]:
        with self._lock:
            return dict(self._counts)

    def snapshot(self) -> MetricsSnapshot:
        values: dict[LabelValues, Value] = {labels: float(n) for labels, n in self.counts().items()}
        return snapshot_of(Metric("mmserve_routing_decisions_total", "counter",
                                  "Requests routed, by deployment and decision (affinity, load_fallback, "
                                  "no_key, no_match).", ("deployment", "decision"), values))


# NOTE: every router of this process counts here, its replica's metrics push it; read it as
# `affinity.DECISIONS`: Ray pickles a deployment class by value, with the globals its methods name.
DECISIONS = RoutingDecisions()
