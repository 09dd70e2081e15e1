"""Request router of the Encoder deployment: `release` goes back to the replica that encoded.

Owns: pinning `release(request_id, replica_id=...)` calls to that replica (its encoder-cache
references live there); every other call takes Serve's default power-of-two choice. This is also
where cache-affinity routing of an image to the replica holding its embeddings will go.
"""

from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica


class EncoderRouter(PowerOfTwoChoicesRequestRouter):
    # NOTE: subclasses Serve's default router (a private module in Ray 2.60) to keep its load
    # balancing for `encode` and change only `release`.
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = _release_target(pending_request)
        if target is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            # A replica that is gone took its references with it: any replica answers the no-op.
            return [pinned] if pinned else [candidate_replicas]
        return await super().choose_replicas(candidate_replicas, pending_request)


def _release_target(request: PendingRequest | None) -> str | None:
    if request is None or request.metadata.call_method != "release":
        return None
    return request.kwargs.get("replica_id")
