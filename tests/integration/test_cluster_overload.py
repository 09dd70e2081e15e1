"""Overload and deadlines over HTTP on a second, tightly sized app: past the decoder's small queue a
request gets a 503 with `Retry-After` at once while the admitted ones complete, and a request past its
deadline ends (504, or an error event in a stream) with its KV blocks freed."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import AppInfo, ClusterInfo, shutdown_handles
from tests.integration.helpers import SSEStream, chat_body, deploy
from tests.integration.test_cluster_cancellation import decoder_state, idle
from tests.waiting import wait_until

APP, ROUTE = "mm_tight", "/tight"
DEADLINE_S = 6.0  # ingress.request_timeout_s of this app: the overload test's holders must outlast its burst
BURST = 8  # requests sent at once while the decoder runs 2: its callers queue 1, the rest are refused
LONG = {"max_tokens": 8000, "ignore_eos": True}  # >= 8 s at the engine's fastest step: past any deadline here


@pytest.fixture(scope="module")
def tight_app(ray_cluster: ClusterInfo, tiny_ckpt_224: Path) -> Iterator[AppInfo]:
    from ray import serve

    from deployments.app import build_app

    args = {
        "model": str(tiny_ckpt_224),
        "ingress": {"num_replicas": 1, "request_timeout_s": DEADLINE_S, "resources": {"head_node": 0.01}},
        "preprocess": {"num_replicas": 1, "autoscaling": None},
        "encoder": {"num_replicas": 1},
        "decoder": {"num_replicas": 1, "max_ongoing_requests": 2, "max_queued_requests": 1},
    }
    started = time.perf_counter()
    deploy(build_app(args), name=APP, route_prefix=ROUTE)
    try:
        yield AppInfo(APP, args, ray_cluster, time.perf_counter() - started)
    finally:
        shutdown_handles(APP)
        serve.delete(APP)


def post(app: AppInfo, body: dict[str, Any]) -> tuple[int, Any, Any, float]:
    """(status, headers (case-insensitive), JSON body, seconds) of a POST to the app's chat endpoint."""
    request = urllib.request.Request(app.base_url + ROUTE + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, json.loads(response.read()), time.monotonic() - start
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read() or b"null"), time.monotonic() - start


def test_past_the_queue_a_503_with_retry_after_at_once_and_the_admitted_complete(tight_app: AppInfo):
    # NOTE: the decoder's two slots are filled by two streams first, and the burst sent only once both run:
    # sent all at once, requests still pending in the ingress's handle (its router choosing a replica) count
    # against max_queued_requests 1, so how many got in depended on timing (2 of 10 on one CPU, 3 on another)
    holders = [SSEStream(tight_app.cluster.http_port, ROUTE + "/v1/chat/completions",
                         chat_body(text="Hold a slot.", stream=True, **LONG), timeout=60) for _ in range(2)]
    try:
        for holder in holders:
            assert isinstance(next(holder.events()), dict)  # its first chunk: it runs on the decoder
        held = time.monotonic()
        results = burst_while_full(tight_app, holders[0])
        # NOTE: the holders' own deadline would free their slots too; the burst must have been answered first
        assert time.monotonic() - held < DEADLINE_S, "the burst outlasted the holders' deadline: no test"
    finally:
        for holder in holders:
            holder.close()
    statuses = sorted(status for status, *_ in results)
    assert statuses == [200] + [503] * (BURST - 1), statuses  # one queued behind the holders, the rest refused
    for status, headers, body, seconds in results:
        if status == 503:
            assert headers.get("Retry-After") == "1", headers
            assert body["error"]["type"] == "service_unavailable_error", body
            assert seconds < 5.0, seconds  # refused at once, not after waiting its turn
        else:
            assert body["usage"]["completion_tokens"] == 64, body
    wait_until(lambda: idle(tight_app), timeout=30, what="the decoder to hold nothing")


def burst_while_full(app: AppInfo, holder: SSEStream) -> list[tuple[int, Any, Any, float]]:
    """BURST requests at once to a decoder whose slots are held; once all but the queued one are answered,
    `holder` goes away (its slot frees) so that the queued one runs."""
    results: list[tuple[int, Any, Any, float]] = []
    barrier = threading.Barrier(BURST)

    def client() -> None:
        barrier.wait()
        results.append(post(app, chat_body(text="Count to a hundred.", max_tokens=64, ignore_eos=True)))

    threads = [threading.Thread(target=client) for _ in range(BURST)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(results) >= BURST - 1, timeout=DEADLINE_S, interval=0.02, what="the refusals")
    holder.close()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_a_request_past_its_deadline_ends_and_frees_its_kv_blocks(tight_app: AppInfo):
    out: dict[str, Any] = {}

    def unary() -> None:
        out["unary"] = post(tight_app, chat_body(text="Go on forever.", **LONG))

    thread = threading.Thread(target=unary)
    thread.start()
    # NOTE: the stream only once the first request runs: two arriving at once may both be pending in the
    # ingress's handle while its router picks a replica, and the second is then past max_queued_requests 1
    wait_until(lambda: decoder_state(tight_app)["running_requests"] >= 1, timeout=30, interval=0.05,
               what="the first request to run")
    start = time.monotonic()
    stream = SSEStream(tight_app.cluster.http_port, ROUTE + "/v1/chat/completions",
                       chat_body(text="Go on and on.", stream=True, **LONG), timeout=60)
    events = list(stream.events())
    stream.close()
    streamed_s = time.monotonic() - start
    thread.join(timeout=60)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[-1]["error"]["code"] == "deadline_exceeded", events[-3:]
    assert DEADLINE_S - 0.5 < streamed_s < DEADLINE_S + 10, streamed_s
    status, _, body, seconds = out["unary"]
    assert status == 504 and body["error"]["code"] == "deadline_exceeded", (status, body)
    assert seconds < DEADLINE_S + 10, seconds
    wait_until(lambda: idle(tight_app), timeout=30, what="the decoder to free the expired requests' blocks")
