"""Prefix caching keyed by content: full KV blocks named by a hash chain, kept findable after their last
holder lets go.

Owns: the block hash (`BlockHasher`: each full block's digest chained from its parent's, over its token
ids, the multimodal items that overlap it and, for the first block, the request's cache salt; the root
names the model and dtype), and the index of cached blocks (`PrefixCache`: per layer kind, hash ->
pages; entries no sequence holds wait in least-recently-freed order and give their pages back only
when an allocation needs them). Does not own which blocks a sequence holds (kv_blocks.py) nor who is
admitted (the scheduler).

NOTE: a collision here would hand one request another's context, so the digest is blake2b-256 over a
canonical byte encoding (fixed-width parent and token ids, length-prefixed item ids), never `hash()`.
An item's identifier is its content hash (pixels, size, model, processor kwargs), so two images that
differ in one pixel share no block past the template.
NOTE: a hit may end inside an image: the cached image rows' K/V are exact because that identifier names the
whole image (a later row of the same run is the same), and only then. An identifier a client could choose
(vLLM's `multi_modal_uuids`) would break this, and must not reach the hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mmserve.decoder.block_pool import BlockPool
from mmserve.messages import MultiModalFeatureSpec

VERSION = b"mmserve-prefix-v1"


class BlockHasher:
    def __init__(self, model_id: str, dtype: str, block_size: int) -> None:
        self.block_size = block_size
        self.root = _digest(VERSION, _field(model_id.encode()), _field(dtype.encode()))

    def extend(self, hashes: list[bytes], token_ids: list[int], features: list[MultiModalFeatureSpec],
               salt: str | None) -> None:
        """Append to `hashes` the digest of every full block of `token_ids` past those it has."""
        bs = self.block_size
        first, last = len(hashes), len(token_ids) // bs
        if first >= last:  # NOTE: most calls (a decode step's, 15 in 16): no block completed
            return
        # NOTE: the new blocks' ids made bytes in one call, not one call a block (a 128k prompt has 8k blocks)
        raw = np.asarray(token_ids[first * bs : last * bs], dtype=np.int64).tobytes()  # (blocks * bs) int64
        width = bs * 8  # bytes of a block's ids
        for b in range(first, last):
            start = b * bs
            items = b"".join(  # every item overlapping the block, with the block's offset inside it
                _field(f.identifier.encode()) + struct.pack("<q", start - f.placeholder.offset)
                for f in features
                if f.placeholder.offset < start + bs and start < f.placeholder.offset + f.placeholder.length
            )
            salted = _field(salt.encode()) if salt is not None and b == 0 else b""
            tokens = raw[(b - first) * width : (b - first + 1) * width]
            hashes.append(_digest(hashes[-1] if hashes else self.root, tokens, _field(items), salted))


    def prompt(self, token_ids: list[int], features: list[MultiModalFeatureSpec],
               salt: str | None) -> tuple[bytes, ...]:
        """The digests of every full block of a prompt."""
        hashes: list[bytes] = []
        self.extend(hashes, token_ids, features, salt)
        return tuple(hashes)


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    for part in parts:
        h.update(part)
    return h.digest()


@dataclass(eq=False)
class CachedBlock:
    key: tuple[int, bytes]  # (layer kind index, block hash)
    pages: np.ndarray  # (layers of the kind,) int64 page ids holding the block
    holders: int = 0  # sequences whose tables hold it; 0 = free, in the LRU, evictable


class PrefixCache:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.entries: dict[tuple[int, bytes], CachedBlock] = {}
        self._free: OrderedDict[tuple[int, bytes], CachedBlock] = OrderedDict()  # least recently freed first
        self.free_pages = 0  # pages of free entries: held by no sequence, given back on demand

    def find(self, kind: int, block_hash: bytes) -> CachedBlock | None:
        return self.entries.get((kind, block_hash))

    def hold(self, block: CachedBlock) -> None:
        if block.holders == 0:
            del self._free[block.key]
            self.free_pages -= len(block.pages)
        block.holders += 1

    def let_go(self, block: CachedBlock) -> None:
        block.holders -= 1
        if block.holders == 0:
            self._free[block.key] = block
            self.free_pages += len(block.pages)

    def add(self, kind: int, block_hash: bytes, pages: np.ndarray) -> CachedBlock | None:
        """Index pages a sequence holds as block `block_hash` of `kind`, held by it; None if another copy
        is indexed already (the sequence keeps its pages private then)."""
        key = (kind, block_hash)
        if key in self.entries:
            return None
        block = self.entries[key] = CachedBlock(key, pages.copy(), holders=1)
        return block

    def allocate(self, n: int) -> list[int]:
        """`n` pages from the pool, evicting free entries (least recently freed first) if it runs short."""
        while self.pool.num_free < n and self._free:
            key, block = self._free.popitem(last=False)
            del self.entries[key]
            self.free_pages -= len(block.pages)
            self.pool.free(block.pages.tolist())
        return self.pool.allocate(n)
