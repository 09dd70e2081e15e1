"""A replica of each stage killed under a steady load of 4 clients: no request hangs, no accepted request
is lost (except those in flight on a killed Ingress, and streams a killed Decoder was sending at that
moment), the service is whole again afterwards, and nothing is left held.

Non-streamed requests go through the official `openai` client with its retries off, so that every retry
that saves one is the server's own: a non-streamed request is retried whole by the ingress, in its decode
on a killed Decoder too (the Decoder is killed with two long answers in their decode: both must be
answered, and the ingress's retry counter must show them retried after their first output, from their
preprocessed requests, which a lost Decoder leaves valid). A stream that
has begun cannot be sent again without repeating what the client has read; a request in flight on a killed
Ingress gets a 5xx from Serve's proxy (the `openai` client's default retries would send it again)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import AppInfo
from tests.integration.helpers import (
    SSEStream,
    chat_body,
    data_url,
    exited,
    get_text,
    replica_actors,
    replica_states,
    replica_suffix,
)
from tests.integration.test_cluster_cancellation import idle, referenced
from tests.waiting import wait_until

CLIENTS = 4
CLIENT_TIMEOUT_S = 60.0  # a request still open this long is a hang
# NOTE: a burst of heavy requests (below) queues behind itself: on a slow 2-core runner one may take over a minute
HEAVY_TIMEOUT_S = 180.0
STEADY_S = 3.0  # load before each kill
# in the order a request meets them, in rounds: the next round's kills wait until Serve has replaced every
# replica killed in this one. NOTE: the first round's stages keep serving while a replica is replaced (two
# replicas, or a store whose absence is a cache miss), so their replacements overlap; the Decoder and the
# Ingress (one replica each, holding streams that cannot move) are killed alone.
ROUNDS = (("Preprocess", "Encoder", "ProcessorCacheStore"), ("Decoder",), ("Ingress",))
VICTIMS = tuple(d for round_ in ROUNDS for d in round_)
# the replicas whose death may lose what they hold: every request on the Ingress, streams on the Decoder
MAY_LOSE_IN_FLIGHT = {"Ingress": (False, True), "Decoder": (True,)}  # deployment -> `stream` of the lost
LONG_TOKENS = 1500  # a non-streamed answer long enough to be in its decode when its Decoder is killed
MID_DECODE_TOKENS = 20  # generated tokens that mark a long answer in its decode (the load's answers: 4 or 6)


@dataclass
class Outcome:
    start: float  # monotonic s
    end: float
    ok: bool
    detail: str  # status and error text when not ok
    stream: bool = False  # a streamed request (a non-streamed one is retried whole by the ingress)
    limit_s: float = CLIENT_TIMEOUT_S  # its client's timeout: a request open this long hung


_CLIENTS: dict[str, tuple[Any, str]] = {}  # base url -> the official client (one pool per app), served name


def _complete(app: AppInfo, body: dict[str, Any], timeout_s: float = CLIENT_TIMEOUT_S) -> tuple[bool, str]:
    """A non-streamed request through the official `openai` client, its own retries off."""
    from openai import OpenAI

    if app.base_url not in _CLIENTS:
        client = OpenAI(base_url=app.base_url + "/v1", api_key="unused", timeout=CLIENT_TIMEOUT_S, max_retries=0)
        _CLIENTS[app.base_url] = client, client.models.list().data[0].id
    client, served = _CLIENTS[app.base_url]
    known = {k: body[k] for k in ("messages", "max_tokens", "temperature") if k in body}
    extra = {k: v for k, v in body.items() if k not in known}  # mmserve's and vLLM's fields
    answer = client.with_options(timeout=timeout_s).chat.completions.create(model=served, **known,
                                                                            extra_body=extra or None)
    return bool(answer.choices) and answer.choices[0].finish_reason in ("stop", "length"), str(answer.usage)


def _one(app: AppInfo, n: int) -> Outcome:
    start = time.monotonic()
    body = chat_body(data_url(seed=300 + n % 6), max_tokens=6, temperature=0.0)  # 6 images: hits and misses
    try:
        if n % 4 == 3:  # every fourth streams
            stream = SSEStream(app.cluster.http_port, "/v1/chat/completions", {**body, "stream": True},
                               timeout=CLIENT_TIMEOUT_S)
            events = list(stream.events())
            stream.close()
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            ok, detail = (not errors and events[-1:] == ["[DONE]"]), f"stream: {errors or events[-1:]}"
        else:
            ok, detail = _complete(app, body)
    except Exception as exc:  # a hang (timeout), a dropped connection, an error past the client's retries
        ok, detail = False, repr(exc)
    return Outcome(start, time.monotonic(), ok, detail[:300], stream=n % 4 == 3)


def _load(app: AppInfo, stop: threading.Event, out: list[Outcome], counter: itertools.count) -> None:
    while not stop.is_set():
        out.append(_one(app, next(counter)))


# deployment -> whether a `replica_info()` shows a request in flight there (both stages are quick: the test
# kills a replica caught working, with a burst of heavy requests in flight, not one that happens to idle)
BUSY: dict[str, Callable[[dict[str, Any]], bool]] = {
    "Preprocess": lambda info: info["ongoing"] > 0,
    "Encoder": lambda info: info["ongoing"] > 0 or bool(info["referenced_requests"]),
}
# NOTE: the burst meets Preprocess first, which may have just lost a replica (the round before) and be
# working through the retried requests of the burst that caught it: on a slow 2-core runner a burst took
# over 30 s to reach the Encoder.
CATCH_TIMEOUT_S = 90.0
POLLS = 6  # replica_info asks sent at once while looking for a replica at work


def _burst_member(app: AppInfo, body: dict[str, Any], what: str) -> Outcome:
    """A non-streamed request of a burst the test sends to catch a replica at work (a longer timeout)."""
    start = time.monotonic()
    try:
        ok, detail = _complete(app, body, HEAVY_TIMEOUT_S)
        detail = f"{what} {detail}"
    except Exception as exc:
        ok, detail = False, f"{what} {exc!r}"
    return Outcome(start, time.monotonic(), ok, detail[:300], limit_s=HEAVY_TIMEOUT_S)


def _heavy(app: AppInfo, n: int) -> Outcome:
    """Two new 3000x1500 images with pan-and-scan: long in Preprocess (decode, crops) and the Encoder."""
    body = chat_body(data_url(seed=5000 + 2 * n, width=3000, height=1500),
                     data_url(seed=5001 + 2 * n, width=3000, height=1500),
                     max_tokens=4, mm_processor_kwargs={"do_pan_and_scan": True})
    return _burst_member(app, body, "heavy")


def _busy_victim(app: AppInfo, deployment: str, out: list[Outcome], counter: itertools.count) -> dict[str, Any]:
    """Send bursts of heavy requests, a new one whenever the last has ended, until a replica of `deployment`
    is caught with one in flight; return its actor."""
    burst: list[threading.Thread] = []

    def caught() -> str | None:
        if not any(thread.is_alive() for thread in burst):
            # NOTE: a new burst when the last one ended uncaught: on a slow 2-core runner the polls below
            # can take longer than a quick stage holds a whole burst
            burst[:] = [threading.Thread(target=lambda: out.append(_heavy(app, next(counter))), name="heavy",
                                         daemon=True) for _ in range(6)]
            for thread in burst:
                thread.start()
        # NOTE: several asks at once: Serve routes each to the replica with the shorter queue, so a lone ask
        # kept reaching the idle replica while the other one worked (the burst queued at one Preprocess
        # replica reaches the Encoders one request at a time)
        asks = [app.handle(deployment).replica_info.remote() for _ in range(POLLS)]
        busy = [info for info in (ask.result(timeout_s=10) for ask in asks) if BUSY[deployment](info)]
        return busy[0]["replica_id"] if busy else None

    replica_id = wait_until(caught, timeout=CATCH_TIMEOUT_S, interval=0.01, what=f"a {deployment} replica at work")
    return next(a for a in replica_actors(app.name, deployment) if replica_suffix(a["name"]) == replica_id)


def _long(app: AppInfo, n: int) -> Outcome:
    """A non-streamed request with a long answer: its Decoder killed mid-decode, the ingress retries it whole."""
    body = chat_body(data_url(seed=300 + n % 6), max_tokens=LONG_TOKENS, ignore_eos=True, temperature=0.0)
    return _burst_member(app, body, "long")


def _decoding_victim(app: AppInfo, out: list[Outcome], counter: itertools.count) -> dict[str, Any]:
    """Send two long non-streamed requests, then return the Decoder's actor once both are in their decode."""
    for _ in range(2):
        threading.Thread(target=lambda: out.append(_long(app, next(counter))), name="long", daemon=True).start()

    def decoding() -> bool:
        tokens = app.handle("Decoder").replica_info.remote().result(timeout_s=10)["running_output_tokens"]
        return sum(n >= MID_DECODE_TOKENS for n in tokens) >= 2

    wait_until(decoding, timeout=CATCH_TIMEOUT_S, interval=0.01, what="the long answers' decode")
    [victim] = replica_actors(app.name, "Decoder")
    return victim


