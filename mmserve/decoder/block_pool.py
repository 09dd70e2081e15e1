"""Bookkeeping of KV-cache block ids: which are free, which are held and by how many sequences.

Owns: the fixed set of block ids `0 .. num_blocks-1`, a free list and a reference count per block.
Does not own: the K/V tensors (the model runner allocates those, indexed by these ids), nor the
policy of who gets blocks (the scheduler).

Prefix reuse builds on it without living here: `prefix_cache.py` indexes hashed blocks and keeps a
block its last sequence let go until an allocation needs the room (`PrefixCache.allocate` then frees it
here); a hit adds a holder with `share`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class OutOfBlocksError(RuntimeError):
    """`allocate` was asked for more blocks than are free; callers check `can_allocate` first."""


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0  # sequences holding this block (count); 0 = on the free list


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # NOTE: allocate from the head, free to the tail
        self.allocated = 0  # blocks handed out by `allocate` since start, a shared one counted once (blocks)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with reference count 1; raise OutOfBlocksError if too few."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        self.allocated += n
        for block_id in ids:
            block = self._blocks[block_id]
            block.ref_count = 1
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Add one holder to blocks already held (the prefix-reuse path)."""
        for block_id in block_ids:
            block = self._held(block_id)
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; a block whose count reaches 0 goes back to the free list.

        Blocks are returned last-first so that the tail of a sequence, the least likely to be shared
        later, is the first to be reused.
        """
        for block_id in reversed(block_ids):
            block = self._held(block_id)
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def _held(self, block_id: int) -> KVBlock:
        if not 0 <= block_id < len(self._blocks):
            raise ValueError(f"block id {block_id} out of range [0, {len(self._blocks)})")
        block = self._blocks[block_id]
        if block.ref_count <= 0:
            raise ValueError(f"block {block_id} is not held (double free?)")
        return block
