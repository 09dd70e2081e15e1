"""The cluster-wide ProcessorCache: the HF image processor runs once for an image whichever
preprocess replica (on whichever node) sees it next, and an item found at the store outlives the replica
that made it, because the store replica then keeps (copies and owns) the object; a request still carrying
the maker's lost reference is served from that copy. An item never found at the store is not copied: it
dies with its maker, and is a miss afterwards.

Each preprocess replica is reached from a `NodeProbe` on its own node (Serve routes a handle's calls
to a replica on the caller's node first); every check also asks the replica who it is."""

from __future__ import annotations

import socket
import uuid
from typing import Any

import numpy as np
import pytest
import ray

from mmserve.engine import Engine
from mmserve.messages import ChatRequest, EncoderOutput, PreprocessedRequest, SamplingParams, StoredItem
from tests.integration.conftest import PREPROCESS_NODES, AppInfo, ClusterInfo
from tests.integration.helpers import (
    chat_body,
    data_url,
    encoder_forward_passes,
    post_json,
    replica_actors,
    replica_states,
    replica_suffix,
)
from tests.integration.test_cluster_serving import assert_same, engine_answer
from tests.waiting import wait_until


def image_request(url: str) -> ChatRequest:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return ChatRequest(f"it-{uuid.uuid4().hex}", [{"role": "user", "content": content}], SamplingParams(max_tokens=4))


def process_on(probe: Any, url: str) -> PreprocessedRequest:
    return ray.get(probe.call.remote("process", image_request(url)), timeout=120)


def info_on(probe: Any) -> dict[str, Any]:
    return ray.get(probe.call.remote("replica_info"), timeout=60)


def store_hits(app: AppInfo) -> float:
    return app.handle("ProcessorCacheStore").metrics.remote().result(timeout_s=60).value(
        "mmserve_processor_cache_hits_total")


def held(app: AppInfo, key: str) -> StoredItem | None:
    """The store's entry for `key` as it is (neither a lookup nor a reuse: it is not copied for this)."""
    return app.handle("ProcessorCacheStore").held.remote(key).result(timeout_s=60)


def stored_ref(app: AppInfo, key: str) -> Any:
    """The ref the store's index holds for `key`, or None."""
    found = held(app, key)
    return None if found is None else found.ref


def test_processor_runs_once_cluster_wide_and_the_other_node_hits(mm_app: AppInfo, preprocess_probes):
    node_a, node_b = PREPROCESS_NODES
    probe_a, probe_b = preprocess_probes[node_a], preprocess_probes[node_b]
    before = {role: info_on(p) for role, p in preprocess_probes.items()}
    for role, info in before.items():  # each probe reaches the replica on its own node
        assert mm_app.cluster.role_of(info["node_id"]) == role
    assert before[node_a]["replica_id"] != before[node_b]["replica_id"]
    from mmserve.preprocess.image_slots import FETCHING_PER_CORE
    from mmserve.runtime.core_company import usable_cores

    cores = usable_cores()  # NOTE: the nodes are this machine's processes: the same cores
    assert before[node_a]["slots"] == {"image": cores, "fetch": FETCHING_PER_CORE * cores}  # the replica's bounds

    url = data_url(seed=201)
    first = process_on(probe_a, url)  # a miss on node A: A's replica runs the HF processor and stores
    made = first.features[0].data.ref
    # NOTE: A's `adopt` is not awaited: until the store indexes the item, B's lookup could miss (and run
    # B's processor)
    wait_until(lambda: stored_ref(mm_app, first.features[0].identifier) is not None, timeout=30,
               interval=0.05, what="the store to index the item")
    assert held(mm_app, first.features[0].identifier) == first.features[0].data  # the maker's: no copy yet
    hits_before = store_hits(mm_app)
    repeats = [process_on(probe_b, url) for _ in range(3)]  # node B's replica: hits, no processor run

    after = {role: info_on(p) for role, p in preprocess_probes.items()}
    assert {r: i["replica_id"] for r, i in after.items()} == {r: i["replica_id"] for r, i in before.items()}
    assert first.processor_cache_hits == 0
    assert [r.processor_cache_hits for r in repeats] == [1, 1, 1]
    assert after[node_a]["image_processor_calls"] == before[node_a]["image_processor_calls"] + 1
    assert after[node_b]["image_processor_calls"] == before[node_b]["image_processor_calls"]
    assert store_hits(mm_app) == hits_before + 3
    # Every request carries the processed pixels: the first the maker's object, the repeats the store's copy
    # (made on the first hit).
    pixels = ray.get(made, timeout=60).pixel_values
    assert pixels.shape[1:] == (3, 224, 224) and np.isfinite(pixels).all()
    for r in repeats:
        assert r.features[0].identifier == first.features[0].identifier
        assert np.array_equal(ray.get(r.features[0].data.ref, timeout=60).pixel_values, pixels)
        assert r.features[0].data.ref != made

    # The probe on node B does reach B's replica for `process` too: a new image runs B's processor.
    process_on(probe_b, data_url(seed=202))
    assert info_on(probe_b)["image_processor_calls"] == after[node_b]["image_processor_calls"] + 1
    assert info_on(probe_a)["image_processor_calls"] == after[node_a]["image_processor_calls"]


