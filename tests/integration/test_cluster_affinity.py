"""Cache-affinity routing on the local multi-node cluster: an app with 2 Encoder and 2 Decoder replicas, the
same seeded workloads run under affinity routing and then under Serve's default router, against the in-process
Engine (one replica of each stage) as the reference.

- `hot`: 90% of the requests reuse 5 images (each request with its own leading text, so no prompt prefix is
  shared and every image is asked of an encoder): the encoder caches' hit rate.
- 3-turn chats that re-send their image: the prefix cache's hit tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.config import EngineConfig
from mmserve.engine import Engine
from mmserve.messages import ChatRequest, SamplingParams
from tests.integration.conftest import AppInfo, ClusterInfo, shutdown_handles
from tests.integration.helpers import data_url, deploy, get_text, post_json

APP, ROUTE = "mm_affinity", "/affinity"
PUSH_S = 0.5  # metrics_push_interval_s of this app


def workload_hot(n: int = 40, seed: int = 3) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    hot = [data_url(100 + i) for i in range(5)]
    messages = []
    for i in range(n):
        image = rng.choice(hot) if rng.random() < 0.9 else data_url(1000 + i)
        messages.append([{"role": "user", "content": [{"type": "text", "text": f"Request {i}. Describe:"},
                                                      {"type": "image_url", "image_url": {"url": image}}]}])
    return messages


def chat_turn(chat: int, turn: int, replies: list[str]) -> list[dict[str, Any]]:
    first = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(500 + chat)}},
                                         {"type": "text", "text": f"Chat {chat}: what is in the picture?"}]}
    messages: list[dict[str, Any]] = [first]
    for t, reply in enumerate(replies[:turn]):
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And then {t}?"}]
    return messages


def deploy_app(cluster: ClusterInfo, model: Path, routing: str) -> AppInfo:
    from deployments.app import build_app

    args = {
        "model": str(model), "metrics_push_interval_s": PUSH_S,
        "ingress": {"num_replicas": 1, "resources": {"head_node": 0.01}},
        "preprocess": {"num_replicas": 1, "autoscaling": None, "resources": {"preprocess_node": 1}},
        "encoder": {"num_replicas": 2, "resources": {"encoder_node": 0.01}, "routing": routing},
        "decoder": {"num_replicas": 2, "resources": {"decoder_node": 0.01}, "routing": routing},
    }
    started = time.perf_counter()
    deploy(build_app(args), name=APP, route_prefix=ROUTE)
    return AppInfo(APP, args, cluster, time.perf_counter() - started)


def counters(app: AppInfo) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    time.sleep(3 * PUSH_S)  # every replica has pushed since the last request
    status, text = get_text(app.base_url, ROUTE + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def run(app: AppInfo) -> dict[str, float]:
    """The workloads through the app -> encoder hit rate, prefix hit tokens, routing decisions."""
    for messages in workload_hot():
        status, body = post_json(app.base_url, ROUTE + "/v1/chat/completions",
                                 {"messages": messages, "max_tokens": 2, "temperature": 0})
        assert status == 200, body
    for chat in range(4):
        replies: list[str] = []
        for turn in range(3):
            status, body = post_json(app.base_url, ROUTE + "/v1/chat/completions",
                                     {"messages": chat_turn(chat, turn, replies), "max_tokens": 4, "temperature": 0})
            assert status == 200, body
            replies.append(body["choices"][0]["message"]["content"])
    c = counters(app)
    decisions = {dict(labels)["deployment"] + "/" + dict(labels)["decision"]: v
                 for (name, labels), v in c.items() if name == "mmserve_routing_decisions_total"}
    return {"encoder_hit_rate": c[("mmserve_encoder_cache_hits_total", ())] /
            c[("mmserve_encoder_cache_queries_total", ())],
            "prefix_hit_tokens": c[("mmserve_prefix_cache_hits_total", ())], **decisions}


def reference(model: Path) -> dict[str, float]:
    """The same workloads through the in-process Engine: one replica of every stage."""
    with Engine(EngineConfig(model=str(model))) as engine:
        for i, messages in enumerate(workload_hot()):
            engine.generate([ChatRequest(f"hot{i}", messages, SamplingParams(max_tokens=2, temperature=0.0))])
        for chat in range(4):
            replies: list[str] = []
            for turn in range(3):
                [done] = engine.generate([ChatRequest(f"c{chat}-{turn}", chat_turn(chat, turn, replies),
                                                      SamplingParams(max_tokens=4, temperature=0.0))])
                replies.append(done.text)
        stats = engine.stats()
        return {"encoder_hit_rate": stats.encoder.hits / stats.encoder.queries,
                "prefix_hit_tokens": stats.decoder.prefix_hits}


@pytest.fixture(scope="module")
def measured(ray_cluster: ClusterInfo, tiny_ckpt_224: Path) -> Iterator[dict[str, dict[str, float]]]:
    from ray import serve

    results = {"one replica": reference(tiny_ckpt_224)}
    try:
        for routing in ("affinity", "default"):
            app = deploy_app(ray_cluster, tiny_ckpt_224, routing)
            results[routing] = run(app)
            shutdown_handles(APP)
            serve.delete(APP)  # NOTE: a fresh app per router: no cache warm from the other's run
        print("\naffinity routing:", results)
        yield results
    finally:
        shutdown_handles(APP)
        if APP in serve.status().applications:
            serve.delete(APP)


def test_affinity_keeps_the_encoder_caches_as_warm_as_one_replica(measured):
    one, affinity, default = measured["one replica"], measured["affinity"], measured["default"]
    assert affinity["encoder_hit_rate"] >= 0.95 * one["encoder_hit_rate"]
    assert affinity["encoder_hit_rate"] > default["encoder_hit_rate"]
    assert affinity.get("Encoder/affinity", 0) >= 40 and "Encoder/affinity" not in default


def test_affinity_sends_a_chats_turns_to_the_decoder_holding_its_prefix(measured):
    one, affinity, default = measured["one replica"], measured["affinity"], measured["default"]
    assert affinity["prefix_hit_tokens"] >= 0.9 * one["prefix_hit_tokens"] > 0
    assert affinity["prefix_hit_tokens"] > default["prefix_hit_tokens"]
    assert affinity.get("Decoder/affinity", 0) >= 8  # turns 2 and 3 of 4 chats
