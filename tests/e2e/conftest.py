"""End-to-end fixtures: the real app started with `serve run` in a subprocess, on a private local Ray.

Owns: `e2e_server` (session scope): writes a Serve config (the only way `serve run` takes an HTTP
port: an import path always gets port 8000) whose `args` are the same flat `key: "json"` strings
that `serve run deployments.app:build_app key=value ...` passes; starts `serve run --address local`
in its own session with `RAY_ADDRESS=local` and a fresh `RAY_TMPDIR`, so it can neither attach to
another cluster nor reuse a stale one; waits (bounded) for /health and one warm-up request through
every stage; at the end sends SIGTERM (a background `serve run` ignores SIGINT) and makes sure every
process of that Ray instance is gone. Also `image_host`: a local `http.server` thread on 127.0.0.1.

All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deployments.args import CLUSTER_ENV
from tests.e2e.e2e_support import (
    E2E_MAX_BODY_BYTES,
    MAX_IMAGES,
    MAX_MODEL_LEN,
    ImageHost,
    Server,
    data_url,
    encode_image,
    http_get,
    http_post_json,
    make_image,
)
from tests.folder_scope import FolderScope

REPO = Path(__file__).resolve().parents[2]
SCOPE = FolderScope(Path(__file__).resolve().parent)  # e2e_server: up from the first e2e test to the last
SERVE = Path(sys.executable).with_name("serve")
# NOTE: ~65 s to /health on an idle 2-core machine; several Ray clusters at once can need far more.
HEALTH_TIMEOUT_S = float(os.environ.get("MMSERVE_E2E_START_TIMEOUT_S", "180"))
WARMUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 45.0


# --- the server ----------------------------------------------------------------------------------


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 8000:
            return port


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) of a live process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] == "Z":  # a zombie is already dead
        return None
    return int(fields[1]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root` (not `root` itself)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
            starts[pid] = stat[1]
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out and child in starts:
                out[child] = starts[child]
                todo.append(child)
    return out


def _mentioning(text: str) -> dict[int, int]:
    """pid -> start time of live processes whose command line mentions `text` (our Ray temp dir)."""
    out = {}
    for pid in _all_pids():
        if pid == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        stat = _proc_stat(pid)
        if text in cmdline and stat is not None:
            out[pid] = stat[1]
    return out


def _alive(procs: dict[int, int]) -> dict[int, int]:
    """Those of `procs` still running as the same process (start time guards against pid reuse)."""
    out = {}
    for pid, start in procs.items():
        stat = _proc_stat(pid)
        if stat is not None and stat[1] == start:
            out[pid] = start
    return out


def _wait_gone(procs: dict[int, int], timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    left = _alive(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = _alive(left)
    return left


def _stop(proc: subprocess.Popen, ray_tmp: str) -> None:
    """SIGTERM `serve run`; then every process of its Ray instance must be gone (SIGKILL stragglers)."""
    tree = _descendants(proc.pid)
    tree.update(_mentioning(ray_tmp))
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            warnings.warn(f"serve run ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s; killing it", stacklevel=1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing else is in this group
            proc.wait(timeout=10)
    tree.update(_mentioning(ray_tmp))  # anything started during shutdown
    left = _wait_gone(tree, 20.0)
    if left:
        warnings.warn(f"Ray processes outlived serve run by 20 s, killing: {sorted(left)}", stacklevel=1)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        left = _wait_gone(left, 10.0)
    assert not left, f"Ray processes still alive after SIGKILL: {sorted(left)}"
    assert not _alive(_mentioning(ray_tmp)), "processes of the e2e Ray instance are still running"


def _wait_ready(proc: subprocess.Popen, server: Server) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    last = "no answer yet"
    while True:
        if proc.poll() is not None:
            pytest.fail(f"serve run exited with {proc.returncode} before /health answered\n{server.log_tail()}")
        try:
            status, _, body = http_get(server.base_url + "/health", timeout=3.0)
            if status == 200 and json.loads(body) == {"status": "ok"}:
                return
            last = f"HTTP {status}: {body[:200]!r}"
        except (OSError, ValueError) as err:
            last = repr(err)
        if time.monotonic() > deadline:
            pytest.fail(f"/health not ok after {HEALTH_TIMEOUT_S:.0f} s ({last})\n{server.log_tail()}")
        time.sleep(1.0)


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
    port = _free_port()
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
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "default", "route_prefix": "/", "import_path": "deployments.app:build_app",
                          "args": args}],
    }
    config_path = work / "serve_config.json"  # NOTE: JSON is YAML; `serve run` reads it with yaml.safe_load
    config_path.write_text(json.dumps(config, indent=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ADDRESS": "local",  # never attach to a running cluster
        "RAY_TMPDIR": ray_tmp,
        **CLUSTER_ENV,  # as docs/deploying.md starts a config file
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    })
    log_path = work / "serve_run.log"
    server = Server(f"http://127.0.0.1:{port}", port, Path(tiny_ckpt_224), Path(tiny_ckpt_224).name, log_path)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(SERVE), "run", "--address", "local", str(config_path)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a Ctrl-C of pytest does not race our SIGTERM
        )
    started = False

    def stop() -> None:
        try:
            _stop(proc, ray_tmp)
        finally:
            if started:
                shutil.rmtree(ray_tmp, ignore_errors=True)
            else:  # keep Ray's logs (session_*/logs) for whoever reads the failure
                sys.stderr.write(f"\ne2e: serve run log {log_path}; Ray logs kept under {ray_tmp}\n")

    stop_once = SCOPE.hold(stop)
    try:
        _wait_ready(proc, server)
        _warm_up(server)
        started = True
        yield server
    finally:
        stop_once()


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
