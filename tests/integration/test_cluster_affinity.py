"""Cache-affinity routing on the local multi-node cluster: an app with 2 Encoder and 2 Decoder replicas, the
same seeded workloads run under affinity routing and then under Serve's default router, against the in-process
Engine (one replica of each stage) as the reference.

- `hot`: 90% of the requests reuse 5 images (each request with its own leading text, so no prompt prefix is
  shared and every image is asked of an encoder): the encoder caches' hit rate.
- 3-turn chats that re-send their image: the prefix cache's hit tokens.
- Under affinity only: uniform `unique` load (no replica takes more than 1.5x the mean share), the same
  load with one Encoder replica's process slowed from outside (it gets less of it), and one Encoder replica
  killed: the hot images the other owns still hit there, none of the requests fails.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.config import DecoderConfig, EngineConfig
from mmserve.engine import Engine
from mmserve.messages import ChatRequest, SamplingParams
from mmserve.runtime.affinity import owner
from tests.integration.conftest import AppInfo, ClusterInfo, shutdown_handles
from tests.integration.helpers import (
    data_url,
    deploy,
    exited,
    get_text,
    info_of_every_replica,
    post_json,
    replica_actors,
    replica_states,
    replica_suffix,
    throttled,
)
from tests.waiting import wait_until

APP, ROUTE = "mm_affinity", "/affinity"
PUSH_S = 0.5  # metrics_push_interval_s of this app


HOT = [data_url(100 + i) for i in range(5)]
SPOT_SEEDS = range(6000, 6060)  # images from which a hot spot on one encoder is picked (by their owner)
MARGIN = 1  # routing_load_margin of the affinity app: a hot spot of a few concurrent requests spills over


def image_message(i: int, image: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": f"Request {i}. Describe:"},
                                         {"type": "image_url", "image_url": {"url": image}}]}]


def workload_hot(n: int = 40, seed: int = 3) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    hot = HOT
    messages = []
    for i in range(n):
        image = rng.choice(hot) if rng.random() < 0.9 else data_url(1000 + i)
        messages.append(image_message(i, image))
    return messages


def ask(app: AppInfo, messages: list[dict[str, Any]]) -> dict[str, Any]:
    status, body = post_json(app.base_url, ROUTE + "/v1/chat/completions",
                             {"messages": messages, "max_tokens": 2, "temperature": 0})
    assert status == 200, body
    return body


def encoders(app: AppInfo, expected: int = 2) -> dict[str, dict[str, Any]]:
    """replica id -> replica_info of (at least `expected`) live Encoder replicas."""
    handle = app.handle("Encoder")
    return info_of_every_replica(lambda: handle.replica_info.remote(), expected=expected)


def balance_and_kill(app: AppInfo, keys: dict[str, tuple[bytes, int]]) -> dict[str, Any]:
    """Uniform unique load (its share per replica), then a replica killed and the hot images asked again."""
    import ray

    before = encoders(app)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: ask(app, image_message(2000 + i, data_url(3000 + i))), range(40)))
    after = encoders(app)
    shares = {r: after[r]["cache_queries"] - before[r]["cache_queries"] for r in after}
    target = sorted(after)[0]  # a hot spot: 12 new images at once, all owned by one replica
    spot = [seed for seed in SPOT_SEEDS if owner([keys[data_url(seed)]], sorted(after)) == target][:12]
    with ThreadPoolExecutor(len(spot)) as pool:
        list(pool.map(lambda s: ask(app, image_message(5000 + s, data_url(s))), spot))
    spilled = encoders(app)
    spill = {r: spilled[r]["cache_queries"] - after[r]["cache_queries"] for r in spilled}
    fallbacks = counters(app).get(("mmserve_routing_decisions_total",
                                   (("decision", "load_fallback"), ("deployment", "Encoder"))), 0.0)
    slow = slowed(app, spilled, fallbacks)
    after = encoders(app)
    owners = [owner([keys[key]], sorted(after)) for key in HOT]
    survivor = max(after, key=owners.count)  # NOTE: it owns hot keys, so that their hits below can be counted
    owned = [i for i, r in enumerate(owners) if r == survivor]
    victim = next(a for a in replica_actors(APP, "Encoder") if replica_suffix(a["name"]) != survivor)
    ray.kill(ray.get_actor(victim["name"], namespace="serve"), no_restart=True)
    wait_until(lambda: exited(victim["pid"]), timeout=60, interval=0.01, what="the killed Encoder's process to exit")
    hits_before = after[survivor]["cache_hits"]
    for i, image in enumerate(HOT):  # none may fail (`ask` asserts a 200), the victim's keys included
        ask(app, image_message(4000 + i, image))
    live: dict[str, dict[str, Any]] = {}
    for _ in range(10):  # the survivor, whether or not Serve's replacement is up yet
        live.update(encoders(app, expected=1))
        if survivor in live:
            break
    return {"shares": shares, "spot": len(spot), "spill": spill, "spot_owner": target, "load_fallbacks": fallbacks,
            **slow,
            "owned_by_survivor": len(owned),
            "survivor_hits": live[survivor]["cache_hits"] - hits_before if survivor in live else None,
            **replaced(app, keys, survivor, victim["name"])}


def replaced(app: AppInfo, keys: dict[str, tuple[bytes, int]], survivor: str, victim: str) -> dict[str, Any]:
    """Once Serve's replacement runs, the hot images again (all cached on the survivor by now): each goes to its
    owner among the survivor and the newcomer, a hit on the survivor, a forward pass on the newcomer."""
    def running() -> bool:
        names = {a["name"] for a in replica_actors(APP, "Encoder")}
        return victim not in names and len(names) == 2 and replica_states(APP, "Encoder") == {"RUNNING": 2}

    wait_until(running, timeout=180, interval=0.5, what="Serve to replace the killed Encoder replica")
    before = encoders(app)
    newcomer = next(r for r in before if r != survivor)
    owners = [owner([keys[key]], sorted(before)) for key in HOT]
    for i, image in enumerate(HOT):
        ask(app, image_message(4100 + i, image))
    after = encoders(app)
    return {"owned_by_newcomer": owners.count(newcomer), "kept_by_survivor": owners.count(survivor),
            **{f"{who}_{what}": after[r][what] - before[r][what] for who, r in (("survivor", survivor),
                                                                              ("newcomer", newcomer))
               for what in ("cache_hits", "cache_queries", "forward_passes")}}


def slowed(app: AppInfo, before: dict[str, dict[str, Any]], fallbacks: float) -> dict[str, Any]:
    """Uniform unique load again with one Encoder replica's process stopped ~90% of the time: its share."""
    slow = replica_actors(APP, "Encoder")[0]
    with throttled(slow["pid"]), ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: ask(app, image_message(7000 + i, data_url(8000 + i))), range(40)))
    after = encoders(app)
    shares = {r: after[r]["cache_queries"] - before[r]["cache_queries"] for r in after}
    fell_back = counters(app).get(("mmserve_routing_decisions_total",
                                   (("decision", "load_fallback"), ("deployment", "Encoder"))), 0.0)
    return {"slowed_shares": shares, "slowed": replica_suffix(slow["name"]),
            "slowed_load_fallbacks": fell_back - fallbacks}


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
        # NOTE: on the head, not a preprocess node: the session app's two Preprocess replicas take both of those
        # whole (one per node) when a test before this one made that app
        "preprocess": {"num_replicas": 1, "autoscaling": None, "resources": {"head_node": 0.01}},
        "encoder": {"num_replicas": 2, "resources": {"encoder_node": 0.01}, "routing": routing,
                    "routing_load_margin": MARGIN},
        "decoder": {"num_replicas": 2, "resources": {"decoder_node": 0.01}, "routing": routing,
                    "embedding_cache_bytes": 0},  # NOTE: every repeat the prefix does not cover asks an Encoder
    }
    started = time.perf_counter()
    deploy(build_app(args), name=APP, route_prefix=ROUTE)
    return AppInfo(APP, args, cluster, time.perf_counter() - started)


