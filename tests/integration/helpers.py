"""Helpers of the integration tests: HTTP on 127.0.0.1 and finding replicas (polling: tests/waiting.py).

Owns: small, dependency-free utilities the tests share — a free port, JSON and SSE requests over
urllib/http.client (every loop here is bounded), deploying an app with a deadline,
Serve's view of replica counts, replica actors and their nodes from the Ray state API, per-replica
introspection through random routing, slowing a replica's process from outside (`throttled`), and the
`NodeProbe` actor that calls a deployment from a given node (Serve routes a handle's requests to a
replica on its own node first). Does not own any test.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray
from PIL import Image
from ray import serve

# --- images -------------------------------------------------------------------------------------


def make_png(width: int, height: int, seed: int) -> bytes:
    """A deterministic smooth random image as PNG bytes (distinct seeds give distinct content hashes)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, size=(8, 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(base).resize((width, height), Image.Resampling.BILINEAR).save(buf, format="PNG")
    return buf.getvalue()


def data_url(seed: int, width: int = 320, height: int = 240) -> str:
    return "data:image/png;base64," + base64.b64encode(make_png(width, height, seed)).decode()


def chat_body(*image_urls: str, text: str = "What is in the image?", **fields: Any) -> dict[str, Any]:
    """An OpenAI chat-completions body: one user message with the images then the text; greedy."""
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                            "temperature": 0.0, "max_tokens": 8}
    body.update(fields)
    return body


# --- ports, polling -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- HTTP ---------------------------------------------------------------------------------------


def post_json(base_url: str, path: str, body: dict[str, Any], *, timeout: float = 120) -> tuple[int, Any]:
    """(status, decoded JSON body) of a POST; 4xx/5xx are returned, not raised."""
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def get_text(base_url: str, path: str, *, timeout: float = 30) -> tuple[int, str]:
    with urllib.request.urlopen(base_url + path, timeout=timeout) as response:
        return response.status, response.read().decode()


class SSEStream:
    """A streaming POST whose server-sent events are read one at a time; `close()` drops the TCP
    connection mid-stream, as a client that goes away does."""

    def __init__(self, port: int, path: str, body: dict[str, Any], *, timeout: float = 60):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        if self.response.status != 200:
            raise AssertionError(f"stream answered {self.response.status}: {self.response.read()[:500]!r}")

    def events(self) -> Iterator[dict[str, Any] | str]:
        """Each `data:` payload, JSON-decoded ("[DONE]" as the plain string)."""
        while True:
            line = self.response.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[len(b"data:"):].strip().decode()
            yield payload if payload == "[DONE]" else json.loads(payload)

    def close(self) -> None:
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed by the server
                sock.shutdown(socket.SHUT_RDWR)
        self.response.close()
        self.conn.close()


# --- Serve and the Ray state API ----------------------------------------------------------------


def deploy(app: Any, *, name: str, route_prefix: str, timeout: float = 300) -> None:
    """`serve.run` with a deadline: a replica that can never be placed fails the test, not hangs it.
    NOTE: `serve.run` itself waits for RUNNING without one; `run_many` (Serve's developer API) need not wait
    (`wait_for_applications_running=False`)."""
    serve.run_many([serve.RunTarget(app, name=name, route_prefix=route_prefix)],
                   wait_for_applications_running=False)
    wait_running(name, timeout)


def wait_running(name: str, timeout: float = 300) -> None:
    """Wait until app `name` is RUNNING; fail at once if its deploy failed."""
    def running() -> bool:
        status = serve.status().applications.get(name)
        if status is None:
            return False
        if status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"app {name} is {status.status}: {status.message}")
        return status.status == "RUNNING"

    deadline = time.monotonic() + timeout
    while not running():
        if time.monotonic() > deadline:
            status = serve.status().applications.get(name)
            raise AssertionError(f"app {name} not RUNNING after {timeout:.0f} s: {status}")
        time.sleep(0.5)


