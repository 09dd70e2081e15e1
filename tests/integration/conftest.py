"""Fixtures of the integration tests: a local multi-node Ray cluster and the mmserve app on it.

Owns: the session-scoped `ray_cluster` (`ray.cluster_utils.Cluster` on this machine: a head node and
worker nodes that stand in for node types through custom resources: two `preprocess_node`s, one
`encoder_node`, one `decoder_node`; no CPUs are asked of them, so everything fits two cores), Serve
started on a free port on 127.0.0.1 (one proxy, on the head), the app `mm` deployed once for the
session (`mm_app`), an in-process `Engine` with the app's exact config (`reference_engine`), and
shutting it all down. Does not own the tests' own apps (test_autoscaling.py deploys and deletes one).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deployments.cluster_env import CLUSTER_ENV
from deployments.stage_args import DEFAULT_STAGE_ENV
from tests.folder_scope import FolderScope
from tests.integration.helpers import NodeProbe, deploy, free_port

APP = "mm"
SCOPE = FolderScope(Path(__file__).resolve().parent)  # ray_cluster: up from the first integration test to the last
PREPROCESS_NODES = ("preprocess_node_0", "preprocess_node_1")  # each such node also has one of these
OBJECT_STORE_BYTES = 128 * 1024 * 1024  # per node; they all share this machine's /dev/shm


@dataclass(frozen=True)
class ClusterInfo:
    cluster: Any  # ray.cluster_utils.Cluster
    node_ids: dict[str, str]  # role ("head", "preprocess_node_0", ..., "encoder_node", "decoder_node") -> node id
    http_port: int  # Serve's HTTP proxy on 127.0.0.1

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def role_of(self, node_id: str) -> str:
        return next((role for role, nid in self.node_ids.items() if nid == node_id), f"unknown node {node_id}")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[ClusterInfo]:
    saved = {k: os.environ.get(k) for k in ("RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE", "RAY_TMPDIR", *CLUSTER_ENV)}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.pop("MMSERVE_API_KEY", None)  # NOTE: the tests call /v1 without a key
    os.environ.update(CLUSTER_ENV)  # NOTE: as docs/deploying.md starts every node
    # NOTE: a private temp root (short: it holds unix sockets) so that other Ray sessions on this
    # machine neither find this cluster through /tmp/ray/ray_current_cluster nor we theirs.
    ray_tmp = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="mmit-", dir="/tmp")

    import ray
    import ray._private.auto_init_hook as auto_init_hook
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "resources": {"head_node": 1},
        "object_store_memory": OBJECT_STORE_BYTES,
    })
    roles: dict[str, Any] = {"head": cluster.head_node}
    for name in PREPROCESS_NODES:
        # `preprocess_node: 1` per node and per replica: two replicas can only sit on two nodes.
        roles[name] = cluster.add_node(num_cpus=0, resources={"preprocess_node": 1, name: 1},
                                       object_store_memory=OBJECT_STORE_BYTES)
    for name in ("encoder_node", "decoder_node"):
        roles[name] = cluster.add_node(num_cpus=0, resources={name: 1}, object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="mmserve-integration", log_to_driver=False)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    def stop() -> None:
        try:
            shutdown_handles()
            serve.shutdown()
        finally:
            # NOTE: a handle's router thread that outlives the session would otherwise `ray.init()`
            # on its own and attach to whichever other Ray instance it finds on this machine.
            auto_init_hook.enable_auto_connect = False
            ray.shutdown()
            cluster.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if not os.environ.get("MMSERVE_IT_KEEP_RAY_LOGS"):  # set it to keep the replicas' logs
                shutil.rmtree(ray_tmp, ignore_errors=True)

    stop_once = SCOPE.hold(stop)
    try:
        yield ClusterInfo(cluster, {role: node.node_id for role, node in roles.items()}, port)
    finally:
        stop_once()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    SCOPE.after(nextitem)  # the cluster stops once the last integration test is done (tests/folder_scope.py)


# NOTE: the replicas that call a handle from a worker thread (Preprocess: the processor cache; Encoder:
# the store's copy of lost pixels) run Serve's router on their own event loop here, as under Ray's
# RAY_SERVE_THROUGHPUT_OPTIMIZED=1, where a handle's blocking `.result()` raises; the e2e app runs on
# Serve's defaults. So both ways stay covered.
ROUTER_ON_REPLICA_LOOP = {**DEFAULT_STAGE_ENV, "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def app_args(model_dir: Path) -> dict[str, Any]:
    """The session app: each stage pinned to its node type, with its own replica count."""
    return {
        "model": str(model_dir),
        "ingress": {"num_replicas": 1, "resources": {"head_node": 0.01}},
        "preprocess": {"num_replicas": 2, "autoscaling": None, "resources": {"preprocess_node": 1},
                       "env": ROUTER_ON_REPLICA_LOOP},
        "encoder": {"num_replicas": 2, "resources": {"encoder_node": 0.01}, "env": ROUTER_ON_REPLICA_LOOP},
        "decoder": {"num_replicas": 1, "resources": {"decoder_node": 0.01}},
    }


@dataclass(frozen=True)
class AppInfo:
    name: str
    args: dict[str, Any]
    cluster: ClusterInfo
    deploy_s: float  # seconds the deploy took

    @property
    def base_url(self) -> str:
        return self.cluster.base_url

    def handle(self, deployment: str) -> Any:
        """A handle to one of the app's deployments (one per deployment: each handle has its own router)."""
        from ray import serve

        key = (self.name, deployment)
        if key not in _HANDLES:
            handle = serve.get_deployment_handle(deployment, app_name=self.name)
            # NOTE: initialize the router now, in this thread. Threads that first touch an uninitialized
            # handle at once each build a router of their own (Ray 2.60 does not lock this); all report
            # load under the same handle id, so the controller sees only one router's share and
            # autoscaling under-counts, and the extra routers are never shut down.
            handle._init()
            _HANDLES[key] = handle
        return _HANDLES[key]


