"""Per-stage process settings that decide CPU speed inside Ray: torch threads and the replica environment."""

from __future__ import annotations

import os

from deployments.args import DEFAULT_STAGE_ENV, StageArgs, parse_args


def test_threads_follow_num_cpus_or_take_the_whole_node_when_zero() -> None:
    # Ray would give a 0-CPU replica OMP_NUM_THREADS=1; we run torch on every core the node has instead.
    assert StageArgs(num_cpus=0).threads() == len(os.sched_getaffinity(0))
    assert StageArgs(num_cpus=0.5).threads() == len(os.sched_getaffinity(0))
    assert StageArgs(num_cpus=3).threads() == 3
    assert StageArgs(num_cpus=3, torch_threads=5).threads() == 5


def test_replica_environment_reaches_ray_actor_options() -> None:
    actor = StageArgs().deployment_options()["ray_actor_options"]
    assert actor["runtime_env"] == {"env_vars": DEFAULT_STAGE_ENV}
    assert "GOMP_SPINCOUNT" in DEFAULT_STAGE_ENV
    args = parse_args({"encoder.env": '{"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "PASSIVE"}', "decoder.env": "{}"})
    assert args.encoder.deployment_options()["ray_actor_options"]["runtime_env"] == {
        "env_vars": {"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "PASSIVE"}}
    assert "runtime_env" not in args.decoder.deployment_options()["ray_actor_options"]
    assert args.preprocess.env == DEFAULT_STAGE_ENV  # untouched stages keep the default
