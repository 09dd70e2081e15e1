"""Where one sequence's chunk of a step ends: the token budget, images kept whole, embeddings in hand.

Owns: the rule for how many tokens a sequence computes in a step, given the budget left: its remainder,
cut so that a chunk never ends inside an atomic span (Gemma 3's image, whose tokens attend to each
other both ways) and never reaches an item whose embeddings the sequence lacks. Does not own the budget
nor the queues (scheduler.py), nor asking for missing embeddings (the decoder service). Also warns at start-up
where the configured budget may leave an image waiting for running decodes.
"""

from __future__ import annotations

import logging

from mmserve.config import DecoderConfig
from mmserve.decoder.sequence import Sequence
from mmserve.models.base import ModelSpec

log = logging.getLogger(__name__)


def chunk_tokens(seq: Sequence, budget: int) -> int:
    """Tokens to compute for `seq` this step: its remainder, cut to `budget`, to image spans and to
    the first item whose embeddings it lacks."""
    start = seq.num_computed_tokens
    end = start + min(seq.num_tokens - start, budget)
    if end < seq.num_tokens:
        end = _end_outside_spans(seq, start, end)
    for i in lacking(seq):
        f = seq.features[i]
        if f.placeholder.offset + f.placeholder.length > start:
            end = min(end, f.placeholder.offset)
    return max(end - start, 0)


def awaits_embeddings(seq: Sequence, start: int) -> bool:
    """Whether a chunk from `start` cannot begin for want of an item's embeddings: an item it lacks begins
    there, or `start` falls inside one."""
    spans = (seq.features[i].placeholder for i in lacking(seq))
    return any(span.offset <= start < span.offset + span.length for span in spans)


def needs_items(seq: Sequence, indices: list[int]) -> bool:
    """Whether the features at `indices` still lie (in part) ahead of what `seq` has computed.

    NOTE: a sequence that lacked them may have gone past them on a prefix the cache found after its ask."""
    ends = (seq.features[i].placeholder.offset + seq.features[i].placeholder.length for i in indices)
    return any(end > seq.num_computed_tokens for end in ends)


def lacking(seq: Sequence) -> list[int]:
    """Features whose embeddings the sequence was given as None (their placeholder was cached)."""
    return [i for i, emb in enumerate(seq.embeddings) if emb is None]


def _end_outside_spans(seq: Sequence, chunk_start: int, end: int) -> int:
    """Move a chunk end that falls strictly inside an atomic span back to the span's start (to the chunk's
    start, i.e. nothing this step, when the chunk starts inside that span: a cached prefix ended in it).

    NOTE: Gemma 3 attends both ways within one image (or crop), so a chunk must hold its tokens whole;
    an item's crops, and the text between them, may go to different steps (the model runner merges
    the matching rows of the item's embeddings). A prefix cached from a step that saw the whole image
    may end inside it: its K/V are right, and the rest of the image must go in one chunk. Spans are
    disjoint, so one move is enough; a chunk that starts inside a span and cannot reach its end this step
    waits (0 tokens) for a step with that much budget (`add` checked the span fits max_num_batched_tokens).
    """
    for start, stop in seq.atomic_spans:
        if start < end < stop:
            return start if start >= chunk_start else chunk_start
    return end


def check_image_budget(spec: ModelSpec, config: DecoderConfig) -> None:
    """Refuse a step budget below one image's tokens (every request with an image would be refused, after its
    encode); warn where an image's tokens, computed in one step, may wait for running decodes to end.

    NOTE: an image whose tokens attend both ways goes whole into one step's chunk; with fewer than the image's
    tokens left after `max_num_seqs - 1` decodes, running sequences take the budget in arrival order
    (`decodes_leave_room`), and a prompt's image waits until earlier requests finish.
    """
    if not (spec.attention.bidirectional_images and spec.mm_tokens_per_image):
        return
    if config.max_num_batched_tokens < spec.mm_tokens_per_image:
        raise ValueError(f"decoder.max_num_batched_tokens={config.max_num_batched_tokens} is below one image's "
                         f"{spec.mm_tokens_per_image} tokens, which attend both ways and so are computed in one step: "
                         "no request with an image could be served")
    if not decodes_leave_room(spec, config):
        log.warning("decoder.max_num_batched_tokens=%d is below an image's %d tokens plus max_num_seqs - 1 = %d "
                    "decodes: an image's prefill may wait until earlier requests finish, and a long prompt's "
                    "chunks hold back the decodes of later ones; set it to at least %d",
                    config.max_num_batched_tokens, spec.mm_tokens_per_image, config.max_num_seqs - 1,
                    _room_needed(spec, config))


def decodes_leave_room(spec: ModelSpec, config: DecoderConfig) -> bool:
    """Whether a step's budget, after a decode for every seat but one, still holds a prefill's next chunk: one
    token, or a whole image where images attend both ways. Then a step may take its decodes first (scheduler.py)
    without stopping any prefill: the oldest one's chunk always fits what they leave."""
    return config.max_num_batched_tokens >= _room_needed(spec, config)


def _room_needed(spec: ModelSpec, config: DecoderConfig) -> int:
    """A prefill's largest next chunk (an image's tokens where they attend both ways, else one) beside a decode
    for every other seat (tokens)."""
    chunk = spec.mm_tokens_per_image if spec.attention.bidirectional_images and spec.mm_tokens_per_image else 1
    return chunk + config.max_num_seqs - 1
