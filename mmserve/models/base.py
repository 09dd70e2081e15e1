"""What shared code may know about a model: its data (`ModelSpec`) and the loaded parts.

Owns: the model-independent description every stage reads (token ids, attention pattern, context
length, KV shapes) and the `ModelFamily` protocol a model module implements. Does not own: any
model's own rules or weights (those live in `mmserve/models/<family>.py`), nor family lookup
(`registry.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from mmserve.messages import SamplingDefaults

if TYPE_CHECKING:
    from mmserve.decoder.attention import AttentionMetadata
    from mmserve.decoder.kv_cache import KVCache
    from mmserve.runtime.matmul_forms import MatmulForms

FULL = "full_attention"  # layer kind: attends to the whole context
SLIDING = "sliding_attention"  # layer kind: attends to the last `sliding_window` positions only


@dataclass(frozen=True)
class AttentionPattern:
    layer_kinds: tuple[str, ...]  # per decoder layer: FULL or SLIDING
    sliding_window: int | None  # tokens a SLIDING layer sees back, the query included
    bidirectional_images: bool  # during prefill, the tokens of one image attend to each other both ways
    scaling: float  # multiplier of q·k (e.g. query_pre_attn_scalar ** -0.5)
    softcap: float | None  # tanh soft-capping of attention logits; None = off


@dataclass(frozen=True)
class ModelSpec:
    family: str  # registry key, e.g. "gemma3"
    model_id: str  # name served and hashed into cache keys
    image_token_id: int  # token id of one image embedding row in the prompt
    mm_tokens_per_image: int  # embedding rows per image crop (tokens)
    vocab_size: int  # logits width (tokens)
    hidden_size: int  # text model width; embeddings are (n, hidden_size)
    num_layers: int  # decoder layers (each has its own KV cache)
    num_kv_heads: int  # KV heads per layer
    head_dim: int  # features per head
    max_model_len: int  # prompt + output tokens a sequence may hold (tokens)
    eos_token_ids: tuple[int, ...]  # ids that end generation (eos, end-of-turn)
    attention: AttentionPattern
    # ids the sampler never picks (tokens): a prompt-only token such as an image's embedding row
    never_sampled: tuple[int, ...] = ()
    image_size: int = 0  # pixels per side of one crop as the vision tower takes it (px); 0 = unknown
    # what a request's unset sampling fields take (the checkpoint's recommendation, or OpenAI's defaults)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


# A vision callable maps (n_images, 3, H, W) uint8 pixels (a ProcessedItem's, on the encoder's device) to
# (n_images, mm_tokens, hidden) embeddings; rescaling and normalizing them is its job.
VisionEncoder = Callable[[torch.Tensor], torch.Tensor]


class TextDecoder(Protocol):
    """A decoder forward over our paged KV cache (see mmserve/decoder/attention.py)."""

    matmul: MatmulForms  # how its products x @ w.T are computed; the decoder measures and selects the forms

    def linear_weights(self) -> list[torch.Tensor]: ...  # the (out, in) weights `pack_weights` lays out, step order

    def relayout_weight(self, index: int) -> None: ...  # store the index-th of those as `matmul.relaid` makes it

    def pack_weights(self) -> None: ...  # store every one of them as `matmul.relaid` makes it

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...  # (T,) -> (T, hidden)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor: ...  # (T, hidden) -> (T, hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # (n, hidden) -> (n, vocab)


class PromptRule(Protocol):
    """How a family's prompt holds images; the preprocessor applies it without asking which model it is.

    The chat template emits `placeholder` once per image; `expand` rewrites each into the item's
    image-token runs (one run of `mm_tokens` image tokens per image or crop) and whatever text the
    model puts around them.
    """

    @property
    def placeholder(self) -> str: ...  # what the chat template emits for each {"type": "image"} part

    @property
    def image_token(self) -> str: ...  # the token of one embedding row

    @property
    def mm_tokens(self) -> int: ...  # image tokens per image or crop (tokens)

    @property
    def reserved_strings(self) -> tuple[str, ...]: ...  # user text may not contain these

    def expand(self, text: str, crops_per_item: list[int]) -> str: ...  # crops per item, prompt order

    def tiles(self, processed: Mapping[str, Any]) -> np.ndarray:
        """One image's (tiles, 3, H, W) pixels from its image-processor output (a dict of arrays), the whole
        image first, then its crops; raises when the output does not add up."""
        ...

    def resolve_kwargs(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """Every output-changing image-processor kwarg: defaults updated by the request's, each checked
        (InvalidRequestError naming a bad or unknown one)."""
        ...


class ModelFamily(Protocol):
    """What a model module provides; shared code never asks which model it is."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def prompt_rule(self) -> PromptRule: ...

    @property
    def dtype(self) -> torch.dtype: ...  # the weights' and activations' (EngineConfig.dtype resolved)

    def load_vision(self, *, alone: bool = False) -> VisionEncoder: ...  # alone: no text model loaded beside it

    def load_text(self) -> TextDecoder: ...

    def vision_weights_id(self) -> str: ...  # the weights load_vision reads, fingerprinted (weights_id.py); "" unknown

    def release_unused(self) -> None: ...  # drop whatever loading kept that no part handed out uses


def checkpoint_name(model_dir: Path) -> str:
    """The name a checkpoint folder is served under by default: the repo id for a Hugging Face cache snapshot
    (`.../models--google--gemma-3-4b-it/snapshots/<commit>` -> `google/gemma-3-4b-it`), else the folder's name."""
    parent = model_dir.resolve().parent if model_dir.exists() else model_dir.parent
    if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
        return parent.parent.name.removeprefix("models--").replace("--", "/")
    return model_dir.name
