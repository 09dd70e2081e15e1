"""What shared code may know about a model: its data (`ModelSpec`) and the loaded parts.

Owns: the model-independent description every stage reads (token ids, attention pattern, context
length, KV shapes) and the `ModelFamily` protocol a model module implements. Does not own: any
model's own rules or weights (those live in `mmserve/models/<family>.py`), nor family lookup
(`registry.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

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


# A vision callable maps (n_images, 3, H, W) uint8 pixels (a ProcessedItem's, on the encoder's device) to
# (n_images, mm_tokens, hidden) embeddings; rescaling and normalizing them is its job.
VisionEncoder = Callable[[torch.Tensor], torch.Tensor]


class TextDecoder(Protocol):
    """A decoder forward over our paged KV cache (see mmserve/decoder/attention.py)."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...  # (T,) -> (T, hidden)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # (n, hidden) -> (n, vocab)


class ModelFamily(Protocol):
    """What a model module provides; shared code never asks which model it is."""

    spec: ModelSpec
    prompt_rule: Any  # the family's placeholder rule (e.g. Gemma3PromptRule)

    def load_vision(self) -> VisionEncoder: ...

    def load_text(self) -> TextDecoder: ...

    def release_unused(self) -> None: ...  # drop whatever loading kept that no part handed out uses
