"""The Serve routers' ranking, with stand-ins for Serve's replicas and requests (no cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from deployments.routers import DecoderAffinityRouter, EncoderAffinityRouter
from mmserve.messages import MultiModalFeatureSpec, PlaceholderRange, PreprocessedRequest, SamplingParams
from mmserve.runtime.affinity import DECISIONS, owner


class Loads:
    def __init__(self, loads: dict[str, int]) -> None:
        self.loads = loads

    def get(self, replica_id: Any) -> int | None:
        return self.loads.get(replica_id.unique_id)


def replicas(*names: str) -> list[Any]:
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n)) for n in names]


def router(cls: Any, loads: dict[str, int], **kwargs: Any) -> Any:
    r = object.__new__(cls)  # NOTE: Serve builds routers inside a handle; only the ranking is under test
    r.initialize_state(**kwargs)
    r._replica_queue_len_cache = Loads(loads)  # what the public `replica_queue_len_cache` property reads
    return r


def request(method: str, *args: Any, rid: str = "i1") -> Any:
    return SimpleNamespace(args=list(args), kwargs={}, routing_context=SimpleNamespace(should_backoff=False),
                           metadata=SimpleNamespace(call_method=method, internal_request_id=rid))


def feature(identifier: str, rows: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(identifier, "image", PlaceholderRange(0, rows + 2), num_embeds=rows)


def names(ranks: list[list[Any]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_an_encode_goes_first_to_the_owner_of_its_rows_unless_it_is_too_busy() -> None:
    cands = replicas("a", "b", "c")
    features = [feature("img-1", 256), feature("img-2", 16)]
    expected = owner([(b"img-1", 256), (b"img-2", 16)], ["a", "b", "c"])
    before = DECISIONS.counts()
    ranks = asyncio.run(router(EncoderAffinityRouter, {"a": 1, "b": 1, "c": 1}, load_margin=2)
                        .choose_replicas(cands, request("encode", "req-1", features)))
    assert names(ranks)[0] == [expected] and len(ranks) == 2 and len(ranks[1]) == 2  # then power of two
    busy = {n: (9 if n == expected else 0) for n in ("a", "b", "c")}
    pending = request("encode", "req-1", features, rid="i2")
    busy_router = router(EncoderAffinityRouter, busy, load_margin=2)
    for _ in range(3):  # Serve asks again on each pass of its loop: one decision counted
        ranks = asyncio.run(busy_router.choose_replicas(cands, pending))
        assert len(ranks) == 1 and len(ranks[0]) == 2  # over the margin: Serve's power of two choices
    assert pending.routing_context.should_backoff  # every rank full: Serve waits before it asks again
    after = DECISIONS.counts()
    assert after.get(("Encoder", "affinity"), 0) == before.get(("Encoder", "affinity"), 0) + 1
    assert after.get(("Encoder", "load_fallback"), 0) == before.get(("Encoder", "load_fallback"), 0) + 1
    other = asyncio.run(router(EncoderAffinityRouter, {}).choose_replicas(cands, request("metrics")))
    assert len(other) == 1  # a call without a routing key: no decision counted
    assert DECISIONS.counts() == after
    early = asyncio.run(router(EncoderAffinityRouter, {"a": 1, "b": 1, "c": 1}, load_margin=2)
                        .choose_replicas(cands, request("encode_early", "req-1/early", features, rid="i3")))
    assert names(early)[0] == [expected]  # an early encode goes where its request's encode will


def test_a_decode_follows_its_prompts_blocks_to_where_they_were_sent() -> None:
    cands = replicas("a", "b")
    r = router(DecoderAffinityRouter, {"a": 0, "b": 0}, load_margin=4, index_blocks=100)

    def pre(*hashes: bytes) -> PreprocessedRequest:
        return PreprocessedRequest("p", [1] * 64, [], SamplingParams(), block_hashes=hashes)

    first = asyncio.run(r.choose_replicas(cands, request("generate", pre(b"h1", b"h2"), rid="t1")))
    assert len(first) == 1  # nothing known yet: the least loaded of two
    r.on_request_routed(request("generate", pre(b"h1", b"h2"), rid="t1"), cands[1].replica_id, None)  # to "b"
    turn2 = asyncio.run(r.choose_replicas(cands, request("generate", pre(b"h1", b"h2", b"h3"), rid="t2")))
    assert names(turn2)[0] == ["b"]
    stranger = asyncio.run(r.choose_replicas(cands, request("generate", pre(b"x1"), rid="t3")))
    assert len(stranger) == 1
    r.on_request_routed(request("generate", pre(b"h1", b"h2", b"h3"), rid="t2"), cands[0].replica_id,
                        None)  # both hold h1, h2 now
    r._replica_queue_len_cache = Loads({"a": 3, "b": 0})
    shared = asyncio.run(r.choose_replicas(cands, request("generate", pre(b"h1", b"h2"), rid="t5")))
    assert names(shared)[0] == ["b"]  # a prefix both hold: the less loaded of them
    r.index.forget("b")  # what on_replica_actor_died does beside the base's bookkeeping
    assert names(asyncio.run(r.choose_replicas(cands, request("generate", pre(b"h1"), rid="t4"))))[0] == ["a"]


def test_requests_never_routed_leave_a_bounded_decision_and_a_routed_one_nothing() -> None:
    """A request cancelled before it was routed never comes back (Serve has no hook for it): nothing of it may
    stay without bound; a routed one's hashes go to the index, read from the routed request itself."""
    cands = replicas("a", "b")
    r = router(DecoderAffinityRouter, {"a": 0, "b": 0}, load_margin=4, index_blocks=100, pending_bound=3)

    def pre(i: int) -> PreprocessedRequest:
        return PreprocessedRequest("p", [1] * 64, [], SamplingParams(), block_hashes=(b"h%d" % i, b"g%d" % i))

    for i in range(5):  # asked twice each, as Serve's loop may
        for _ in range(2):
            asyncio.run(r.choose_replicas(cands, request("generate", pre(i), rid=f"c{i}")))
    assert list(r._decided) == ["c2", "c3", "c4"]
    assert not r.index.best(pre(3).block_hashes, ["a", "b"])[0]  # only a routed request's blocks are noted
    r.on_request_routed(request("generate", pre(3), rid="c3"), cands[1].replica_id, None)
    assert list(r._decided) == ["c2", "c4"]
    assert r.index.best(pre(3).block_hashes, ["a", "b"])[0] == ["b"]
    assert set(vars(r)) <= {"load_margin", "pending_bound", "_decided", "index",
                            "_replica_queue_len_cache"}  # no other map to leak


