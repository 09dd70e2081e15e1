"""Cache-affinity request routers for the Encoder and the Decoder, on Ray Serve's public router interface.

Owns: reading a call's routing key (an encode's item content hashes and rows; a decode's prompt block
hashes) and ranking the candidate replicas: the one that should hold the request's cache entries first,
then two random ones (Serve probes a rank and takes its least loaded replica that accepts: power of two
choices), unless that replica is busier than the least loaded by more than `load_margin` requests.
Does not own the policy's arithmetic (`mmserve.runtime.affinity`) nor the caches. A router runs in each
caller's process (the Decoder's and Preprocess's replicas call the Encoder; the Ingress calls the Decoder).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mmserve.messages import MultiModalFeatureSpec, PreprocessedRequest
from mmserve.runtime import affinity
from mmserve.runtime.affinity import Decision, PrefixIndex, overloaded, owner

PENDING_BOUND = 4096  # requests being routed whose first decision is kept until routed (requests)
# calls that carry a routing key (an early encode goes where its request's encode will)
ROUTED_METHODS = {"Encoder": ("encode", "encode_early"), "Decoder": ("generate",)}


class _AffinityRouter(RequestRouter):
    deployment = ""

    def initialize_state(self, load_margin: int = 4, pending_bound: int = PENDING_BOUND, **kwargs: Any) -> None:
        self.load_margin = load_margin
        self.pending_bound = pending_bound  # the bound on `_decided` (requests)
        self._decided: OrderedDict[str, Decision] = OrderedDict()  # internal request id -> its first decision

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        fallback = [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        if pending_request is None:
            return fallback
        pending_request.routing_context.should_backoff = True  # NOTE: when every rank is full, Serve waits
        if pending_request.metadata.call_method not in ROUTED_METHODS[self.deployment]:
            return fallback
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {name: self.replica_queue_len_cache.get(r.replica_id) for name, r in by_name.items()}
        preferred, decision = self.preferred(pending_request, loads)
        if preferred is not None and overloaded(loads[preferred], list(loads.values()), self.load_margin):
            preferred, decision = None, "load_fallback"
        self._count(pending_request.metadata.internal_request_id, decision)
        return fallback if preferred is None else [[by_name[preferred]], *fallback]

    def preferred(self, request: PendingRequest, loads: dict[str, int | None]) -> tuple[str | None, Decision]:
        """The replica (of `loads`: replica -> ongoing requests, None if unknown) that should take it, and why."""
        raise NotImplementedError

    def _count(self, request_id: str, decision: Decision) -> None:
        """NOTE: once per request: Serve asks again on every pass of its loop and after a rejection."""
        if request_id in self._decided:
            return
        self._decided[request_id] = decision
        # NOTE: bounded: a request cancelled before it was routed never comes back here (Serve has no hook for it)
        while len(self._decided) > self.pending_bound:
            self._decided.popitem(last=False)
        affinity.DECISIONS.add(self.deployment, decision)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._decided.pop(pending_request.metadata.internal_request_id, None)  # NOTE: accepted: never asked again


class EncoderAffinityRouter(_AffinityRouter):
    """An encode goes to the replica that owns most of its embedding rows (rendezvous over content hashes)."""

    deployment = "Encoder"

    def preferred(self, request: PendingRequest, loads: dict[str, int | None]) -> tuple[str | None, Decision]:
        features = request.args[1] if len(request.args) > 1 else request.kwargs.get("features", [])
        keys = [(f.identifier.encode(), f.num_embeds) for f in features
                if isinstance(f, MultiModalFeatureSpec)]
        chosen = owner(keys, list(loads))
        return chosen, "affinity" if chosen is not None else "no_key"


class DecoderAffinityRouter(_AffinityRouter):
    """A decode goes to the replica most recently sent the longest run of its prompt's blocks; with no such
    replica, to the least loaded of two (and the request's blocks are noted where it went)."""

    deployment = "Decoder"

    def initialize_state(self, load_margin: int = 4, pending_bound: int = PENDING_BOUND, index_blocks: int = 65536,
                         **kwargs: Any) -> None:
        super().initialize_state(load_margin, pending_bound)
        self.index = PrefixIndex(index_blocks)

    def preferred(self, request: PendingRequest, loads: dict[str, int | None]) -> tuple[str | None, Decision]:
        hashes = _block_hashes(request)
        if not hashes:
            return None, "no_key"
        tied, _ = self.index.best(hashes, list(loads))
        if not tied:
            return None, "no_match"
        # NOTE: a prefix that several replicas hold (a shared system prompt) goes to the least loaded of them
        return min(tied, key=lambda r: (loads[r] or 0, random.random())), "affinity"

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        hashes = _block_hashes(pending_request)  # NOTE: read from the request itself: nothing kept until routed
        if hashes:
            self.index.record(replica_id.unique_id, hashes)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self.index.retain({r.replica_id.unique_id for r in replicas})  # scaled down: their entries go
        super().update_replicas(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.index.forget(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)


def _block_hashes(request: PendingRequest) -> tuple[bytes, ...]:
    """A `generate` call's prompt block hashes (none for another call)."""
    pre = request.args[0] if request.args else request.kwargs.get("request")
    return pre.block_hashes if isinstance(pre, PreprocessedRequest) else ()
