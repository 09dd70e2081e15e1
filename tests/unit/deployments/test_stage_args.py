"""Per-stage process settings that decide CPU speed inside Ray: torch threads and the replica environment."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from deployments import stage_args
from deployments.args import parse_args
from deployments.metrics_hub import HUB_TIMEOUT_S
from deployments.preprocess import HAND_OVER_TIMEOUT_S
from deployments.stage_args import (
    DEFAULT_STAGE_ENV,
    INGRESS_PROBE_SLOTS,
    SERVE_CALL_S,
    SHUTDOWN_HOOK_S,
    StageArgs,
)
from mmserve.config import EngineConfig
from mmserve.runtime.step_loop import JOIN_TIMEOUT_S


def test_threads_follow_num_cpus_or_take_the_whole_node_when_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ray would give a 0-CPU replica OMP_NUM_THREADS=1; we run torch on every core the node has instead.
    cores = stage_args.usable_cores()  # NOTE: the affinity, or fewer on a CI runner with a CPU limit
    assert StageArgs(num_cpus=0).threads() == cores
    assert StageArgs(num_cpus=0.5).threads() == cores
    assert StageArgs(num_cpus=3).threads() == 3
    assert StageArgs(num_cpus=3, torch_threads=5).threads() == 5
    # in a container limited to 2 CPUs on a bigger host: its quota, not the host's cores it sees
    monkeypatch.setattr(stage_args, "usable_cores", lambda: 2)
    assert StageArgs(num_cpus=0).threads() == 2 and StageArgs(num_cpus=3).threads() == 3


def test_replica_environment_reaches_ray_actor_options() -> None:
    actor = StageArgs().deployment_options()["ray_actor_options"]
    assert actor["runtime_env"] == {"env_vars": DEFAULT_STAGE_ENV}
    assert "GOMP_SPINCOUNT" in DEFAULT_STAGE_ENV
    # glibc's own ceilings for its dynamic thresholds: 32 MiB to mmap, twice that to trim
    assert (DEFAULT_STAGE_ENV["MALLOC_MMAP_THRESHOLD_"], DEFAULT_STAGE_ENV["MALLOC_TRIM_THRESHOLD_"]) == (
        str(32 << 20), str(64 << 20))
    assert DEFAULT_STAGE_ENV["MALLOC_ARENA_MAX"] == "2"  # threads reuse the arenas that earlier calls grew
    args = parse_args({"encoder.env": '{"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "PASSIVE"}', "decoder.env": "{}"})
    assert args.encoder.deployment_options()["ray_actor_options"]["runtime_env"] == {
        "env_vars": {"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "PASSIVE"}}
    assert "runtime_env" not in args.decoder.deployment_options()["ray_actor_options"]
    assert args.preprocess.env == DEFAULT_STAGE_ENV  # untouched stages keep the default
    # the Encoder returns answers of up to 2 MiB inline (one image's embeddings, to the Decoder)
    assert parse_args({}).encoder.env == {**DEFAULT_STAGE_ENV, "RAY_max_direct_call_object_size": str(2 << 20)}
    # the Decoder keeps libgomp's own spin (its steps yield threads to an encode beside them instead)
    assert parse_args({}).decoder.env == {k: v for k, v in DEFAULT_STAGE_ENV.items() if k != "GOMP_SPINCOUNT"}
    # the Ingress also sends call arguments of up to 1 MiB inline (a body with an image, to Preprocess)
    assert args.ingress.env == {**DEFAULT_STAGE_ENV, "RAY_max_direct_call_object_size": str(1 << 20)}
    assert args.ingress.deployment_options()["ray_actor_options"]["runtime_env"] == {"env_vars": args.ingress.env}


def test_encoder_batches_on_a_gpu_and_takes_one_image_per_step_on_a_cpu() -> None:
    from mmserve.encoder.runner import EncoderRunner, batch_wait_s

    def runner(config: EngineConfig) -> EncoderRunner:  # as StageFactory builds it
        return EncoderRunner(lambda px: px, device=config.device, max_batch_items=config.encoder.max_batch_items)

    def wait(config: EngineConfig) -> float:
        return batch_wait_s(config.encoder.batch_wait_ms, torch.device(config.device))

    cpu = parse_args({})
    config = cpu.engine_config(cpu.encoder)
    assert runner(config).max_batch_items == 1 and wait(config) == 0.0
    gpu = parse_args({"encoder.num_gpus": "1"})
    config = gpu.engine_config(gpu.encoder)
    assert config.device == "cuda" and runner(config).max_batch_items == 16
    assert wait(config) == 0.005
    pinned = parse_args({"encoder.max_batch_items": "4", "encoder.batch_wait_ms": "2"})
    config = pinned.engine_config(pinned.encoder)
    assert runner(config).max_batch_items == 4 and wait(config) == 0.002


def test_decoder_small_step_threads_reach_the_engine_config() -> None:
    args = parse_args({"decoder.small_step_tokens": "8", "decoder.small_step_threads": "1"})
    threads = args.engine_config(args.decoder).decoder
    assert (threads.small_step_tokens, threads.small_step_threads, threads.big_step_threads) == (8, 1, None)
    default = parse_args({}).engine_config().decoder  # unset: measured at start-up (step_threads.py)
    assert (default.small_step_threads, default.big_step_threads) == (None, None)


def test_serve_bounds_the_ingress_above_its_own_chat_bound() -> None:
    # mmserve's admission answers the chat request past the bound (an OpenAI 503); Serve's bound leaves room
    # for health and metrics probes beside a full load
    options = parse_args({"ingress": {"max_ongoing_requests": 8}}).ingress.deployment_options()
    assert options["max_ongoing_requests"] == 8 + INGRESS_PROBE_SLOTS
    assert parse_args({"decoder": {"max_ongoing_requests": 8}}).decoder.deployment_options()[
        "max_ongoing_requests"] == 8


def test_an_ingress_that_could_never_scale_up_is_refused() -> None:
    # past its bound the ingress refuses chat requests, so a replica never counts more than that many
    with pytest.raises(ValueError, match=r"target_ongoing_requests \(8.0\) must be below max_ongoing_requests \(8\)"):
        parse_args({"ingress": {"max_ongoing_requests": 8, "autoscaling": {"target_ongoing_requests": 8}}})
    assert parse_args({"ingress": {"max_ongoing_requests": 8, "autoscaling": {"target_ongoing_requests": 7}}})


def test_a_fixed_replica_count_overrides_a_default_autoscaling_and_both_together_are_refused() -> None:
    fixed = parse_args({"preprocess.num_replicas": "4"}).preprocess  # Preprocess autoscales by default
    assert fixed.autoscaling is None and fixed.deployment_options()["num_replicas"] == 4
    assert "autoscaling_config" not in fixed.deployment_options()
    assert parse_args({}).preprocess.autoscaling is not None
    assert parse_args({"preprocess.num_replicas": "2", "preprocess.autoscaling": "null"}).preprocess.num_replicas == 2
    with pytest.raises(ValidationError, match="exclude each other"):
        parse_args({"encoder.num_replicas": "2", "encoder.autoscaling": '{"max_replicas": 3}'})


def test_a_replica_being_removed_waits_out_the_requests_it_holds_then_has_time_for_its_hook() -> None:
    """Serve stops a removed replica after 20 s by default, its shutdown hook included: a downscale would cut every
    longer stream, and a hook started late would be killed midway (the last metrics, a step thread's join)."""
    args = parse_args({"ingress.request_timeout_s": "120"})
    assert args.ingress.deployment_options()["graceful_shutdown_timeout_s"] == 120 + SHUTDOWN_HOOK_S
    assert args.decoder.deployment_options(holds_for_s=120)["graceful_shutdown_timeout_s"] == 120 + SHUTDOWN_HOOK_S
    assert args.encoder.deployment_options()["graceful_shutdown_timeout_s"] == SERVE_CALL_S + SHUTDOWN_HOOK_S
    # Preprocess: its fetches' deadline, then the processor
    fetches = parse_args({"media.fetch_timeout_s": "15"})
    assert fetches.preprocess_call_s() == 15 + SERVE_CALL_S
    # the longest hook: Serve's drain check (every 2 s), the last metrics push, then a step thread's join
    # (Preprocess: the push and its hand-over to the store)
    assert 2 + HUB_TIMEOUT_S + max(JOIN_TIMEOUT_S, HAND_OVER_TIMEOUT_S) <= SHUTDOWN_HOOK_S
    chosen = parse_args({"decoder.graceful_shutdown_timeout_s": "30", "ingress.graceful_shutdown_timeout_s": "45"})
    assert chosen.decoder.deployment_options(holds_for_s=600)["graceful_shutdown_timeout_s"] == 30  # as given
    assert chosen.ingress.deployment_options()["graceful_shutdown_timeout_s"] == 45


def test_initial_replicas_reach_serve_within_the_bounds() -> None:
    """An upgrade's new cluster starts with the replicas the old one ran, not at min_replicas."""
    args = parse_args({"decoder.autoscaling": '{"min_replicas": 1, "max_replicas": 8, "initial_replicas": 6}'})
    assert args.decoder.deployment_options()["autoscaling_config"]["initial_replicas"] == 6
    assert "initial_replicas" not in parse_args({}).preprocess.deployment_options()["autoscaling_config"]
    with pytest.raises(ValidationError, match=r"initial_replicas \(9\) is outside min_replicas \(1\) to max"):
        parse_args({"decoder.autoscaling": '{"min_replicas": 1, "max_replicas": 8, "initial_replicas": 9}'})


def test_a_queue_bound_serve_would_refuse_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError, match="max_queued_requests must be at least 1"):
        parse_args({"encoder.max_queued_requests": "0"})
    assert parse_args({"encoder.max_queued_requests": "-1"}).encoder.deployment_options()["max_queued_requests"] == -1