def exited(pid: int) -> bool:
    """Whether the local process `pid` has ended (a zombie not yet reaped runs no more). NOTE: ray.kill returns
    before the process ends; the test cluster's nodes all run on this machine, so a replica's pid is local."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")  # the state, after "pid (comm)"


def replica_states(app: str, deployment: str) -> dict[str, int]:
    """Serve's replica counts of one deployment by state, e.g. {"RUNNING": 2}."""
    states = serve.status().applications[app].deployments[deployment].replica_states
    return {str(state): n for state, n in states.items()}  # NOTE: plain strings by now, whatever the annotation


def replica_actors(app: str, deployment: str) -> list[dict[str, Any]]:
    """The ALIVE replica actors of one deployment, as Ray's GCS records them: `name`, `node_id`,
    `actor_id`, `pid`."""
    # NOTE: `ray.util.state.list_actors` needs the dashboard's API server, which these clusters do
    # not run; the GCS actor table (a debugging API) answers the same from the GCS itself.
    from ray._private.state import actors

    class_name = f"ServeReplica:{app}:{deployment}"
    return [{"name": a["Name"], "node_id": a["Address"]["NodeID"], "actor_id": a["ActorID"], "pid": a["Pid"]}
            for a in actors(actor_state_name="ALIVE").values() if a["ActorClassName"] == class_name]


def replica_suffix(actor_name: str) -> str:
    """`SERVE_REPLICA::app#Deployment#abc123` -> `abc123` (a replica id's unique_id)."""
    return actor_name.rsplit("#", 1)[-1]


@contextlib.contextmanager
def throttled(pid: int, *, run_s: float = 0.005, stop_s: float = 0.04) -> Iterator[None]:
    """Slow a local process down from outside: stopped `stop_s`, running `run_s`, in turns, while inside
    (a replica made artificially slow without any hook in the code under test); running again on exit.
    NOTE: stops shorter than Serve's queue-length probe deadline (0.1 s), so the slowed replica still
    answers its probes and what keeps traffic from it is the routers' load bound, not a probe timeout."""
    import os
    import signal
    import threading

    done = threading.Event()

    def cycle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(stop_s)
            os.kill(pid, signal.SIGCONT)
            done.wait(run_s)

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        os.kill(pid, signal.SIGCONT)


def info_of_every_replica(call: Callable[[], Any], expected: int, *, rounds: int = 15,
                          per_round: int = 8) -> dict[str, dict[str, Any]]:
    """replica id -> `replica_info()` of every replica, through a handle that routes at random:
    `call()` returns a DeploymentResponse of `replica_info`; calls go out `per_round` at a time until
    `expected` distinct replicas answered (bounded by `rounds`)."""
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for info in [r.result(timeout_s=60) for r in [call() for _ in range(per_round)]]:
            seen[info["replica_id"]] = info
        if len(seen) >= expected:
            return seen
    raise AssertionError(f"only {len(seen)} of {expected} replicas answered after {rounds * per_round} calls")


def encoder_forward_passes(app: Any) -> int:
    """Vision forwards run so far, summed over the app's two Encoder replicas (`app`: an AppInfo)."""
    infos = info_of_every_replica(lambda: app.handle("Encoder").replica_info.remote(), 2)
    return sum(info["forward_passes"] for info in infos.values())


@ray.remote(num_cpus=0)
class NodeProbe:
    """Lives on one node (pinned by a custom resource) and calls a deployment from there. Its handle
    prefers replicas on its own node, so with one replica per node it talks to that one; every answer
    of `replica_info` names the replica and node, so a test can check where a call went."""

    def __init__(self, app_name: str, deployment: str):
        self.handle = serve.get_deployment_handle(deployment, app_name=app_name)
        self.handle._init(_prefer_local_routing=True)  # NOTE: private in Ray 2.60; options() form is deprecated

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.handle, method).remote(*args)
