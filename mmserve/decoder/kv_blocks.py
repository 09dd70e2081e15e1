"""Which KV pages each sequence holds, per layer kind: full layers keep every block, sliding ones the window.

Owns: the per-layer-kind block tables of a sequence (`SeqBlocks`), and `KVBlockManager`, which sizes
them against one shared pool of pages: how many pages a step needs, growing the tables, returning the
blocks that fell out of every sliding layer's window, releasing a sequence, and how long a sequence
alone may grow. Does not own the K/V tensors (KVCache), who gets pages (the scheduler), nor attention.

A page holds one layer's keys and values of `block_size` positions. A sequence's logical block `b`
(positions `[b * bs, (b + 1) * bs)`) of a layer kind holds one page per layer of that kind, so every
layer has its own page ids and the pool is shared by both kinds: a sliding layer's freed pages serve
anyone's full layers. (vLLM's hybrid allocator groups layers the same way; its page spans a group.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmserve.decoder.block_pool import BlockPool
from mmserve.models.base import SLIDING, AttentionPattern


@dataclass(frozen=True)
class LayerKind:
    name: str  # FULL or SLIDING
    layers: tuple[int, ...]  # decoder layer indices of this kind, in order
    window: int | None  # tokens a query sees back, itself included; None = the whole context


def layer_kinds(pattern: AttentionPattern) -> tuple[LayerKind, ...]:
    """The model's layers grouped by kind, in first-appearance order."""
    names = list(dict.fromkeys(pattern.layer_kinds))
    return tuple(
        LayerKind(name, tuple(i for i, k in enumerate(pattern.layer_kinds) if k == name),
                  pattern.sliding_window if name == SLIDING else None)
        for name in names
    )


@dataclass
class KindTable:
    """One kind's pages of one sequence: row b = logical block b, one page per layer of the kind."""

    pages: np.ndarray  # (capacity, layers) int64 page ids; rows outside [lo, hi) are -1
    lo: int = 0  # first logical block still held (earlier ones fell out of the window)
    hi: int = 0  # logical blocks allocated so far: [0, hi) were, [lo, hi) are held


@dataclass
class SeqBlocks:
    """A sequence's tables, one per layer kind (same order as `KVBlockManager.kinds`)."""

    tables: list[KindTable] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return sum((t.hi - t.lo) * t.pages.shape[1] for t in self.tables)


class KVBlockManager:
    def __init__(self, pool: BlockPool, pattern: AttentionPattern, block_size: int) -> None:
        self.pool, self.block_size = pool, block_size
        self.kinds = layer_kinds(pattern)

    def new_blocks(self) -> SeqBlocks:
        return SeqBlocks([KindTable(np.full((8, len(k.layers)), -1, dtype=np.int64)) for k in self.kinds])

    def pages_to_grow(self, blocks: SeqBlocks, end: int) -> int:
        """Pages a sequence must take before a step writes K/V up to position `end` (exclusive)."""
        need = -(-end // self.block_size)
        return sum(max(need - t.hi, 0) * len(k.layers) for k, t in zip(self.kinds, blocks.tables, strict=True))

    def grow(self, blocks: SeqBlocks, end: int) -> None:
        """Allocate the pages for positions up to `end`; the caller checked `pool.can_allocate` first."""
        need = -(-end // self.block_size)
        for kind, table in zip(self.kinds, blocks.tables, strict=True):
            n = need - table.hi
            if n <= 0:
                continue
            if need > table.pages.shape[0]:
                grown = np.full((max(need, 2 * table.pages.shape[0]), len(kind.layers)), -1, dtype=np.int64)
                grown[: table.hi] = table.pages[: table.hi]
                table.pages = grown
            table.pages[table.hi : need] = np.asarray(self.pool.allocate(n * len(kind.layers))).reshape(n, -1)
            table.hi = need

    def trim(self, blocks: SeqBlocks, next_position: int) -> int:
        """Return the blocks no sliding layer will read again: the next query sits at `next_position`
        and sees back `window` positions, itself included. Returns the pages freed."""
        freed = 0
        for kind, table in zip(self.kinds, blocks.tables, strict=True):
            if kind.window is None:
                continue
            first = max(next_position - kind.window + 1, 0) // self.block_size
            if first > table.lo:
                rows = table.pages[table.lo : first]
                self.pool.free(rows.ravel().tolist())
                freed += rows.size
                rows.fill(-1)
                table.lo = first
        return freed

    def release(self, blocks: SeqBlocks) -> None:
        """Give every page back (finished, aborted or preempted)."""
        for table in blocks.tables:
            if table.hi > table.lo:
                self.pool.free(table.pages[table.lo : table.hi].ravel().tolist())
            table.pages.fill(-1)
            table.lo = table.hi = 0

    def peak_pages(self, num_tokens: int, chunk: int) -> int:
        """Pages a sequence of `num_tokens` holds at most while a step computes `chunk` of them."""
        blocks = -(-num_tokens // self.block_size)
        total = 0
        for kind in self.kinds:
            held = blocks
            if kind.window is not None:  # the window before the chunk, the chunk, a block on each edge
                held = min(blocks, -(-(kind.window - 1) // self.block_size) + -(-chunk // self.block_size) + 2)
            total += held * len(kind.layers)
        return total

    def max_tokens_alone(self, chunk: int, limit: int) -> int:
        """The longest sequence (<= `limit` tokens) that fits the whole pool alone, with steps of `chunk`."""
        lo, hi = 0, limit
        while lo < hi:  # NOTE: peak_pages is monotone in the length
            mid = (lo + hi + 1) // 2
            if self.peak_pages(mid, chunk) <= self.pool.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo
