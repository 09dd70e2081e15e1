"""Frozen configuration of every stage, composed under one root: `EngineConfig`.

Owns: the knobs of each stage, their defaults and their bounds (a field's `metadata`, checked when
a config is built). The tree is the single place a knob is added: the Ray app's arguments are this
tree (deployments/args.py validates `serve run ... k=v` and Serve config files into it), so every
field here is settable there under its dotted path (`decoder.max_num_seqs`, `media.max_image_pixels`).
Does not own: parsing YAML or CLI flags, Serve's placement of replicas (deployments/stage_args.py), nor
anything learned from the checkpoint itself (that lives in `mmserve.models`).
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Any

MiB = 1 << 20
LARGEST_FLOAT = 1e9  # the largest float a knob may be (seconds, milliseconds, ratios)


def at_least(low: float, default: Any) -> Any:
    """A field whose value (when not None) must be >= `low`."""
    return field(default=default, metadata={"ge": low})


def above(low: float, default: Any) -> Any:
    """A field whose value (when not None) must be > `low`."""
    return field(default=default, metadata={"gt": low})


class _Bounded:
    """Checks every field's `ge` / `gt` metadata, and that no float is infinite or NaN, when the dataclass is
    built."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value, ge, gt = getattr(self, f.name), f.metadata.get("ge"), f.metadata.get("gt")
            if value is None:
                continue
            # NOTE: a sub-tree given as a dict (the Ray app's arguments' shape) failed later, far from its cause
            if isinstance(f.default_factory, type) and not isinstance(value, f.default_factory):
                raise TypeError(f"{type(self).__name__}.{f.name} must be a {f.default_factory.__name__}, "
                                f"got {type(value).__name__}")
            if (ge is not None or gt is not None) and (isinstance(value, bool) or not isinstance(value, Real)):
                raise TypeError(f"{type(self).__name__}.{f.name} must be a number, got {value!r}")
            # NOTE: an infinite or huge wait overflows the timers it reaches (past ~9.2e9 s: threading.TIMEOUT_MAX)
            if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= LARGEST_FLOAT):
                raise ValueError(f"{type(self).__name__}.{f.name} must be a finite number up to {LARGEST_FLOAT:g}, "
                                 f"got {value!r}")
            if (ge is not None and value < ge) or (gt is not None and value <= gt):
                bound = f">= {ge}" if ge is not None else f"> {gt}"
                raise ValueError(f"{type(self).__name__}.{f.name} must be {bound}, got {value!r}")


@dataclass(frozen=True)
class MediaConfig(_Bounded):
    max_images_per_prompt: int = at_least(0, 8)  # items; more is a 400
    max_image_bytes: int = at_least(1, 20 * MiB)  # bytes read from one URL / data URL
    # width * height, checked from the header before any pixel is decoded (decompression bombs); NOTE:
    # 4096² holds a 12-16 MP photo and 20 crops' worth of Gemma 3's 896² input, more than it keeps
    max_image_pixels: int = at_least(1, 4096 * 4096)
    fetch_timeout_s: float = above(0, 10.0)  # seconds for one http(s) fetch: connect, redirects, headers, body
    allowed_domains: tuple[str, ...] | None = None  # None = any public host; else host suffixes
    allow_private_addresses: bool = False  # loopback / private / link-local targets (tests only)
    allowed_local_media_path: str | None = None  # folder file:// URLs may read; None = no files

    def __post_init__(self) -> None:
        super().__post_init__()
        path = self.allowed_local_media_path
        if path is not None and not path.startswith("/"):
            # NOTE: an empty or relative path resolves against each replica's working directory
            raise ValueError(f"MediaConfig.allowed_local_media_path must be an absolute folder, got {path!r}; or leave "
                             "it unset for no file:// reads")
        for domain in self.allowed_domains or ():
            # NOTE: a host suffix ("example.com" or ".example.com" takes it and its subdomains) or an IP address;
            # anything else would match no URL and refuse every image with no word at start-up
            if not (re.fullmatch(r"\.?[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?", domain) or _is_ip(domain)):
                raise ValueError(f"MediaConfig.allowed_domains holds {domain!r}: give host names such as "
                                 "'example.com' (it and its subdomains), without scheme, port, path or '*'")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class LimitsConfig(_Bounded):
    """What one request may ask for beyond the media; more is a 400 naming the limit."""

    # NOTE: checked on the rendered prompt before it is tokenized: the tokenizer is the costly part.
    max_prompt_chars: int | None = at_least(1, None)  # characters; None = 32 per token of max_model_len
    max_stop_sequences: int = at_least(0, 16)  # `stop` strings per request (each is checked every token)
    max_stop_chars: int = at_least(1, 256)  # characters of one `stop` string
    # messages and content parts of one request, together: each is checked and rendered before the prompt's length
    # is known (2M empty text parts in a 64 MiB body took the chat template tens of seconds)
    max_message_parts: int = at_least(1, 8192)


@dataclass(frozen=True)
class ProcessorCacheConfig(_Bounded):
    capacity_bytes: int = at_least(0, 512 * MiB)  # bytes of processed items held; 0 disables the cache
    # Ray app only: bytes of the items a Preprocess replica made that it keeps its own references to, so
    # that a repeat there skips the shared store's lookup and a replaced store is refilled; 0 = none (and at
    # most capacity_bytes: none when the cache is off)
    replica_capacity_bytes: int = at_least(0, 64 * MiB)


@dataclass(frozen=True)
class EncoderConfig(_Bounded):
    cache_capacity_tokens: int = at_least(1, 16384)  # embedding rows the encoder cache may hold (rows)
    # embedding rows encoded in one encoder step (rows); an item with more is its step's only miss. NOTE: the
    # shipped Serve configs' value: room for a GPU's default batch (max_batch_items, 16) of 256-row crops
    compute_budget_tokens: int = at_least(1, 4096)
    max_batch_items: int | None = at_least(1, None)  # crops per vision forward and step; None = by device
    batch_wait_ms: float | None = at_least(0, None)  # ms the first request of a batch waits; None = by device
    # CPU only: time oneDNN's product with packed weights against F.linear at start-up on the vision tower's
    # weights, and pack its linear layers where it wins (runtime/matmul_forms.py); False = as loaded
    measure_matmul_forms: bool = True


@dataclass(frozen=True)
class DecoderConfig(_Bounded):
    max_num_seqs: int = at_least(1, 32)  # sequences running at once
    max_num_batched_tokens: int = at_least(1, 4096)  # tokens (prefill chunk + decode) in one step
    block_size: int = at_least(1, 16)  # tokens per KV block
    num_blocks: int = at_least(1, 2048)  # KV blocks in the pool, shared by all sequences
    enable_prefix_caching: bool = True  # reuse cached KV blocks across requests by content (prefix_cache.py)
    # torch's intra-op CPU threads per step, by the step's work (CPU devices only; None = measured at start-up):
    small_step_tokens: int = at_least(0, 16)  # a step computing at most this many new tokens is small (decodes)
    small_step_threads: int | None = at_least(1, None)  # threads of a small step
    big_step_threads: int | None = at_least(1, None)  # threads of the other steps (prefill chunks)
    # ... and at most this many for every step while an encode the decoder waits for computes on its host's CPU
    # (the Engine's own encoder, or an Encoder replica beside it): two OpenMP teams on the same cores each wait
    # at every barrier for a member the other preempted (runtime/shared_cores.py); None = no limit
    threads_beside_encodes: int | None = at_least(1, 1)
    # CPU only: time equivalent forms of a small step's x @ w.T at start-up, per row count and thread count, and
    # use the fastest (runtime/matmul_forms.py); False = F.linear throughout
    measure_matmul_forms: bool = True
    # ... and while serving, keep the weights packed for oneDNN or plain by which of the two runs the steps served
    # faster, once the other has lost as much as a change costs (runtime/weight_layout.py); False = as at start-up
    choose_weight_layout_while_serving: bool = True
    # A request's outputs are sent at most this often (ms), the first at once; what comes between is merged:
    # each send is a message through the stages to the client, so this bounds messages per second per stream.
    # NOTE: 50 ms, 20 updates a second, reads as smooth text; at 20 ms a lone stream's tokens cost clearly more
    # (the interval sweep in docs/benchmarks.md)
    stream_interval_ms: float = at_least(0, 50.0)
    # ... and all streams of a replica together send about this many messages a second (messages/s; 0 = no
    # budget): under load each stream's interval stretches to streams / this, up to stream_interval_max_ms (ms).
    # NOTE: a message costs CPU in every process it crosses, beside the step's (docs/benchmarks.md has figures)
    stream_messages_per_s: float = at_least(0, 100.0)
    stream_interval_max_ms: float = at_least(0, 250.0)
    # Requests accepted but not yet running, per replica; past it a new request is refused as overloaded
    # (503 + Retry-After) at once instead of waiting behind the whole queue. NOTE: in the Ray app Serve lets
    # in at most the decoder's max_ongoing_requests, so the bound that bites is the smaller of this and
    # max_ongoing_requests - max_num_seqs (past that, Serve's own max_queued_requests answers 503).
    max_waiting_requests: int = at_least(1, 128)
    # Embeddings of recently used images the decoder keeps (bytes, on the device they arrived on; 0 = none):
    # a repeated image whose last rows share a block with new text needs them again, and finds them here
    # instead of asking the Encoder (mmserve/decoder/embedding_cache.py)
    embedding_cache_bytes: int = at_least(0, 128 * MiB)
    # A decode step's gathered pages, kept per layer until the next step, which then copies only the pages that
    # changed (mmserve/decoder/kept_gather.py): gathers of at least this many bytes are kept (0 = all) ...
    kept_gathers_min_bytes: int = at_least(0, 1 * MiB)
    # ... within this much memory in all (bytes; 0 = none). NOTE: batch x context x the KV bytes of a token on
    # the kept layers: 8 sequences of 8k tokens on gemma-3-4b's 5 full layers in bf16 take ~1.3 GB
    kept_gathers_bytes: int = at_least(0, 512 * MiB)


DTYPES = ("auto", "float32", "bfloat16", "float16")  # EngineConfig.dtype's names


def check_device(device: str) -> None:
    """Raise ValueError unless `device` is a torch device string ("cpu", "cuda", "cuda:1", ...), by torch's own
    parser: a misspelt one ("cdua", "gpu") is refused where it is set, not in each replica's first step."""
    if device == "cpu":
        return
    import torch  # NOTE: here only: the default device needs no torch to be checked

    try:
        torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"device {device!r} is no torch device ({exc}); e.g. 'cpu', 'cuda', 'cuda:1'") from None


@dataclass(frozen=True)
class EngineConfig(_Bounded):
    model: str | None = None  # local Hugging Face checkpoint folder; None = the built-in tiny Gemma 3
    served_name: str | None = None  # name shown by the API; None = the folder's name
    # the weights' and activations' dtype: "float32", "bfloat16", "float16", or "auto" (the checkpoint's own: its
    # config's, else its weights', else float32); a model may refuse one (Gemma 3: float16)
    dtype: str = "float32"
    device: str = "cpu"  # torch device string, e.g. "cpu", "cuda", "cuda:1"
    max_model_len: int | None = at_least(1, None)  # tokens; None = the checkpoint's max_position_embeddings
    # an HTTP request's unset temperature, top_p, top_k, min_p and repetition_penalty take the checkpoint's
    # generation_config.json values (Gemma 3: top_k 64, top_p 0.95), as vLLM does; False = OpenAI's defaults.
    # In process, `Engine.default_sampling()` gives them (a SamplingParams built directly is taken as it is)
    sampling_defaults_from_checkpoint: bool = True
    media: MediaConfig = field(default_factory=MediaConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    processor_cache: ProcessorCacheConfig = field(default_factory=ProcessorCacheConfig)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model is not None and not self.model.strip():
            raise ValueError("EngineConfig.model is empty; give a checkpoint folder, or leave it unset for the "
                             "built-in tiny model")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        check_device(self.device)
