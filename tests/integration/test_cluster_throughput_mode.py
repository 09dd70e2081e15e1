"""The app as it runs for throughput on GPUs: Ray's gRPC transport default and bfloat16 weights.

A second app on the session's Serve instance, deployed from a process with
`RAY_SERVE_USE_GRPC_BY_DEFAULT=1` (what `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, Ray's high-throughput mode,
sets; a handle takes its transport default from the process that deploys the app, as `serve run` under
the variable does), every stage's replicas in that mode too, `dtype: bfloat16` as in
`deployments/serve_config.yaml`, the processor cache off (nothing kept on purpose), and early encodes on
(their default where the encoder runs on a GPU).

- In that mode handles send calls by value over gRPC, and Ray pins every ObjectRef serialized into such
  a message for the sender's life. Our messages carry refs to each image's pixels, so every image request
  would leak its pixels; the app's handles pass refs by reference (`deployments/handles.py`). After a
  burst of unique images the object store goes back to what it held before.
- bfloat16 embeddings cross from encoder to decoder as their int16 bits (`mmserve/embeddings_wire.py`):
  the answer is the in-process bfloat16 engine's, token for token.
- Early encodes: Preprocess hands each request's new image to the Encoder before it answers; when it gets
  there first, the Decoder's own encode finds it cached. The image is encoded once and counted as the
  request's miss.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from deployments.stage_args import DEFAULT_STAGE_ENV
from mmserve.engine import Engine
from tests.integration.conftest import AppInfo, ClusterInfo, shutdown_handles
from tests.integration.helpers import chat_body, data_url, post_json, wait_running
from tests.integration.test_cluster_serving import assert_same, engine_answer
from tests.waiting import wait_until

APP = "mm_grpc"
GRPC_MODE = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}  # what RAY_SERVE_THROUGHPUT_OPTIMIZED=1 sets for handles
IMAGE_SIZE = 224  # the tiny checkpoint's crop size (px)
PIXEL_BYTES = 3 * IMAGE_SIZE * IMAGE_SIZE  # one processed image, uint8 (bytes): a plasma object (> 100 KiB)
N_IMAGES = 6


@pytest.fixture(scope="module")
def grpc_app(ray_cluster: ClusterInfo, tiny_ckpt_224: Path) -> Iterator[AppInfo]:
    from ray import serve

    stage = {"num_replicas": 1, "env": {**DEFAULT_STAGE_ENV, **GRPC_MODE}}
    args = {
        "model": str(tiny_ckpt_224),
        "processor_cache.capacity_bytes": 0,
        "dtype": "bfloat16",
        "ingress": stage, "decoder": stage, "encoder": stage,
        "preprocess": {**stage, "autoscaling": None, "early_encode": True},
    }
    started = time.perf_counter()
    ray.get(_deploy_in_grpc_mode.remote(args), timeout=120)
    wait_running(APP)
    try:
        yield AppInfo(APP, args, ray_cluster, time.perf_counter() - started)
    finally:
        shutdown_handles(APP)
        serve.delete(APP)


@ray.remote(num_cpus=0, runtime_env={"env_vars": GRPC_MODE})
def _deploy_in_grpc_mode(args: dict[str, Any]) -> None:
    from ray import serve

    from deployments.app import build_app

    serve.run_many([serve.RunTarget(build_app(args), name=APP, route_prefix="/grpc")],
                   wait_for_applications_running=False)


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


@pytest.fixture(scope="module")
def bf16_engine(grpc_app: AppInfo) -> Iterator[Engine]:
    """The in-process engine with the app's exact config (bfloat16)."""
    from deployments.args import parse_args

    engine = Engine(parse_args(grpc_app.args).engine_config())  # the app names the checkpoint
    assert engine.config.dtype == "bfloat16"
    yield engine
    engine.shutdown()


def test_bfloat16_image_answer_matches_the_in_process_engine(grpc_app: AppInfo, bf16_engine: Engine):
    body = chat_body(data_url(seed=720), text="Describe the picture.", max_tokens=12, ignore_eos=True)
    status, answer = post_json(grpc_app.cluster.base_url + "/grpc", "/v1/chat/completions", body)
    assert status == 200, answer
    expected = engine_answer(bf16_engine, body)
    assert len(expected.token_ids) == 12 and expected.text
    assert_same(answer, expected)


ENCODER_KEYS = ("early_encode_calls", "early_encodes", "forward_passes", "cache_queries", "cache_hits", "early_found")
# A new image whose early encode came first: encoded once, ahead, and that is what the request's lookup found
EARLY_MISS = {"early_encode_calls": 1, "early_encodes": 1, "forward_passes": 1, "cache_queries": 1, "cache_hits": 0,
              "early_found": 1}


def encoder_counts(app: AppInfo) -> dict[str, int]:
    info = app.handle("Encoder").replica_info.remote().result(timeout_s=60)
    return {key: info[key] for key in ENCODER_KEYS}


def answered_moves(app: AppInfo, engine: Engine, body: dict[str, Any]) -> dict[str, int]:
    """Send `body` (its answer must be the engine's) and wait for its early encode's call: how much each
    of the Encoder's counts moved."""
    before = encoder_counts(app)
    status, answer = post_json(app.cluster.base_url + "/grpc", "/v1/chat/completions", body)
    assert status == 200, answer
    assert_same(answer, engine_answer(engine, body))

    # NOTE: Preprocess does not await `encode_early`: on a busy machine it may reach the Encoder after the
    # answer (then it finds the image cached: no forward pass, no counted lookup)
    def early_came() -> dict[str, int]:  # the counts once the early encode's call came, else {} (not yet)
        counts = encoder_counts(app)
        return counts if counts["early_encode_calls"] > before["early_encode_calls"] else {}

    after = wait_until(early_came, timeout=30, what="the early encode's call to reach the Encoder")
    return {k: v - before[k] for k, v in after.items()}


def test_an_early_encode_is_what_the_request_finds_and_counts_as_its_miss(grpc_app: AppInfo, bf16_engine: Engine):
    # NOTE: the Encoder starts an early encode only when its stage is idle, and nothing orders Preprocess's
    # call before the Decoder's. On a loaded machine the request's own `encode` can come first: the early one
    # is then declined, or finds the image cached. So new images until one early encode came first.
    tried: list[dict[str, int]] = []
    for seed in range(740, 745):
        body = chat_body(data_url(seed=seed), text="Describe it.", max_tokens=8, ignore_eos=True)
        tried.append(answered_moves(grpc_app, bf16_engine, body))
        if tried[-1]["early_found"]:
            break
        # came second, or was declined (a busy stage): the request's own encode was its miss, the early one ran
        # no forward
        assert tried[-1] == {**EARLY_MISS, "early_encodes": tried[-1]["early_encodes"], "early_found": 0}, tried
    assert tried[-1] == EARLY_MISS, tried
    # The same image again: the processor cache is off here, so Preprocess sends it early once more, and the
    # encoder finds it cached (an early lookup is not counted); the Decoder kept the embeddings itself, so
    # the request does not ask the encoder at all.
    again = chat_body(data_url(seed=seed), text="And its colours?", max_tokens=8, ignore_eos=True)
    assert answered_moves(grpc_app, bf16_engine, again) == \
        {**EARLY_MISS, "forward_passes": 0, "cache_queries": 0, "early_found": 0}