_HANDLES: dict[tuple[str, str], Any] = {}


def shutdown_handles(app_name: str | None = None) -> None:
    """Stop the routers of the handles `AppInfo.handle` made (of one app, or all), e.g. before
    deleting their app: a router left running keeps pushing load metrics for it."""
    for key in [k for k in _HANDLES if app_name in (None, k[0])]:
        with contextlib.suppress(Exception):  # best effort: the app may be gone already
            _HANDLES.pop(key).shutdown()


@pytest.fixture(scope="session")
def mm_app(ray_cluster: ClusterInfo, tiny_ckpt_224: Path) -> AppInfo:
    from deployments.app import build_app

    args = app_args(tiny_ckpt_224)
    started = time.perf_counter()
    deploy(build_app(args), name=APP, route_prefix="/")
    return AppInfo(APP, args, ray_cluster, time.perf_counter() - started)


@pytest.fixture(scope="session")
def preprocess_probes(mm_app: AppInfo) -> dict[str, Any]:
    """role -> a NodeProbe on that preprocess node, calling the app's Preprocess from there."""
    import ray

    probe_actor = typing.cast(Any, NodeProbe)  # NOTE: a @ray.remote class; mypy sees the plain class
    probes = {name: probe_actor.options(resources={name: 0.01}).remote(mm_app.name, "Preprocess")
              for name in PREPROCESS_NODES}
    for name, probe in probes.items():
        assert ray.get(probe.node_id.remote(), timeout=60) == mm_app.cluster.node_ids[name]
    return probes


@pytest.fixture(scope="session")
def reference_engine(mm_app: AppInfo) -> Iterator[Any]:
    """The in-process engine with the config every stage of the app runs with."""
    from deployments.args import parse_args
    from mmserve.engine import Engine

    engine = Engine(parse_args(mm_app.args).engine_config())  # the app names the checkpoint
    stop_once = SCOPE.hold(engine.shutdown)  # NOTE: with the cluster, past the folder's last test
    try:
        yield engine
    finally:
        stop_once()
