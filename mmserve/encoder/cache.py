"""The encoder cache's tensors: content hash -> image embeddings.

Owns: the tensors themselves, where they live (the encoder's device). Does not own: any policy —
what to keep and what to evict is decided by `EncoderCacheManager`, whose evicted hashes the owner
passes to `drop` (lazily, after each allocation round).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class EncoderCache:
    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}  # hash -> (num_embeds, hidden)

    def get(self, mm_hash: str) -> torch.Tensor | None:
        return self._tensors.get(mm_hash)

    def get_all(self, hashes: Iterable[str]) -> list[torch.Tensor] | None:
        """Each entry's tensor, in order, when all are here; else None. Safe beside the thread that puts and drops:
        one dict lookup per entry, and an entry's tensor is never written again once put."""
        found = [self._tensors.get(mm_hash) for mm_hash in hashes]
        return None if any(t is None for t in found) else found  # type: ignore[return-value]

    def put(self, mm_hash: str, embeddings: torch.Tensor) -> None:
        if embeddings.dim() != 2:
            raise ValueError(f"expected (num_embeds, hidden) embeddings, got shape {tuple(embeddings.shape)}")
        self._tensors[mm_hash] = embeddings

    def drop(self, hashes: Iterable[str]) -> None:
        """Forget the given entries; unknown hashes are ignored."""
        for mm_hash in hashes:
            self._tensors.pop(mm_hash, None)

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())