def _ended(name: str) -> bool:
    """Whether the test's threads called `name` have all ended."""
    return not any(t.is_alive() for t in threading.enumerate() if t.name == name)


def retries(app: AppInfo) -> dict[str, float]:
    """The ingress's retries so far, by where the request had got to and whether the retry preprocessed it again
    or reused the lost attempt's ("after_first_output/reused": `mmserve_request_retries_total`)."""
    status, text = get_text(app.base_url, "/metrics")
    assert status == 200
    return {f"{s.labels['phase']}/{s.labels['preprocess']}": s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "mmserve_request_retries_total"}


def _kill_one(app: AppInfo, deployment: str, out: list[Outcome],
              counter: itertools.count) -> tuple[float, float, Callable[[], bool]]:
    """Kill one replica of `deployment`: (kill time, time its process had exited, in monotonic s; whether
    Serve has replaced it yet)."""
    alive = replica_actors(app.name, deployment)
    if deployment in BUSY:
        victim = _busy_victim(app, deployment, out, counter)
    else:
        victim = _decoding_victim(app, out, counter) if deployment == "Decoder" else alive[0]
    killed = time.monotonic()
    ray.kill(ray.get_actor(victim["name"], namespace="serve"), no_restart=True)
    # NOTE: ray.kill returns before the process ends (on a busy machine, long before): until then the
    # replica may still begin a stream. The cluster's nodes all run on this machine: its pid is local.
    wait_until(lambda: exited(victim["pid"]), timeout=60, interval=0.01,
               what=f"the killed {deployment} replica's process to exit")
    died = time.monotonic()

    def replaced() -> bool:
        names = {a["name"] for a in replica_actors(app.name, deployment)}
        return victim["name"] not in names and len(names) == len(alive) and \
            replica_states(app.name, deployment) == {"RUNNING": len(alive)}

    return killed, died, replaced


