"""`serve run` of the real app in a subprocess, on a private local Ray: started, waited for, stopped whole.

Owns: the Serve config and environment such a server starts with (the config is the only way `serve run`
takes an HTTP port: an import path always gets port 8000; its `args` are the same flat `key: "json"` strings
that `serve run deployments.app:build_app key=value ...` passes), starting `serve run --address local` in
its own session with `RAY_ADDRESS=local` and a fresh `RAY_TMPDIR` (so it can neither attach to another
cluster nor reuse a stale one), waiting (bounded) for /health, and stopping it: SIGTERM (a background
`serve run` ignores SIGINT), then making sure every process of that Ray instance is gone. Does not own
which servers a test session keeps (conftest.py) nor what the tests send.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from deployments.cluster_env import CLUSTER_ENV
from tests.e2e.e2e_support import Server, http_get

REPO = Path(__file__).resolve().parents[2]
SERVE = Path(sys.executable).with_name("serve")
# NOTE: ~65 s to /health on an idle 2-core machine; several Ray clusters at once can need far more.
HEALTH_TIMEOUT_S = float(os.environ.get("MMSERVE_E2E_START_TIMEOUT_S", "180"))
STOP_TIMEOUT_S = 45.0


def start(args: dict[str, str], work: Path, ray_tmp: str, model_dir: Path,
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Server]:
    """Start `serve run` of the app with `args` on a free port of 127.0.0.1, its files under `work`, Ray's
    under `ray_tmp`; `env`: variables added to the cluster's environment. Returns at once (`wait_ready`)."""
    port = free_port()
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "default", "route_prefix": "/", "import_path": "deployments.app:build_app",
                          "args": args}],
    }
    config_path = work / "serve_config.json"  # NOTE: JSON is YAML; `serve run` reads it with yaml.safe_load
    config_path.write_text(json.dumps(config, indent=2))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "MMSERVE_API_KEY"}
    full_env.update({
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ADDRESS": "local",  # never attach to a running cluster
        "RAY_TMPDIR": ray_tmp,
        **CLUSTER_ENV,  # as docs/deploying.md starts a config file
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    })
    log_path = work / "serve_run.log"
    server = Server(f"http://127.0.0.1:{port}", port, model_dir, model_dir.name, log_path)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(SERVE), "run", "--address", "local", str(config_path)],
            cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a Ctrl-C of pytest does not race our SIGTERM
        )
    return proc, server


def free_port() -> int:
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


def stop(proc: subprocess.Popen, ray_tmp: str) -> None:
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


def wait_ready(proc: subprocess.Popen, server: Server) -> None:
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
