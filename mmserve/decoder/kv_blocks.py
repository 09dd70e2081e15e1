"""Which KV pages each sequence holds, per layer kind: full layers keep every block, sliding ones the window.

Owns: the per-layer-kind block tables of a sequence (`SeqBlocks`), and `KVBlockManager`, which sizes
them against one shared pool of pages: how many pages a step needs, growing the tables, returning the
blocks that fell out of every sliding layer's window, releasing a sequence, how long a sequence alone
may grow, and, with a `PrefixCache`, indexing the full blocks a sequence computed and starting a new
sequence on the longest cached prefix (a full layer needs every block of it, a sliding layer only the
blocks inside the window before its end). Does not own the K/V tensors (KVCache), the block hashes
(prefix_cache.py), who gets pages (the scheduler), nor attention.

A page holds one layer's keys and values of `block_size` positions. A sequence's logical block `b`
(positions `[b * bs, (b + 1) * bs)`) of a layer kind holds one page per layer of that kind, so every
layer has its own page ids and the pool is shared by both kinds: a sliding layer's freed pages serve
anyone's full layers. (vLLM's hybrid allocator groups layers the same way; its page spans a group.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmserve.decoder.block_pool import BlockPool
from mmserve.decoder.prefix_cache import CachedBlock, PrefixCache
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
    shared: dict[int, CachedBlock] = field(default_factory=dict)  # rows that are prefix-cache entries (held)
    indexed: int = 0  # rows before this were offered to the prefix cache


@dataclass
class SeqBlocks:
    """A sequence's tables, one per layer kind (same order as `KVBlockManager.kinds`)."""

    tables: list[KindTable] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return sum((t.hi - t.lo) * t.pages.shape[1] for t in self.tables)


