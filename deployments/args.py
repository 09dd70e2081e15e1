"""The application's arguments: what `serve run deployments.app:build_app k=v` or a Serve config's
`args:` may set, validated at the edge (pydantic) and turned into mmserve's frozen config.

Owns: argument names, defaults, validation, and the mapping to `EngineConfig` and to each stage's
Serve deployment options. Does not own: building deployments (app.py). No Ray import.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mmserve.config import (
    EncoderConfig,
    EngineConfig,
    KVCacheConfig,
    MediaConfig,
    ModelConfig,
    ProcessorCacheConfig,
    SchedulerConfig,
    StepThreadsConfig,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Autoscaling(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    # Optional: None leaves Serve's own default. Small values make scaling react in seconds (tests).
    metrics_interval_s: float | None = Field(None, gt=0)  # how often handles/replicas report load
    look_back_period_s: float | None = Field(None, gt=0)  # window the load is averaged over


# NOTE: OpenMP threads that finished a parallel region spin-wait (libgomp: 300k spins) before they sleep.
# With the encoder and decoder replicas both running 2 torch threads on one 2-core machine, that spinning
# starved the other process: a 296-token prefill beside a busy encoder took 2214 ms instead of 205 ms alone.
# 10k spins measured 603 ms beside the encoder at no cost alone (201 ms). libgomp reads it when torch loads,
# so it is set in the replica's environment. Measured with scripts/bench_lib/checkpoint.py's model.
DEFAULT_STAGE_ENV = {"GOMP_SPINCOUNT": "10000"}


class StageArgs(_Strict):
    """Placement and scale of one deployment."""

    num_replicas: int | None = Field(None, ge=1)  # fixed count; ignored when autoscaling is set
    autoscaling: Autoscaling | None = None
    num_cpus: float = Field(0.0, ge=0)  # NOTE: 0 by default so that a 2-core machine starts every stage
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # custom resources, e.g. {"encoder_node": 0.01}
    max_ongoing_requests: int = Field(64, ge=1)
    # Intra-op threads of torch in each replica; None = num_cpus when >= 1, else every core of the node.
    # NOTE: Ray sets OMP_NUM_THREADS to a worker's num_cpus (at least 1), so a replica asking for 0 CPUs
    # (our default) would run torch on one thread: measured ~2x slower encoder and prefill on 2 cores.
    torch_threads: int | None = Field(None, ge=1)
    env: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_STAGE_ENV))  # replica environment

    def threads(self) -> int:
        """The torch thread count this stage's replicas run with."""
        if self.torch_threads is not None:
            return self.torch_threads
        if self.num_cpus >= 1:
            return int(self.num_cpus)
        return len(os.sched_getaffinity(0))

    def deployment_options(self) -> dict[str, Any]:
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            actor["num_gpus"] = self.num_gpus
        if self.resources:
            actor["resources"] = dict(self.resources)
        if self.env:  # NOTE: Ray merges these env_vars over the job's own runtime_env env_vars
            actor["runtime_env"] = {"env_vars": dict(self.env)}
        options: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": self.max_ongoing_requests}
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.model_dump(exclude_none=True)
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options


GPU_BATCH_WAIT_MS = 5.0  # NOTE: on a CPU no window: batching there does not pay (mmserve/encoder/runner.py)


class EncoderArgs(StageArgs):
    # None = by device: on a GPU 5 ms / 16 crops per forward (batching pays), on a CPU 0 ms / 1 crop.
    batch_wait_ms: float | None = Field(None, ge=0)  # how long the first request of a batch waits for company
    max_batch_items: int | None = Field(None, ge=1)  # crops per vision forward and per encoder step
    cache_capacity_tokens: int = Field(EncoderConfig.cache_capacity_tokens, ge=1)
    compute_budget_tokens: int = Field(EncoderConfig.compute_budget_tokens, ge=1)

    def batch_wait_s(self, device: str) -> float:
        if self.batch_wait_ms is not None:
            return self.batch_wait_ms / 1000
        return GPU_BATCH_WAIT_MS / 1000 if device != "cpu" else 0.0


