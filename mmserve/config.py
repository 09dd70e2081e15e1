"""Frozen configuration of every stage, composed under one root: `EngineConfig`.

Owns: the knobs of each stage and their defaults. Does not own: parsing YAML or CLI flags (the
edges do that and build these dataclasses), nor anything learned from the checkpoint itself
(that lives in `mmserve.models`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1 << 20


@dataclass(frozen=True)
class ModelConfig:
    model_dir: str  # local Hugging Face checkpoint folder
    served_name: str | None = None  # name shown by the API; None = the folder's name
    dtype: str = "float32"  # torch dtype name the weights are cast to
    device: str = "cpu"  # torch device string, e.g. "cpu", "cuda", "cuda:1"
    max_model_len: int | None = None  # tokens; None = the checkpoint's max_position_embeddings


@dataclass(frozen=True)
class MediaConfig:
    max_images_per_prompt: int = 8  # items; more is a 400
    max_image_bytes: int = 20 * MiB  # bytes read from one URL / data URL
    max_image_pixels: int = 64_000_000  # width * height; guards decompression bombs
    fetch_timeout_s: float = 10.0  # seconds for one http(s) fetch, connect + read
    allowed_domains: tuple[str, ...] | None = None  # None = any public host; else host suffixes
    allow_private_addresses: bool = False  # loopback / private / link-local targets (tests only)
    allowed_local_media_path: str | None = None  # folder file:// URLs may read; None = no files


@dataclass(frozen=True)
class ProcessorCacheConfig:
    capacity_bytes: int = 512 * MiB  # bytes of processed tensors held; 0 disables the cache


@dataclass(frozen=True)
class EncoderConfig:
    cache_capacity_tokens: int = 256 * 64  # embedding rows the encoder cache may hold
    compute_budget_tokens: int = 256 * 8  # embedding rows encoded in one encoder step
    max_batch_items: int | None = None  # crops per vision forward and per step; None = by device (runner.py)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # sequences running at once
    max_num_batched_tokens: int = 4096  # tokens (prefill chunk + decode) in one decoder step


@dataclass(frozen=True)
class StepThreadsConfig:
    """torch's intra-op CPU threads per decoder step, sized to the step's work (CPU devices only)."""

    small_step_tokens: int = 16  # a step computing at most this many new tokens is small (decodes) (tokens)
    small_step_threads: int | None = 1  # threads of a small step; None = the process's setting, as big steps


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 2048  # blocks in the pool, shared by all sequences


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    media: MediaConfig = field(default_factory=MediaConfig)
    processor_cache: ProcessorCacheConfig = field(default_factory=ProcessorCacheConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    decoder_threads: StepThreadsConfig = field(default_factory=StepThreadsConfig)