def counters(app: AppInfo) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The app's counters once two reads three push intervals apart agree (every replica has pushed since the
    last request: a push held up on a busy machine would have left out a replica's last counts)."""
    def read() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        time.sleep(3 * PUSH_S)
        status, text = get_text(app.base_url, ROUTE + "/metrics")
        assert status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples
                if s.name.endswith("_total")}  # NOTE: counters only (gauges such as memory always move)

    reads = [read()]

    def settled() -> bool:
        reads.append(read())
        return reads[-1] == reads[-2]

    wait_until(settled, timeout=60, interval=0, what="the app's counters to settle")
    return reads[-1]


def run(app: AppInfo) -> dict[str, float]:
    """The workloads through the app -> encoder hit rate, prefix hit tokens, routing decisions."""
    for messages in workload_hot():
        ask(app, messages)
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


def reference(model: Path) -> tuple[dict[str, float], dict[str, tuple[bytes, int]]]:
    """The same workloads through the in-process Engine: one replica of every stage; and each hot image's
    routing key (content hash, embedding rows) as Preprocess makes it."""
    config = EngineConfig(model=str(model), decoder=DecoderConfig(embedding_cache_bytes=0))  # as deploy_app's
    with Engine(config) as engine:
        keys = {}
        for image in [*HOT, *(data_url(seed) for seed in SPOT_SEEDS)]:
            [f] = engine.preprocess(ChatRequest("k", image_message(0, image), SamplingParams())).features
            keys[image] = (f.identifier.encode(), f.num_embeds)
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
                "prefix_hit_tokens": stats.decoder.prefix_hits}, keys