def _kill_round(app: AppInfo, round_: tuple[str, ...], out: list[Outcome], counter: itertools.count,
                kills: dict[str, tuple[float, float, float]]) -> None:
    """Kill a replica of each deployment of the round, `STEADY_S` apart, then wait until all are replaced;
    records (kill time, time its process had exited, time Serve had replaced it) in monotonic s."""
    pending: dict[str, tuple[float, float, Callable[[], bool]]] = {}
    for deployment in round_:
        time.sleep(STEADY_S)
        pending[deployment] = _kill_one(app, deployment, out, counter)
    for deployment, (killed, died, replaced) in pending.items():
        wait_until(replaced, timeout=180, interval=0.5, what=f"Serve to replace the killed {deployment} replica")
        kills[deployment] = (killed, died, time.monotonic())


def test_killing_a_replica_of_each_stage_under_load_loses_nothing_it_could_keep(mm_app: AppInfo):
    outcomes: list[Outcome] = []
    stop, counter = threading.Event(), itertools.count()
    clients = [threading.Thread(target=_load, args=(mm_app, stop, outcomes, counter), daemon=True)
               for _ in range(CLIENTS)]
    for client in clients:
        client.start()
    kills: dict[str, tuple[float, float, float]] = {}
    moved: dict[str, float] = {}  # the ingress's retries over the Decoder's round, by phase and preprocess
    try:
        for round_ in ROUNDS:
            before = retries(mm_app) if "Decoder" in round_ else {}
            _kill_round(mm_app, round_, outcomes, counter, kills)
            if "Decoder" in round_:  # NOTE: all read before the Ingress, which holds the counts, is killed
                wait_until(lambda: _ended("long"), timeout=HEAVY_TIMEOUT_S, what="the long answers to end")
                moved = {phase: n - before[phase] for phase, n in retries(mm_app).items()}
        time.sleep(STEADY_S)
        wait_until(lambda: _ended("heavy"), timeout=HEAVY_TIMEOUT_S, what="the heavy bursts to end")
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=CLIENT_TIMEOUT_S + 10)
    assert not any(client.is_alive() for client in clients), "a client is stuck past its timeout"

    def excused(o: Outcome) -> bool:  # in flight while a replica that may lose it was dying
        # NOTE: a stream, from the kill to its Decoder's exit (one begun after that went to a live replica); on
        # the Ingress, until Serve had replaced it (its proxy may route one more request to the dead replica)
        return any(o.stream in kinds and o.start <= kills[d][1 if d == "Decoder" else 2] and kills[d][0] <= o.end
                   for d, kinds in MAY_LOSE_IN_FLIGHT.items())

    lost = [o for o in outcomes if not o.ok and not excused(o)]
    summary = {d: f"killed at +{k - outcomes[0].start:.1f} s, exited {e - k:.1f} s later, replaced in {b - k:.1f} s"
               for d, (k, e, b) in kills.items()}
    print(f"the ingress's retries over the Decoder's round: {moved}")
    print(f"{len(outcomes)} requests, {sum(not o.ok for o in outcomes)} failed "
          f"({sum(not o.ok and excused(o) for o in outcomes)} excused: on a killed Ingress or Decoder); "
          f"{summary}")
    assert not lost, [o.detail for o in lost]
    # the long answers, killed in their decode, were retried whole and answered before the Ingress was killed
    longs = [o for o in outcomes if o.detail.startswith("long")]
    assert len(longs) == 2 and all(o.ok and o.end < kills["Ingress"][0] for o in longs), longs
    # ...each from its lost attempt's preprocessed request, not preprocessed again (only its Decoder died)
    assert moved["after_first_output/reused"] >= 2, moved
    slow = [(o.detail, f"{o.end - o.start:.1f} s from +{o.start - outcomes[0].start:.1f} s") for o in outcomes
            if o.end - o.start >= o.limit_s]
    assert not slow, slow  # a request this slow hung somewhere, even if a retry answered it
    assert sum(o.ok for o in outcomes) > 4 * len(VICTIMS)  # the load really ran throughout

    started = time.monotonic()
    for n in range(10):  # the service is whole again: ten in a row
        assert _one(mm_app, 1000 + n).ok
    assert time.monotonic() - started < 90
    wait_until(lambda: idle(mm_app), timeout=30, what="the decoder to hold nothing")
    assert all(not refs for refs in referenced(mm_app).values())
