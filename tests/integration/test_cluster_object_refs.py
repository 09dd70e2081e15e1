"""Requests leave nothing behind in the object store under Ray's gRPC transport.

With `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` (Ray's high-throughput mode) handles default to sending calls
by value over gRPC (`RAY_SERVE_USE_GRPC_BY_DEFAULT=1`), and Ray pins every ObjectRef serialized into
such a message for the sender's life. Our messages carry refs to each image's pixels, so every image
request would leak its pixels; the app's handles pass refs by reference (`deployments/handles.py`).

A second app on the session's Serve instance, deployed from a process in that mode (a handle takes
its transport default from the process that deploys the app, as `serve run` under the variable does),
every stage's replicas in it too, and the processor cache off (nothing kept on purpose): after a burst
of unique images the object store goes back to what it held before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from deployments.args import DEFAULT_STAGE_ENV
from tests.integration.conftest import AppInfo, ClusterInfo, shutdown_handles
from tests.integration.helpers import chat_body, data_url, post_json, wait_running, wait_until

APP = "mm_grpc"
GRPC_BY_VALUE = {**DEFAULT_STAGE_ENV, "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}
IMAGE_SIZE = 224  # the tiny checkpoint's crop size (px)
PIXEL_BYTES = 3 * IMAGE_SIZE * IMAGE_SIZE * 4  # one processed image, float32 (bytes): a plasma object
N_IMAGES = 6


@pytest.fixture(scope="module")
def grpc_app(ray_cluster: ClusterInfo, tiny_ckpt_224: Path) -> Iterator[AppInfo]:
    from ray import serve

    stage = {"num_replicas": 1, "env": GRPC_BY_VALUE}
    args = {
        "model": str(tiny_ckpt_224),
        "processor_cache_bytes": 0,
        "ingress": stage, "decoder": stage, "encoder": stage, "preprocess": {**stage, "autoscaling": None},
    }
    started = time.perf_counter()
    ray.get(_deploy_in_grpc_mode.remote(args), timeout=120)
    wait_running(APP)
    try:
        yield AppInfo(APP, args, ray_cluster, time.perf_counter() - started)
    finally:
        shutdown_handles(APP)
        serve.delete(APP)


@ray.remote(num_cpus=0, runtime_env={"env_vars": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}})
def _deploy_in_grpc_mode(args: dict[str, Any]) -> None:
    from ray import serve

    from deployments.app import build_app

    serve._run(build_app(args), name=APP, route_prefix="/grpc", _blocking=False)


def object_store_bytes(cluster: ClusterInfo) -> int:
    """Bytes held in the object stores of every node (what `ray memory --stats-only` reports)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(cluster.cluster.address))
    return int(reply.store_stats.object_store_bytes_used)


def test_image_requests_leave_no_pixels_pinned_under_grpc_handles(grpc_app: AppInfo):
    url = grpc_app.cluster.base_url + "/grpc"
    status, _ = post_json(url, "/v1/chat/completions", chat_body(data_url(seed=700)))  # warm every path
    assert status == 200
    before = object_store_bytes(grpc_app.cluster)
    for seed in range(701, 701 + N_IMAGES):
        status, body = post_json(url, "/v1/chat/completions", chat_body(data_url(seed=seed)))
        assert status == 200, body
    # Pinned, the burst's pixels would stay: N_IMAGES * PIXEL_BYTES more than before, for good.
    wait_until(lambda: object_store_bytes(grpc_app.cluster) - before < PIXEL_BYTES, timeout=30,
               what=f"object store back within one image of its {before} B before the burst")
