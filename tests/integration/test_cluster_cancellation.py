"""Request ends across replicas: a client that leaves mid-stream frees the request's KV blocks in
the decoder and its references in the encoder replica that encoded it; with two encoder replicas,
every finished request's `release` reaches the replica that holds its references."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from tests.integration.conftest import AppInfo
from tests.integration.helpers import SSEStream, chat_body, data_url, info_of_every_replica, post_json, wait_until

ENCODER_REPLICAS = 2


def decoder_state(app: AppInfo) -> dict[str, float]:
    snapshot = app.handle("Decoder").metrics.remote().result(timeout_s=60)
    return {key: snapshot.value(f"mmserve_decoder_{key}")
            for key in ("running_requests", "waiting_requests", "kv_blocks_free", "kv_blocks_total", "steps_total")}


def encoder_replicas(app: AppInfo) -> dict[str, dict]:
    return info_of_every_replica(lambda: app.handle("Encoder").replica_info.remote(), ENCODER_REPLICAS)


def referenced(app: AppInfo) -> dict[str, list[str]]:
    """encoder replica id -> ids of the requests holding references there."""
    return {rid: info["referenced_requests"] for rid, info in encoder_replicas(app).items()}


def idle(app: AppInfo) -> bool:
    state = decoder_state(app)
    return (state["running_requests"] == 0 and state["waiting_requests"] == 0
            and state["kv_blocks_free"] == state["kv_blocks_total"])


def test_closing_a_stream_midway_frees_kv_blocks_and_encoder_references(mm_app: AppInfo):
    wait_until(lambda: idle(mm_app), timeout=30, what="an idle decoder before the test")
    max_tokens = 6000  # the stream would run for a minute or more if it were not aborted
    body = chat_body(data_url(seed=301), max_tokens=max_tokens, ignore_eos=True, stream=True)
    steps_before = decoder_state(mm_app)["steps_total"]
    stream = SSEStream(mm_app.cluster.http_port, "/v1/chat/completions", body)
    try:
        events = stream.events()
        chunks = [next(events) for _ in range(4)]
        assert isinstance(chunks[0], dict), chunks
        request_id = chunks[0]["id"]
        # Mid-stream: the request runs in the decoder and one encoder replica holds its references.
        live = decoder_state(mm_app)
        assert live["running_requests"] == 1 and live["kv_blocks_free"] < live["kv_blocks_total"], live
        holders = [rid for rid, ids in referenced(mm_app).items() if request_id in ids]
        assert len(holders) == 1, holders
    finally:
        stream.close()  # the client goes away

    wait_until(lambda: idle(mm_app), timeout=30, what="the decoder to drop the aborted request and its KV blocks")
    wait_until(lambda: not any(request_id in ids for ids in referenced(mm_app).values()), timeout=30,
               what=f"the encoder replica to release {request_id}")
    steps = decoder_state(mm_app)["steps_total"] - steps_before
    assert steps < max_tokens // 2, f"{steps} decoder steps: the request ran on after the client left"
    time.sleep(1.0)  # and it stays stopped
    assert decoder_state(mm_app)["steps_total"] - steps_before == steps


def test_release_reaches_the_encoder_replica_that_encoded(mm_app: AppInfo):
    """With two encoder replicas a release routed anywhere else would leave references behind."""
    before = {rid: info["forward_passes"] for rid, info in encoder_replicas(mm_app).items()}
    ids: list[str] = []
    seed = 400
    with ThreadPoolExecutor(6) as pool:
        for _ in range(5):  # until both replicas encoded some of these requests (routing is random)
            bodies = [chat_body(data_url(seed=(seed := seed + 1)), max_tokens=3) for _ in range(6)]
            for status, answer in pool.map(lambda b: post_json(mm_app.base_url, "/v1/chat/completions", b), bodies):
                assert status == 200, answer
                ids.append(answer["id"])
            passes = {rid: info["forward_passes"] for rid, info in encoder_replicas(mm_app).items()}
            if all(passes[rid] > before[rid] for rid in before):
                break
    assert all(passes[rid] > before[rid] for rid in before), f"forward passes {before} -> {passes}"

    def released() -> bool:
        return all(not refs for refs in referenced(mm_app).values())

    wait_until(released, timeout=30, what="every encoder replica to drop the finished requests' references")
    assert not {i for refs in referenced(mm_app).values() for i in refs} & set(ids)
