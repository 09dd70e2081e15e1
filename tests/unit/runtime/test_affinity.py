"""The routing policy's arithmetic: rendezvous owners, the bounded-load rule, the per-replica prefix index."""

from __future__ import annotations

import hashlib
from collections import Counter

from mmserve.runtime.affinity import PrefixIndex, RoutingDecisions, overloaded, owner

REPLICAS = ["r-a", "r-b", "r-c", "r-d"]


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_keys_spread_evenly_and_a_leaving_replica_moves_only_its_own() -> None:
    keys = [key(i) for i in range(2000)]
    before = {k: owner([(k, 1)], REPLICAS) for k in keys}
    shares = Counter(before.values())
    assert max(shares.values()) <= 1.5 * len(keys) / len(REPLICAS)  # no replica takes 1.5x the mean share
    after = {k: owner([(k, 1)], REPLICAS[:-1]) for k in keys}  # r-d leaves
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "r-d"}
    joined = {k: owner([(k, 1)], [*REPLICAS, "r-e"]) for k in keys}  # r-e joins: it takes keys, nobody else moves
    assert all(joined[k] in (before[k], "r-e") for k in keys) and "r-e" in joined.values()


def test_a_request_with_several_items_goes_where_most_of_its_rows_are_owned() -> None:
    small, big = key(1), key(2)
    owners = {k: owner([(k, 1)], REPLICAS) for k in (small, big)}
    if owners[small] == owners[big]:  # pick two keys with different owners
        big = next(key(i) for i in range(3, 100) if owner([(key(i), 1)], REPLICAS) != owners[small])
        owners[big] = owner([(big, 1)], REPLICAS)
    assert owner([(small, 16), (big, 256)], REPLICAS) == owners[big]
    assert owner([(small, 300), (big, 256)], REPLICAS) == owners[small]
    assert owner([], REPLICAS) is None and owner([(small, 1)], []) is None


def test_the_load_bound() -> None:
    assert not overloaded(5, [5, 2], margin=3)  # 5 <= 2 + 3
    assert overloaded(6, [6, 2], margin=3)
    assert not overloaded(None, [9, 0], margin=0)  # the preferred one's load unknown: its probe tells
    # NOTE: another's unknown load counts as idle, else a replica never probed would never be chosen
    assert overloaded(5, [5, 2, None], margin=3) and overloaded(40, [40, None], margin=4)
    assert not overloaded(4, [4, None], margin=4) and not overloaded(7, [7], margin=0)


def test_the_prefix_index_finds_the_longest_leading_run_and_ages_out_tails_first() -> None:
    index = PrefixIndex(capacity=6)
    chat = [key(i) for i in range(5)]
    index.record("r-a", chat[:2])
    index.record("r-b", chat[:4])
    assert index.best(chat, REPLICAS) == (["r-b"], 4)
    assert index.best([key(99), *chat], REPLICAS) == ([], 0)  # a run must start at the first block
    index.record("r-b", [key(50), key(51), key(52)])  # capacity 6: r-b's oldest block goes, its chain's tail
    assert index.best(chat, REPLICAS) == (["r-b"], 3)  # the head, which every later turn needs, stays
    index.record("r-c", chat[:3])
    assert index.best(chat, REPLICAS) == (["r-b", "r-c"], 3)  # ties: all of them, for the caller's load rule
    index.forget("r-b")
    index.retain({"r-a", "r-b"})  # r-c scaled away
    assert index.best(chat, REPLICAS) == (["r-a"], 2)


def test_decisions_are_counted_per_deployment() -> None:
    decisions = RoutingDecisions()
    for d in ("affinity", "affinity", "load_fallback"):
        decisions.add("Encoder", d)
    decisions.add("Decoder", "no_match")
    metric = decisions.snapshot().metrics["mmserve_routing_decisions_total"]
    assert metric.values == {("Encoder", "affinity"): 2.0, ("Encoder", "load_fallback"): 1.0,
                             ("Decoder", "no_match"): 1.0}
