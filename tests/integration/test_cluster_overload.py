"""Overload and deadlines over HTTP on a second, tightly sized app: past the decoder's small queue, or past
the ingress's own bound, a request gets a 503 with `Retry-After` at once while the admitted ones complete,
and a request past its deadline ends (504, or an error event in a stream) with its KV blocks freed; a client
that leaves while its body is read is counted as aborted, not as a server fault."""

from __future__ import annotations

import functools
import json
import re
import socket
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
INGRESS_SLOTS = 4  # chat requests the ingress serves at once: the burst test's 2 holders leave 2 for its burst


@pytest.fixture(scope="module")
def tight_app(ray_cluster: ClusterInfo, tiny_ckpt_224: Path) -> Iterator[AppInfo]:
    from ray import serve

    from deployments.app import build_app

    args = {
        "model": str(tiny_ckpt_224),
        "ingress": {"num_replicas": 1, "request_timeout_s": DEADLINE_S, "resources": {"head_node": 0.01},
                    "max_ongoing_requests": INGRESS_SLOTS},
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
        before = request_counts(tight_app)
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
    after = settled_counts(tight_app)  # NOTE: load shed, apart from the faults an alert watches
    assert after["overloaded"] - before.get("overloaded", 0) == BURST - 1, (before, after)
    assert after["server_error"] == before["server_error"], (before, after)


def test_past_the_ingress_bound_its_own_503_at_once_and_probes_still_answered(tight_app: AppInfo):
    def holds(requests: int) -> bool:
        return metric_lines(tight_app).get("mmserve_ingress_requests_in_flight") == requests

    # NOTE: each slot is held by a request whose body never ends: the ingress waits for it (until the deadline).
    # Each is sent once the last one holds its slot, and the first once the last test's requests have left
    # theirs: a slow request that met another in a slot was itself refused, and the probes after it found its
    # slot free (seen in CI).
    slow: list[socket.socket] = []
    for held in range(INGRESS_SLOTS):
        wait_until(functools.partial(holds, held), timeout=30, interval=0.05, what=f"the ingress to hold {held}")
        slow.append(slow_body(tight_app))
    try:
        wait_until(functools.partial(holds, INGRESS_SLOTS), timeout=30, interval=0.05, what="every slot held")
        answers: list[tuple[int, Any, Any, float]] = []

        def one_refused() -> bool:  # NOTE: a request sent before every slow one is in is served (a 200)
            answers.append(post(tight_app, chat_body(text="One more.", max_tokens=4)))
            return answers[-1][0] == 503

        try:
            wait_until(one_refused, timeout=DEADLINE_S - 2, interval=0.05, what="a refusal by the ingress")
        except AssertionError as exc:  # NOTE: what came instead, to tell a slow start from a missing bound
            statuses = sorted({(a[0], round(a[3], 2)) for a in answers})
            raise AssertionError(f"{exc}; {len(answers)} answers (status, seconds): {statuses}; the slow requests' "
                                 f"sockets got: {[answered(sock) for sock in slow]}; the ingress counts "
                                 f"{metric_lines(tight_app).get('mmserve_ingress_requests_in_flight')} in flight"
                                 ) from None
        _, headers, body, seconds = answers[-1]
        assert headers.get("Retry-After") == "1" and seconds < 2.0, (headers, seconds)
        assert body["error"]["type"] == "service_unavailable_error" and body["error"]["code"] == "overloaded", body
        assert f"{INGRESS_SLOTS} per ingress replica" in body["error"]["message"], body
        with urllib.request.urlopen(tight_app.base_url + ROUTE + "/health", timeout=10) as probe:
            assert probe.status == 200  # the probe slots: a full ingress still says it is up
        metrics = metric_lines(tight_app)
        assert metrics["mmserve_ingress_requests_in_flight"] == INGRESS_SLOTS, metrics  # the slow ones
        assert metrics["mmserve_ingress_requests_limit"] == INGRESS_SLOTS, metrics
    finally:
        for sock in slow:
            sock.close()
    wait_until(lambda: post(tight_app, chat_body(text="Again.", max_tokens=4))[0] == 200, timeout=30,
               what="the ingress's slots to come back")


def answered(sock: socket.socket) -> str:
    """What the server has sent on `sock` so far (its status line), without waiting: tells a slow request that
    never reached the ingress (nothing) from one answered or closed on the way (a status, or "closed")."""
    sock.setblocking(False)
    try:
        data = sock.recv(200)
    except BlockingIOError:
        return "nothing"
    except OSError as exc:
        return f"error {exc!r}"
    return data.split(b"\r\n", 1)[0].decode(errors="replace") if data else "closed"


def slow_body(app: AppInfo) -> socket.socket:
    """A chat request whose headers promise a body that never comes in full (the socket, to close)."""
    sock = socket.create_connection(("127.0.0.1", app.cluster.http_port), timeout=10)
    sock.sendall((f"POST {ROUTE}/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\": ").encode())
    return sock


def test_a_client_that_leaves_while_its_body_is_read_is_counted_aborted_not_as_a_fault(tight_app: AppInfo):
    def holds(requests: int) -> bool:
        return metric_lines(tight_app).get("mmserve_ingress_requests_in_flight") == requests

    wait_until(functools.partial(holds, 0), timeout=30, interval=0.05, what="the last test's requests to end")
    before = settled_counts(tight_app)  # NOTE: their counts may still be on their way to the hub
    for _ in range(3):
        sock = slow_body(tight_app)
        # NOTE: closed only once its handler waits for the rest of the body (closed before, Serve's proxy would
        # drop it unseen by the ingress)
        wait_until(functools.partial(holds, 1), timeout=30, interval=0.05, what="the ingress to read its body")
        sock.close()
        wait_until(functools.partial(holds, 0), timeout=30, interval=0.05, what="the ingress to let it go")
    wait_until(lambda: request_counts(tight_app)["aborted"] >= before["aborted"] + 3, timeout=30,
               what="three aborted requests")
    after = request_counts(tight_app)
    assert after["aborted"] == before["aborted"] + 3, (before, after)
    assert after["server_error"] == before["server_error"], (before, after)


def settled_counts(app: AppInfo) -> dict[str, float]:
    """`request_counts` once two reads a second apart agree."""
    reads = [request_counts(app)]

    def settled() -> bool:
        reads.append(request_counts(app))
        return reads[-1] == reads[-2]

    wait_until(settled, timeout=30, interval=1.0, what="the request counts to settle")
    return reads[-1]


def request_counts(app: AppInfo) -> dict[str, float]:
    """The app's `mmserve_requests_total` by status."""
    status = re.compile(r'mmserve_requests_total\{status="(\w+)"\}')
    return {m[1]: value for name, value in metric_lines(app).items() if (m := status.fullmatch(name))}


def metric_lines(app: AppInfo) -> dict[str, float]:
    """Sample (name and labels, as written) -> value, from the app's /metrics (the Ingress pushes its own first)."""
    with urllib.request.urlopen(app.base_url + ROUTE + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in re.findall(r"^(mmserve_\S+) (\S+)$", text, re.M)}


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
    status, headers, body, seconds = out["unary"]
    assert status == 504 and body["error"]["code"] == "deadline_exceeded", (status, body)
    assert headers["x-should-retry"] == "false"  # the openai client would send it twice more
    assert seconds < DEADLINE_S + 10, seconds
    wait_until(lambda: idle(tight_app), timeout=30, what="the decoder to free the expired requests' blocks")