class KVBlockManager:
    def __init__(self, pool: BlockPool, pattern: AttentionPattern, block_size: int,
                 cache: PrefixCache | None = None) -> None:
        self.pool, self.block_size, self.cache = pool, block_size, cache
        self.kinds = layer_kinds(pattern)

    def new_blocks(self) -> SeqBlocks:
        return SeqBlocks([KindTable(np.full((8, len(k.layers)), -1, dtype=np.int64)) for k in self.kinds])

    @property
    def num_free(self) -> int:
        """Pages no sequence holds: the pool's free ones and those of free prefix-cache entries."""
        return self.pool.num_free + (self.cache.free_pages if self.cache is not None else 0)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def pages_to_grow(self, blocks: SeqBlocks, end: int) -> int:
        """Pages a sequence must take before a step writes K/V up to position `end` (exclusive)."""
        need = -(-end // self.block_size)
        return sum(max(need - t.hi, 0) * len(k.layers) for k, t in zip(self.kinds, blocks.tables, strict=True))

    def grow(self, blocks: SeqBlocks, end: int) -> None:
        """Allocate the pages for positions up to `end`; the caller checked `can_allocate` first."""
        need = -(-end // self.block_size)
        for kind, table in zip(self.kinds, blocks.tables, strict=True):
            n = need - table.hi
            if n <= 0:
                continue
            _ensure_rows(table, need)
            pages = self.cache.allocate(n * len(kind.layers)) if self.cache is not None else \
                self.pool.allocate(n * len(kind.layers))
            table.pages[table.hi : need] = np.asarray(pages).reshape(n, -1)
            table.hi = need

    def trim(self, blocks: SeqBlocks, next_position: int) -> int:
        """Let go of the blocks no sliding layer will read again: the next query sits at `next_position`
        and sees back `window` positions, itself included. Returns the pages let go."""
        freed = 0
        for kind, table in zip(self.kinds, blocks.tables, strict=True):
            if kind.window is None:
                continue
            first = _first_block(next_position, kind.window, self.block_size)
            if first > table.lo:
                freed += self._let_go(table, range(table.lo, first))
                table.lo = first
        return freed

    def release(self, blocks: SeqBlocks) -> None:
        """Let go of every page (finished, aborted or preempted); the tail first, every kind's block b
        before any kind's block b - 1, so that cached blocks leave the cache tail first too."""
        for row in range(max((t.hi for t in blocks.tables), default=0) - 1, -1, -1):
            for table in blocks.tables:
                if table.lo <= row < table.hi:
                    self._let_go(table, range(row, row + 1))
        for table in blocks.tables:
            table.lo = table.hi = table.indexed = 0

    def _let_go(self, table: KindTable, rows: range) -> int:
        private: list[int] = []
        for row in rows:
            block = table.shared.pop(row, None)
            if block is not None:
                assert self.cache is not None
                self.cache.let_go(block)
            else:
                private += table.pages[row].tolist()
            table.pages[row] = -1
        self.pool.free(private)
        return len(rows) * table.pages.shape[1]

    # ---- prefix caching ------------------------------------------------------------------------

    def index(self, blocks: SeqBlocks, hashes: list[bytes], computed: int) -> None:
        """Offer the cache every full block whose K/V are all written (`computed` positions)."""
        if self.cache is None:
            return
        upto = min(computed // self.block_size, len(hashes))
        for k, table in enumerate(blocks.tables):
            for row in range(max(table.indexed, table.lo), upto):
                if row not in table.shared:
                    block = self.cache.add(k, hashes[row], table.pages[row])
                    if block is not None:
                        table.shared[row] = block
            table.indexed = max(table.indexed, upto)

    def cached_prefix(self, hashes: list[bytes], limit: int) -> int:
        """Blocks of the longest prefix (at most `limit` blocks) every layer kind finds cached."""
        if self.cache is None:
            return 0
        m = min(limit, len(hashes))
        full = [k for k, kind in enumerate(self.kinds) if kind.window is None]
        if full:
            n = 0
            while n < m and all(self.cache.find(k, hashes[n]) is not None for k in full):
                n += 1
            m = n
        return self._window_hit(hashes, m)

    def _window_hit(self, hashes: list[bytes], m: int) -> int:
        """The longest end of at most `m` blocks at which every sliding kind finds cached the blocks its window
        reads. NOTE: right to left, each block looked up once per kind: a block missing at b rules out every
        end past it (their windows hold it), so the next end tried is b (trying ends one by one, each with its
        window, looked a window up per end)."""
        assert self.cache is not None
        sliding = [(k, kind) for k, kind in enumerate(self.kinds) if kind.window is not None]
        found_above = {k: m for k, _ in sliding}  # kind -> every block from it up to the end: found cached
        settled = False
        while not settled and m > 0:
            settled = True
            for k, kind in sliding:
                lo, b = self._first_read(kind, m), min(found_above[k], m) - 1
                while b >= lo and self.cache.find(k, hashes[b]) is not None:
                    b -= 1
                found_above[k] = b + 1
                if b >= lo:  # missing
                    m, settled = b, False
        return m

    def start_from_cache(self, blocks: SeqBlocks, hashes: list[bytes], limit: int) -> int:
        """Hold the longest cached prefix for a sequence that holds nothing yet; returns its tokens."""
        m = self.cached_prefix(hashes, limit)
        if m == 0:
            return 0
        assert self.cache is not None
        for k, (kind, table) in enumerate(zip(self.kinds, blocks.tables, strict=True)):
            lo = self._first_read(kind, m)
            _ensure_rows(table, m)
            for row in range(lo, m):
                block = self.cache.find(k, hashes[row])
                assert block is not None
                self.cache.hold(block)
                table.pages[row], table.shared[row] = block.pages, block
            table.lo, table.hi, table.indexed = lo, m, m
        return m * self.block_size

    def pages_in_hand(self, blocks: SeqBlocks, num_tokens: int) -> int:
        """Pages a sequence of `num_tokens` tokens holds that count toward its peak at no further cost to the
        pool: all it holds, less the sliding layers' cached blocks that others hold too and that its window
        passes before its last token (it takes new pages in their place, while they stay with the others)."""
        passed = sum(len(block.pages) for kind, table in zip(self.kinds, blocks.tables, strict=True)
                     if kind.window is not None for row, block in table.shared.items()
                     if block.holders > 1 and row < _first_block(num_tokens - 1, kind.window, self.block_size))
        return blocks.num_pages - passed

    def _first_read(self, kind: LayerKind, blocks: int) -> int:
        """The first block a kind reads for a query at position `blocks * block_size`."""
        if kind.window is None:
            return 0
        return _first_block(blocks * self.block_size, kind.window, self.block_size)

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


def _first_block(position: int, window: int, block_size: int) -> int:
    """The first block a sliding layer's query at `position` reads (it sees back `window` positions, itself
    included)."""
    return max(position - window + 1, 0) // block_size


def _ensure_rows(table: KindTable, rows: int) -> None:
    if rows > table.pages.shape[0]:
        grown = np.full((max(rows, 2 * table.pages.shape[0]), table.pages.shape[1]), -1, dtype=np.int64)
        grown[: table.hi] = table.pages[: table.hi]
        table.pages = grown
