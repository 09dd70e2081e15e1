"""Placement and independent scaling on a multi-node cluster: each stage's replicas sit on the node
type its custom resource names, in the count its own arguments set."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

from deployments.process_setup import SWITCH_INTERVAL_S
from deployments.stage_args import DEFAULT_STAGE_ENV
from mmserve.config import DecoderConfig
from mmserve.runtime.core_company import usable_cores
from mmserve.runtime.matmul_forms import FORMS
from tests.integration.conftest import PREPROCESS_NODES, AppInfo
from tests.integration.helpers import info_of_every_replica, replica_actors, replica_states

# deployment -> (replicas asked in conftest.app_args, node roles allowed)
EXPECTED = {
    "Ingress": (1, {"head"}),
    "Preprocess": (2, set(PREPROCESS_NODES)),
    "Encoder": (2, {"encoder_node"}),
    "Decoder": (1, {"decoder_node"}),
}


def test_each_stage_runs_its_own_replica_count_on_its_node_type(mm_app: AppInfo):
    cluster = mm_app.cluster
    for deployment, (count, roles) in EXPECTED.items():
        assert replica_states(mm_app.name, deployment) == {"RUNNING": count}, deployment
        actors = replica_actors(mm_app.name, deployment)
        assert len(actors) == count, (deployment, actors)
        placed = Counter(cluster.role_of(a["node_id"]) for a in actors)
        assert set(placed) <= roles, f"{deployment} replicas on {dict(placed)}, expected only {roles}"
    # The two preprocess replicas are on two different nodes, one each.
    preprocess_nodes = Counter(cluster.role_of(a["node_id"]) for a in replica_actors(mm_app.name, "Preprocess"))
    assert preprocess_nodes == Counter(PREPROCESS_NODES)


def test_replicas_report_the_node_ray_placed_them_on(mm_app: AppInfo):
    """The replicas' own view (runtime context) agrees with the state API, replica by replica."""
    for deployment, count in (("Preprocess", 2), ("Encoder", 2)):
        handle: Any = mm_app.handle(deployment)
        infos = info_of_every_replica(functools.partial(lambda h: h.replica_info.remote(), handle), count)
        by_suffix = {a["name"].rsplit("#", 1)[-1]: a["node_id"] for a in replica_actors(mm_app.name, deployment)}
        assert {rid: info["node_id"] for rid, info in infos.items()} == by_suffix, deployment


def test_encoder_replicas_run_torch_on_every_core_with_the_stage_environment(mm_app: AppInfo):
    """Ray gives a 0-CPU replica OMP_NUM_THREADS=1; the stage sets torch's threads itself, and the stage's
    `env` (libgomp's spin count, glibc's malloc thresholds and arena cap) reaches the replica's process, and so does the
    short GIL switch interval and the frozen start-up heap."""
    handle = mm_app.handle("Encoder")
    infos = info_of_every_replica(lambda: handle.replica_info.remote(), 2)
    cores = usable_cores()  # the nodes of a local Cluster share this machine's cores (within its CPU quota)
    assert all(i["stage_env"] == DEFAULT_STAGE_ENV for i in infos.values())
    assert {(i["torch_threads"], i["switch_interval_s"]) for i in infos.values()} == {(cores, SWITCH_INTERVAL_S)}
    # what the replica built at start-up is out of the garbage collector's sight (process_setup.freeze_startup_heap)
    assert all(i["frozen_objects"] > 100_000 for i in infos.values()), [i["frozen_objects"] for i in infos.values()]


def test_the_decoder_replica_chose_its_matmul_forms_at_start_up(mm_app: AppInfo):
    """A CPU decoder times the forms of x @ w.T for every row count of a small step at every thread count its
    steps may use (runtime/matmul_forms.py), in the replica, before serving."""
    info = mm_app.handle("Decoder").replica_info.remote().result()
    rows = DecoderConfig().small_step_tokens
    assert info["matmul_forms"] and {info["small_step_threads"], info["big_step_threads"]} <= set(info["matmul_forms"])
    assert all(len(names) == rows and set(names) <= set(FORMS) for names in info["matmul_forms"].values())
    assert isinstance(info["weights_packed"], bool)
    changes = info["weight_layout_changes"]  # None: packing was not a candidate here
    assert changes is None or all(isinstance(packed, bool) for packed in changes)
