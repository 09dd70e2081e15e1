"""End-to-end fixtures: the real app started with `serve run` in a subprocess, on a private local Ray.

Owns: `e2e_server` (session scope): the app with the e2e tests' arguments (`serve_process.py` starts and
stops it), up from the first e2e test to the last, after one warm-up request through every stage; `client`
(module scope): the official `openai` client on it. Also `image_host`: a local `http.server` thread on
127.0.0.1.

All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from openai import OpenAI

from tests.e2e import serve_process
from tests.e2e.chat_client import client_for
from tests.e2e.e2e_support import (
    E2E_MAX_BODY_BYTES,
    MAX_IMAGES,
    MAX_MODEL_LEN,
    ImageHost,
    Server,
    data_url,
    encode_image,
    http_post_json,
    make_image,
)
from tests.folder_scope import FolderScope

SCOPE = FolderScope(Path(__file__).resolve().parent)  # e2e_server: up from the first e2e test to the last
WARMUP_TIMEOUT_S = 120.0


# --- the server ----------------------------------------------------------------------------------


def _warm_up(server: Server) -> None:
    """One image request through every stage (each stage's first forward pays torch's one-time costs)."""
    image = data_url(encode_image(make_image(seed=999_001)))
    body = {"model": server.model_name, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "warm up"}]}]}
    status, raw = http_post_json(server.base_url + "/v1/chat/completions", body, timeout=WARMUP_TIMEOUT_S)
    if status != 200:
        pytest.fail(f"warm-up request failed: HTTP {status} {raw[:500]!r}\n{server.log_tail()}")


@pytest.fixture(scope="session")
def e2e_server(tiny_ckpt_224: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("e2e_serve")
    # NOTE: a short private root: Ray's unix sockets live under it (107-byte path limit); fresh per run,
    # so no `ray_current_cluster` file of an earlier cluster can be found there.
    ray_tmp = tempfile.mkdtemp(prefix="mmserve-e2e-", dir="/tmp")
    args = {  # exactly what `serve run deployments.app:build_app k=v ...` would pass: strings, JSON values
        "model": str(tiny_ckpt_224),
        "max_model_len": str(MAX_MODEL_LEN),
        "ingress.max_body_bytes": str(E2E_MAX_BODY_BYTES),
        "media.max_images_per_prompt": str(MAX_IMAGES),
        "media.allow_private_addresses": "true",
        "media.allowed_domains": json.dumps(["127.0.0.1", "localhost"]),
        "metrics_push_interval_s": "1",  # NOTE: the /metrics tests wait for counters to settle past a push
        "ingress.stage_timing": "true",  # the stages' phases in Server-Timing (test_e2e_timing.py)
    }
    proc, server = serve_process.start(args, work, ray_tmp, Path(tiny_ckpt_224))
    started = False

    def stop() -> None:
        try:
            serve_process.stop(proc, ray_tmp)
        finally:
            if started:
                shutil.rmtree(ray_tmp, ignore_errors=True)
            else:  # keep Ray's logs (session_*/logs) for whoever reads the failure
                sys.stderr.write(f"\ne2e: serve run log {server.log_path}; Ray logs kept under {ray_tmp}\n")

    stop_once = SCOPE.hold(stop)
    try:
        serve_process.wait_ready(proc, server)
        _warm_up(server)
        started = True
        yield server
    finally:
        stop_once()


@pytest.fixture(scope="module")
def client(e2e_server: Server) -> Iterator[OpenAI]:
    """The official `openai` client on the session's server, with no retries (`chat_client.client_for`)."""
    with client_for(e2e_server) as c:
        yield c


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    SCOPE.after(nextitem)  # the server stops once the last e2e test is done (tests/folder_scope.py)


# --- a local image host ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def image_host() -> Iterator[ImageHost]:
    host = ImageHost("")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with host.lock:
                host.requests.append(self.path)
                entry = host.files.get(self.path)
            if entry is None:
                self.send_error(404)
                return
            body, content_type = entry
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    host.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, name="e2e-image-host", daemon=True)
    thread.start()
    try:
        yield host
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