@pytest.fixture(scope="module")
def measured(ray_cluster: ClusterInfo, tiny_ckpt_224: Path) -> Iterator[dict[str, dict[str, Any]]]:
    from ray import serve

    one, keys = reference(tiny_ckpt_224)
    results: dict[str, dict[str, Any]] = {"one replica": one}
    try:
        for routing in ("affinity", "default"):
            app = deploy_app(ray_cluster, tiny_ckpt_224, routing)
            results[routing] = run(app)
            if routing == "affinity":
                results["affinity: balance and kill"] = balance_and_kill(app, keys)
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


def test_uniform_load_spreads_and_a_killed_encoder_moves_only_its_keys(measured):
    got = measured["affinity: balance and kill"]
    shares = list(got["shares"].values())
    assert sum(shares) == 40 and max(shares) <= 1.5 * 40 / len(shares)
    # a hot spot on one replica: past the load margin some of its requests go to the other one
    spill = got["spill"]
    assert got["spot"] >= 8 and sum(spill.values()) == got["spot"]
    assert sum(n for r, n in spill.items() if r != got["spot_owner"]) > 0 and got["load_fallbacks"] > 0, got
    # a replica made slow (its process stopped most of the time) gets less of the same uniform load
    slowed = got["slowed_shares"]
    assert sum(slowed.values()) == 40, got
    assert slowed[got["slowed"]] < 0.75 * 40 / len(slowed) and got["slowed_load_fallbacks"] > 0, got
    # the hot images the survivor owned were cached there and still hit: their keys did not move
    assert got["owned_by_survivor"] > 0 and got["survivor_hits"] is not None, got
    assert got["survivor_hits"] >= got["owned_by_survivor"], got
    # with Serve's replacement up, each hot image goes to its owner among the two: the survivor's still hit
    assert got["survivor_cache_hits"] == got["survivor_cache_queries"] == got["kept_by_survivor"], got
    assert got["newcomer_cache_queries"] == got["newcomer_forward_passes"] == got["owned_by_newcomer"], got
    assert got["newcomer_cache_hits"] == 0 and got["kept_by_survivor"] + got["owned_by_newcomer"] == len(HOT), got
