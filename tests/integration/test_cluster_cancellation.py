"""Request ends across replicas: a client that leaves mid-stream frees the request's KV blocks in the
decoder; an encoder replica holds nothing for a request once it has answered (no release to lose),
with two replicas serving at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from tests.integration.conftest import AppInfo
from tests.integration.helpers import SSEStream, chat_body, data_url, info_of_every_replica, post_json
from tests.waiting import wait_until

ENCODER_REPLICAS = 2


def decoder_state(app: AppInfo) -> dict[str, float]:
    snapshot = app.handle("Decoder").metrics.remote().result(timeout_s=60)
    return {key: snapshot.value(f"mmserve_decoder_{key}")
            for key in ("running_requests", "waiting_requests", "kv_blocks_free", "kv_blocks", "steps_total")}


def encoder_replicas(app: AppInfo) -> dict[str, dict]:
    return info_of_every_replica(lambda: app.handle("Encoder").replica_info.remote(), ENCODER_REPLICAS)


def referenced(app: AppInfo) -> dict[str, list[str]]:
    """encoder replica id -> ids of the requests holding references there."""
    return {rid: info["referenced_requests"] for rid, info in encoder_replicas(app).items()}


def idle(app: AppInfo) -> bool:
    state = decoder_state(app)
    return (state["running_requests"] == 0 and state["waiting_requests"] == 0
            and state["kv_blocks_free"] == state["kv_blocks"])


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
        # Mid-stream: the request runs in the decoder; its embeddings were handed over, so no encoder
        # replica holds anything for it.
        live = decoder_state(mm_app)
        assert live["running_requests"] == 1 and live["kv_blocks_free"] < live["kv_blocks"], live
        # NOTE: under its own id or one made from it (an early encode's, a late fetch's, a split call's, a retry's)
        holders = [rid for rid, ids in referenced(mm_app).items()
                   if any(i == request_id or i.startswith(request_id) for i in ids)]
        assert holders == [], holders
    finally:
        stream.close()  # the client goes away

    wait_until(lambda: idle(mm_app), timeout=30, what="the decoder to drop the aborted request and its KV blocks")
    steps = decoder_state(mm_app)["steps_total"] - steps_before
    # NOTE: a request that ran on makes >= max_tokens steps (one token each; 6000 fit its KV pool and positions);
    # a slow abort on a busy machine may take many steps, so only the last 100 are a margin
    assert steps < max_tokens - 100, f"{steps} decoder steps: the request ran on after the client left"
    time.sleep(1.0)  # and it stays stopped
    assert decoder_state(mm_app)["steps_total"] - steps_before == steps


def test_no_encoder_replica_holds_anything_once_requests_are_answered(mm_app: AppInfo):
    """Both replicas encode (routing is random) and neither keeps a reference for a finished request."""
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

    held = referenced(mm_app)
    assert all(not refs for refs in held.values()), held  # at once: nothing to wait for
