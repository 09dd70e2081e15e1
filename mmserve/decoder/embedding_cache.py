"""The decoder's own small cache of image embeddings: content hash -> the embeddings last used here.

Owns: which recent items' embeddings the decoder keeps after their requests end (least recently used
first out, within a byte budget), and its hit counts. Does not own: the encoder's cache, which stays
the cluster's store of embeddings (`mmserve/encoder/`), nor when embeddings are needed (the service
asks only for items not wholly inside the prompt's cached prefix).

NOTE: why a second cache: a repeated image followed by new text (the same picture, another question)
hits the prefix cache only up to the last full block before the new text, and the block holding the
image's last rows also holds that text. Those rows need the image's embeddings again, and without this
cache that is a call to the Encoder (in the Ray app a handle hop, the repeated image's largest cost).
The tensors are the ones the sequences already held: keeping them costs no copy, only their bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EmbeddingCacheStats:
    entries: int  # items held (items)
    bytes: int  # their embeddings' bytes (bytes)
    queries: int  # items looked up since start (items)
    hits: int  # of those, found here (items)


def _nbytes(embeddings: Any) -> int:
    return int(embeddings.numel() * embeddings.element_size())


class EmbeddingCache:
    """Thread-safe LRU of (num_embeds, hidden) tensors by item content hash, at most `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes  # 0 keeps nothing
        self._entries: OrderedDict[str, Any] = OrderedDict()  # hash -> tensor, least recently used first
        self._bytes = 0
        self._queries = self._hits = 0
        self._lock = threading.Lock()  # NOTE: the consumers' loops may be several (the in-process Engine's)

    def get(self, identifier: str) -> Any | None:
        with self._lock:
            self._queries += 1
            embeddings = self._entries.get(identifier)
            if embeddings is None:
                return None
            self._hits += 1
            self._entries.move_to_end(identifier)
            return embeddings

    def put(self, identifier: str, embeddings: Any) -> None:
        """Keep `embeddings` (not copied: callers never write to them), evicting the least recently used."""
        size = _nbytes(embeddings)
        if size > self.capacity_bytes:
            return
        with self._lock:
            old = self._entries.pop(identifier, None)
            if old is not None:
                self._bytes -= _nbytes(old)
            while self._entries and self._bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= _nbytes(evicted)
            self._entries[identifier] = embeddings
            self._bytes += size

    def stats(self) -> EmbeddingCacheStats:
        with self._lock:
            return EmbeddingCacheStats(len(self._entries), self._bytes, self._queries, self._hits)
