"""One request's state inside the decoder: tokens, KV block tables, progress, image embeddings.

Owns: the per-request bookkeeping shared by the scheduler (which advances it), the model runner
(which reads it) and the output processor (which appends tokens). Does not own: scheduling policy,
KV memory, or tensors' computation.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmserve.decoder.kv_blocks import SeqBlocks
from mmserve.messages import FinishReason, MultiModalFeatureSpec, SamplingParams


@dataclass(frozen=True)
class PromptImages:
    """Where a prompt's image embedding rows sit: the image tokens inside the features' placeholders.

    NOTE: found from the placeholders, not by token id alone, so an image token anywhere else (a sampled
    output, which is always text) is just a token.
    """

    runs: np.ndarray  # (num_prompt,) int64: the run (one image or crop) of each position, -1 for text
    feature: np.ndarray  # (num_prompt,) int64: the feature whose embeddings fill the position, -1 for text
    row: np.ndarray  # (num_prompt,) int64: the position's row in that feature's embeddings, -1 for text

    @classmethod
    def of(cls, prompt: list[int], features: list[MultiModalFeatureSpec], image_token_id: int) -> PromptImages:
        ids = np.asarray(prompt, dtype=np.int64)
        feature = np.full(len(ids), -1, dtype=np.int64)
        row = np.full(len(ids), -1, dtype=np.int64)
        for f, spec in enumerate(features):
            lo, hi = spec.placeholder.offset, spec.placeholder.offset + spec.placeholder.length
            at = lo + np.flatnonzero(ids[lo:hi] == image_token_id)
            if len(at) != spec.num_embeds:
                raise ValueError(f"feature {spec.identifier} has {spec.num_embeds} embeddings for {len(at)} "
                                 f"image tokens in its placeholder [{lo}, {hi})")
            feature[at], row[at] = f, np.arange(len(at))
        is_image = feature >= 0
        starts = is_image & ~np.concatenate(([False], is_image[:-1]))
        return cls(np.where(is_image, np.cumsum(starts) - 1, -1), feature, row)

    def spans(self) -> list[tuple[int, int]]:
        """[start, end) of each run, in order."""
        padded = np.concatenate(([-1], self.runs, [-1]))
        bounds = np.flatnonzero(padded[1:] != padded[:-1]).tolist()  # positions where the run changes
        return [(a, b) for a, b in itertools.pairwise(bounds) if self.runs[a] >= 0]


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
    images: PromptImages | None = None  # where the prompt's image rows go; None = a prompt without images
    token_ids: list[int] = field(default_factory=list)  # prompt + generated (tokens)
    num_computed_tokens: int = 0  # leading tokens whose K/V sit in the cache (tokens)
    blocks: SeqBlocks = field(default_factory=SeqBlocks)  # KV pages held, per layer kind (the scheduler's)
    cache_salt: str | None = None  # part of the first block's hash
    block_hashes: list[bytes] = field(default_factory=list)  # digests of its full blocks so far, in order
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached; None = not yet
    requested: set[int] = field(default_factory=set)  # features whose missing embeddings were asked for
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
        """NOTE: a copy, as long as the output: per step, count with `num_output_tokens` (penalties read a
        TokenHistory)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens remain to be computed."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def stop_reason(self, last_token: int, stop_string: str | None, named_ends: frozenset[int] = frozenset(),
                    tokenizer_end: int | None = None) -> str | int | None:
        """vLLM's `stop_reason` once finished: the stop string found, else the stop token id that ended it (the
        request's own, or one of `named_ends` unless it ignores the model's end or writes under a grammar), else
        None (`tokenizer_end`, the tokenizer's own end, unless it ignores the model's end: vLLM checks that end
        first, listed in `stop_token_ids` or not; a grammar's end; a finish other than "stop").

        NOTE: vLLM's grammars end only on the tokenizer's own end token; ours on any of the model's, so a
        constrained choice's end is named by none of them."""
        if self.finish_reason != "stop":
            return None
        if stop_string is not None:
            return stop_string
        if last_token == tokenizer_end and not self.sampling.ignore_eos:
            return None
        named = last_token in named_ends and not self.sampling.ignore_eos and self.sampling.structured is None
        return last_token if last_token in self.sampling.stop_token_ids or named else None