class DecoderArgs(StageArgs):
    max_num_seqs: int = Field(SchedulerConfig.max_num_seqs, ge=1)
    max_num_batched_tokens: int = Field(SchedulerConfig.max_num_batched_tokens, ge=1)
    block_size: int = Field(KVCacheConfig.block_size, ge=1)
    num_blocks: int = Field(KVCacheConfig.num_blocks, ge=1)
    max_ongoing_requests: int = Field(256, ge=1)
    small_step_tokens: int = Field(StepThreadsConfig.small_step_tokens, ge=0)  # see mmserve/step_threads.py
    small_step_threads: int | None = Field(StepThreadsConfig.small_step_threads, ge=1)  # None = torch_threads


class PreprocessArgs(StageArgs):
    autoscaling: Autoscaling | None = Field(default_factory=lambda: Autoscaling(min_replicas=1, max_replicas=2))


class MediaArgs(_Strict):
    max_images_per_prompt: int = Field(MediaConfig.max_images_per_prompt, ge=0)
    max_image_bytes: int = Field(MediaConfig.max_image_bytes, ge=1)
    fetch_timeout_s: float = Field(MediaConfig.fetch_timeout_s, gt=0)
    allowed_domains: list[str] | None = None
    allow_private_addresses: bool = False
    allowed_local_media_path: str | None = None


class AppArgs(_Strict):
    model: str | None = None  # local checkpoint folder; None = the built-in tiny Gemma 3
    served_name: str | None = None
    dtype: str = "float32"
    device: str | None = None  # None = "cuda" when the stage has GPUs, else "cpu"
    max_model_len: int | None = Field(None, ge=1)
    processor_cache_bytes: int = Field(ProcessorCacheConfig.capacity_bytes, ge=0)
    # NOTE: each push is a Serve call; at 1 s, the hub replica alone used ~5% of a core on an idle 2-core box.
    metrics_push_interval_s: float = Field(5.0, gt=0)  # how often each replica reports to the MetricsHub
    media: MediaArgs = Field(default_factory=MediaArgs)
    ingress: StageArgs = Field(default_factory=StageArgs)
    preprocess: PreprocessArgs = Field(default_factory=PreprocessArgs)
    encoder: EncoderArgs = Field(default_factory=EncoderArgs)
    decoder: DecoderArgs = Field(default_factory=DecoderArgs)

    def engine_config(self, model_dir: str, *, stage: StageArgs | None = None) -> EngineConfig:
        """The engine config a stage runs with; `device` follows the stage's GPUs unless set."""
        device = self.device or ("cuda" if stage is not None and stage.num_gpus > 0 else "cpu")
        return EngineConfig(
            model=ModelConfig(model_dir=model_dir, served_name=self.served_name, dtype=self.dtype,
                              device=device, max_model_len=self.max_model_len),
            media=MediaConfig(
                max_images_per_prompt=self.media.max_images_per_prompt,
                max_image_bytes=self.media.max_image_bytes,
                fetch_timeout_s=self.media.fetch_timeout_s,
                allowed_domains=tuple(self.media.allowed_domains) if self.media.allowed_domains is not None else None,
                allow_private_addresses=self.media.allow_private_addresses,
                allowed_local_media_path=self.media.allowed_local_media_path,
            ),
            processor_cache=ProcessorCacheConfig(capacity_bytes=self.processor_cache_bytes),
            encoder=EncoderConfig(
                cache_capacity_tokens=self.encoder.cache_capacity_tokens,
                compute_budget_tokens=self.encoder.compute_budget_tokens,
                max_batch_items=self.encoder.max_batch_items,
            ),
            scheduler=SchedulerConfig(max_num_seqs=self.decoder.max_num_seqs,
                                      max_num_batched_tokens=self.decoder.max_num_batched_tokens),
            kv_cache=KVCacheConfig(block_size=self.decoder.block_size, num_blocks=self.decoder.num_blocks),
            decoder_threads=StepThreadsConfig(small_step_tokens=self.decoder.small_step_tokens,
                                              small_step_threads=self.decoder.small_step_threads),
        )


def parse_args(raw: dict[str, Any]) -> AppArgs:
    """From `serve run ... k=v` (flat strings, dotted keys for nesting, JSON values) or a YAML dict."""
    nested: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, str):
            with contextlib.suppress(ValueError):  # else a plain string, e.g. a path
                value = json.loads(value)
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return AppArgs.model_validate(nested)
