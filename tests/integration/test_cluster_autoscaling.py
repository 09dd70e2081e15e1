"""Preprocess autoscaling on its own: a second app on the same Serve instance whose Preprocess
scales between 1 and 3 replicas on ongoing requests. Load comes from images served slowly by a
local HTTP server, so each request occupies a replica for a known time without using the CPU.
While it is scaled up, distinct quick images are processed on its replicas; after it has scaled back
down, each of them is still a processor-cache hit: a replica that Serve stops hands the items it made
to the ProcessorCacheStore first (`Preprocess.__del__`)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from mmserve.messages import ChatRequest, SamplingParams
from tests.integration.conftest import AppInfo, ClusterInfo, shutdown_handles
from tests.integration.helpers import data_url, deploy, info_of_every_replica, make_png, replica_states
from tests.waiting import wait_until

APP = "mm_auto"
MIN_REPLICAS, MAX_REPLICAS = 1, 3
IMAGE_DELAY_S = 1.5  # each image fetch takes this long: a request keeps its replica busy meanwhile
CONCURRENCY = 8  # requests in flight during the burst; at target 1 that asks for 8 > MAX replicas
ACTIVE = ("RUNNING", "STARTING", "UPDATING", "RECOVERING")  # replica states that count toward the size
QUICK_SEEDS = range(520, 532)  # distinct small images processed while scaled up


@dataclass(frozen=True)
class SlowImages:
    port: int
    fetches: list[str]  # paths served, in order

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}.png"


@pytest.fixture(scope="module")
def slow_images() -> Iterator[SlowImages]:
    png = make_png(320, 240, seed=501)
    fetches: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fetches.append(self.path)
            time.sleep(IMAGE_DELAY_S)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield SlowImages(server.server_address[1], fetches)
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def auto_app(ray_cluster: ClusterInfo, tiny_ckpt_224: Path) -> Iterator[AppInfo]:
    from ray import serve

    from deployments.app import build_app

    args = {
        "model": str(tiny_ckpt_224),
        "media": {"allow_private_addresses": True},  # the slow image server is on 127.0.0.1
        "preprocess": {"autoscaling": {
            "min_replicas": MIN_REPLICAS, "max_replicas": MAX_REPLICAS, "target_ongoing_requests": 1,
            "upscale_delay_s": 0.5, "downscale_delay_s": 2, "metrics_interval_s": 0.5, "look_back_period_s": 2,
        }},
    }
    started = time.perf_counter()
    deploy(build_app(args), name=APP, route_prefix="/auto")
    try:
        yield AppInfo(APP, args, ray_cluster, time.perf_counter() - started)
    finally:
        shutdown_handles(APP)
        serve.delete(APP)


def slow_request(url: str) -> ChatRequest:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return ChatRequest(f"auto-{uuid.uuid4().hex}", [{"role": "user", "content": content}], SamplingParams(max_tokens=4))


def processor_calls(handle: Any, replicas: int) -> dict[str, int]:
    """replica id -> its image processor calls, for `replicas` running replicas."""
    infos = info_of_every_replica(lambda: handle.replica_info.remote(), replicas)
    return {rid: info["image_processor_calls"] for rid, info in infos.items()}


def process_quick_images(handle: Any) -> tuple[list[str], list[int]]:
    """Process each QUICK_SEEDS image once, concurrently, over the replicas running -> (their cache keys, the
    requests' hits)."""
    sent = [handle.process.remote(slow_request(data_url(seed, 64, 48))) for seed in QUICK_SEEDS]
    done = [r.result(timeout_s=60) for r in sent]
    return [r.features[0].identifier for r in done], [r.processor_cache_hits for r in done]


def test_preprocess_scales_up_under_load_within_bounds_and_back_down(auto_app: AppInfo, slow_images: SlowImages):
    assert replica_states(APP, "Preprocess") == {"RUNNING": MIN_REPLICAS}
    handle = auto_app.handle("Preprocess")
    stop = threading.Event()
    done: list[int] = []  # processor-cache hits per finished request
    errors: list[BaseException] = []

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                done.append(handle.process.remote(slow_request(slow_images.url(f"c{i}"))).result(timeout_s=60)
                            .processor_cache_hits)
            except BaseException as exc:
                errors.append(exc)
                return

    running_seen: list[int] = []
    active_seen: list[int] = []
    history: list[tuple[float, dict[str, int]]] = []  # (seconds since the burst began, states) on change
    began = time.monotonic()

    def observe() -> int:
        states = replica_states(APP, "Preprocess")
        running_seen.append(states.get("RUNNING", 0))
        active_seen.append(sum(states.get(s, 0) for s in ACTIVE))
        if not history or history[-1][1] != states:
            history.append((round(time.monotonic() - began, 1), states))
        return running_seen[-1]

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for i in range(CONCURRENCY):
            pool.submit(client, i)
        try:
            deadline = time.monotonic() + 120
            while observe() <= MIN_REPLICAS and time.monotonic() < deadline and not errors:
                time.sleep(0.2)
            hold = time.monotonic() + 3  # keep the load a little longer: it must not overshoot
            while time.monotonic() < hold and not errors:
                observe()
                time.sleep(0.2)
            keys, first_hits = process_quick_images(handle)
        finally:
            stop.set()
    assert not errors, errors[:3]
    assert max(running_seen) > MIN_REPLICAS, f"never scaled up: {history}"
    assert max(active_seen) <= MAX_REPLICAS, f"over max_replicas: {history}"
    assert len(done) >= CONCURRENCY and len(slow_images.fetches) >= len(done)

    def scaled_down() -> bool:
        observe()
        return replica_states(APP, "Preprocess") == {"RUNNING": MIN_REPLICAS}

    try:
        wait_until(scaled_down, timeout=90, interval=0.5, what="Preprocess to scale back to one replica when idle")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; replica states over time: {history}") from None
    assert max(active_seen) <= MAX_REPLICAS, f"over max_replicas: {history}"

    # The quick images were new, each seen once, so the store copied none on a hit: its own copies ("kept") are
    # those of the items a stopped replica handed over as it went...
    assert first_hits == [0] * len(QUICK_SEEDS), first_hits
    store = auto_app.handle("ProcessorCacheStore")

    def kept() -> list[str]:  # NOTE: polled: a stopped replica's hand-over may still be copying
        return [k for k in keys if (entry := store.held.remote(k).result(timeout_s=60)) is not None and entry.kept]

    wait_until(kept, timeout=30, interval=0.5, what="a quick image handed over by a stopped replica")
    # ...and each is still a hit, the survivor's own or the store's copy, with no processor run.
    [(survivor, calls)] = processor_calls(handle, MIN_REPLICAS).items()
    assert process_quick_images(handle) == (keys, [1] * len(QUICK_SEEDS))
    assert processor_calls(handle, MIN_REPLICAS) == {survivor: calls}