def test_killing_the_replica_that_stored_an_item_does_not_lose_it(mm_app: AppInfo, preprocess_probes,
                                                                  reference_engine: Engine):
    node_a, node_b = PREPROCESS_NODES
    probe_a, probe_b = preprocess_probes[node_a], preprocess_probes[node_b]
    url = data_url(seed=203)  # an image no stage has seen: the encoder will need its pixels
    first = process_on(probe_a, url)
    assert first.processor_cache_hits == 0
    # Never found at the store: these die with their maker (the second dropped once the first is found lost).
    once, twice = (process_on(probe_a, data_url(seed=seed)).features[0].identifier for seed in (204, 205))
    handed = process_on(probe_a, data_url(seed=206)).features[0].identifier  # kept as a graceful shutdown would
    victim_id = info_on(probe_a)["replica_id"]
    [victim] = [a for a in replica_actors(mm_app.name, "Preprocess") if replica_suffix(a["name"]) == victim_id]
    assert victim["node_id"] == mm_app.cluster.node_ids[node_a]

    key = first.features[0].identifier
    wait_until(lambda: stored_ref(mm_app, key) is not None, timeout=30, interval=0.05, what="the store to index it")
    assert process_on(probe_b, url).processor_cache_hits == 1  # a hit at the store: it keeps a copy
    assert (kept := held(mm_app, key)) is not None and kept.kept
    wait_until(lambda: all(held(mm_app, k) is not None for k in (once, twice, handed)), timeout=30,
               interval=0.05, what="the store to index the other items")
    assert all((entry := held(mm_app, k)) is not None and not entry.kept for k in (once, twice, handed))
    assert mm_app.handle("ProcessorCacheStore").keep.remote([handed]).result(timeout_s=60) == 1
    ray.kill(ray.get_actor(victim["name"], namespace="serve"), no_restart=True)

    def replaced() -> bool:  # Serve started a new replica in its place (it can only go on node A)
        alive = replica_actors(mm_app.name, "Preprocess")
        ids = {replica_suffix(a["name"]) for a in alive}
        return len(alive) == 2 and victim_id not in ids and replica_states(mm_app.name, "Preprocess") == {"RUNNING": 2}

    wait_until(replaced, timeout=180, interval=1.0, what="Serve to replace the killed preprocess replica")
    node_a_id = mm_app.cluster.node_ids[node_a]
    # (Until the probe's router learns of the replacement it may answer from node B's replica.)
    new_a = wait_until(lambda: (i := info_on(probe_a))["replica_id"] != victim_id and i["node_id"] == node_a_id and i,
                       timeout=60, what="node A's probe to reach the replacement replica")
    assert new_a["image_processor_calls"] == 0
    calls_b = info_on(probe_b)["image_processor_calls"]
    hits_before, passes_before = store_hits(mm_app), encoder_forward_passes(mm_app)

    # The maker's object died with it...
    with pytest.raises(ray.exceptions.ObjectLostError):
        ray.get(first.features[0].data.ref, timeout=60)
    # ...yet a request still carrying that reference is encoded: the encoder falls back to the store's copy.
    orphan: EncoderOutput = mm_app.handle("Encoder").encode.remote("orphan", first.features).result(timeout_s=120)
    assert orphan.embeddings[0].shape[0] == first.features[0].num_embeds
    assert orphan.host == socket.gethostname()  # a CPU forward names its host (the local Cluster's nodes share it)
    # The replacement replica finds the item in the store: no processor run, the store's own copy.
    again = process_on(probe_a, url)
    assert again.processor_cache_hits == 1
    assert again.features[0].data.ref != first.features[0].data.ref
    # The whole pipeline over HTTP still answers as the engine does.
    body = chat_body(url, max_tokens=6, ignore_eos=True)
    status, answer = post_json(mm_app.base_url, "/v1/chat/completions", body)
    assert status == 200, answer
    assert_same(answer, engine_answer(reference_engine, body))

    assert info_on(probe_a)["image_processor_calls"] == 0
    assert info_on(probe_b)["image_processor_calls"] == calls_b
    assert store_hits(mm_app) == hits_before + 2  # the two requests; the encoder's fallback is not a lookup
    assert encoder_forward_passes(mm_app) > passes_before
    # An item the store never copied died with its maker: a miss (processed again), not a failed request, nor
    # a hit in the counts; the maker's other such entry is dropped with it, the one handed over is kept.
    lost = process_on(probe_b, data_url(seed=204))
    assert lost.processor_cache_hits == 0 and info_on(probe_b)["image_processor_calls"] == calls_b + 1
    assert lost.features[0].identifier == once and store_hits(mm_app) == hits_before + 2
    # NOTE: waited for: the lookup may have answered before Ray reported the maker dead (it then goes on)
    wait_until(lambda: held(mm_app, twice) is None, timeout=30, interval=0.2, what="the dead maker's entry to go")
    assert (kept := held(mm_app, handed)) is not None and kept.kept


