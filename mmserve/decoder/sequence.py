"""One request's state inside the decoder: tokens, KV block table, progress, image embeddings.

Owns: the per-request bookkeeping shared by the scheduler (which advances it), the model runner
(which reads it) and the output processor (which appends tokens). Does not own: scheduling policy,
KV memory, or tensors' computation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from mmserve.messages import FinishReason, MultiModalFeatureSpec, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted back to the queue (holds no KV blocks)
    RUNNING = "running"  # holds KV blocks, scheduled every step
    FINISHED = "finished"  # done or aborted; blocks returned


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]  # prompt with placeholders expanded (tokens)
    sampling: SamplingParams
    features: list[MultiModalFeatureSpec] = field(default_factory=list)  # in prompt order
    embeddings: list[Any] = field(default_factory=list)  # per feature (num_embeds, hidden) tensor
    # [start, end) prompt ranges a prefill chunk must hold whole: runs of image tokens that attend to
    # each other both ways (tokens); empty for a model whose images attend causally
    atomic_spans: list[tuple[int, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + generated (tokens)
    num_computed_tokens: int = 0  # leading tokens whose K/V sit in the cache (tokens)
    block_table: list[int] = field(default_factory=list)  # KV block ids, in position order
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_order: int = 0  # admission order, FCFS tie-break (count)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens remain to be computed."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
