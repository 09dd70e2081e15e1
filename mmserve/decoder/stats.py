"""The decoder's figures at one moment: what `Decoder.stats` returns and the metrics read.

Owns the record only; the decoder fills it (decoder.py) and the decoder service adds its embedding cache's.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.decoder.embedding_cache import EmbeddingCacheStats


@dataclass(frozen=True)
class DecoderStats:
    running: int  # sequences holding KV blocks (requests)
    waiting: int  # sequences queued or preempted, and requests hashed or awaiting embeddings before that (requests)
    free_blocks: int  # KV pages no sequence holds, unheld prefix-cache entries included (pages: one layer's block each)
    total_blocks: int  # KV pages overall (pages)
    steps: int  # forwards run since start (steps)
    kv_cache_bytes: int  # bytes of KV tensors (bytes)
    cached_blocks: int = 0  # prefix-cache entries (blocks of one layer kind)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (tokens)
    prefix_hits: int = 0  # of those, found cached (tokens)
    allocated_blocks: int = 0  # KV pages taken from the pool since start, a shared page once (pages)
    preemptions: int = 0  # sequences sent back to the queue for KV room since start (their work is redone)
    computed_tokens: int = 0  # positions the forwards computed since start: prompt chunks and decodes (tokens)
    sampled_tokens: int = 0  # tokens sampled since start, counted each step (tokens)
    embedding_cache: EmbeddingCacheStats | None = None  # the service's cache of embeddings; None = not read