def test_a_repeat_on_its_maker_skips_the_store_and_a_replaced_store_is_refilled(mm_app: AppInfo, preprocess_probes):
    node_a, _ = PREPROCESS_NODES
    probe_a = preprocess_probes[node_a]
    url = data_url(seed=207)
    first = process_on(probe_a, url)  # made on node A's replica, which keeps its own reference
    key = first.features[0].identifier
    wait_until(lambda: stored_ref(mm_app, key) is not None, timeout=30, interval=0.05, what="the store to index it")
    before, hits = info_on(probe_a), store_hits(mm_app)
    again = process_on(probe_a, url)
    assert again.processor_cache_hits == 1 and again.features[0].data.ref == first.features[0].data.ref
    after = info_on(probe_a)
    assert after["own_cache_hits"] == before["own_cache_hits"] + 1 and store_hits(mm_app) == hits  # no lookup
    assert after["image_processor_calls"] == before["image_processor_calls"]

    [store] = replica_actors(mm_app.name, "ProcessorCacheStore")
    ray.kill(ray.get_actor(store["name"], namespace="serve"), no_restart=True)  # its index dies with it

    def replaced() -> bool:
        names = [a["name"] for a in replica_actors(mm_app.name, "ProcessorCacheStore")]
        running = replica_states(mm_app.name, "ProcessorCacheStore") == {"RUNNING": 1}
        return running and names not in ([], [store["name"]])

    wait_until(replaced, timeout=180, interval=0.5, what="Serve to replace the store")
    fresh = iter(range(208, 240))  # new images: each one's lookup may meet the new store
    failed: list[BaseException] = []  # NOTE: wait_until takes an error for "not yet"; none may fail here

    def refilled() -> bool:  # node A's replica, meeting the new store, has it adopt what it holds
        try:
            process_on(probe_a, data_url(seed=next(fresh)))
        except Exception as exc:
            failed.append(exc)
            raise
        return stored_ref(mm_app, key) is not None

    wait_until(refilled, timeout=60, interval=0.5, what="the new store to hold the item node A's replica made")
    assert not failed  # a new store is misses only: no request failed meanwhile
    sent = next(fresh) - 208
    assert info_on(probe_a)["image_processor_calls"] == after["image_processor_calls"] + sent  # only new images


@ray.remote(resources={"never-on-any-node": 1})
def _never() -> None:
    """A task no node can run: its result never arrives (and it holds no CPU meanwhile)."""


def test_the_encoders_resolver_brings_a_steps_pixels_together_under_one_timeout(
        ray_cluster: ClusterInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments import cache_store
    from deployments.cache_store import PixelResolver
    from mmserve.messages import MultiModalFeatureSpec, PlaceholderRange, ProcessedItem

    monkeypatch.setattr(cache_store, "READ_TIMEOUT_S", 1.0)
    item = ProcessedItem(np.zeros((1, 3, 4, 4), dtype=np.uint8))
    here, other, nevers = ray.put(item), ray.put(item), [_never.remote() for _ in range(5)]

    def spec(data: Any) -> MultiModalFeatureSpec:
        stored = data if isinstance(data, ProcessedItem) else StoredItem(data, num_tiles=1, nbytes=item.nbytes)
        return MultiModalFeatureSpec(uuid.uuid4().hex, "image", PlaceholderRange(0, 4), 4, stored)

    waits: list[tuple[int, int, float]] = []  # (refs, num_returns, timeout) of each ray.wait the resolver made
    real_wait = cache_store.ray.wait

    def counted_wait(refs: list[Any], *, num_returns: int, timeout: float, fetch_local: bool) -> Any:
        waits.append((len(refs), num_returns, timeout))
        return real_wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)

    monkeypatch.setattr(cache_store.ray, "wait", counted_wait)
    try:
        # one ref twice (two requests' specs of one item), an inline item, and five that never arrive
        arrived = PixelResolver.prefetch([spec(here), spec(nevers[0]), spec(here), spec(item), spec(other),
                                          *(spec(ref) for ref in nevers[1:])])
    finally:
        for ref in nevers:
            ray.cancel(ref, force=True)
    assert arrived == [True, False, True, True, True, False, False, False, False]
    assert waits == [(7, 7, 1.0)]  # the 7 distinct refs together, under the one timeout: not one wait per item
    assert PixelResolver.prefetch([spec(here)]) == [True]  # a lone item: nothing to overlap, read as before
