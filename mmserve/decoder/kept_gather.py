"""Gathers of a decode group's pages kept from step to step, so that a step copies only the pages that changed.

Owns: one workspace per layer holding the last gather of that layer's decode group (its sequences' pages
side by side, as `KVCache.gather` lays them out), the host's record of which pages each step writes, and
the plan of what a step must copy to bring a kept gather up to date (`Refresh`). Does not own which pages a
group reads (attention.py's metadata), the cache's tensors nor the shared workspace (kv_cache.py).

A decode step reads every page its sequences hold on a full-attention layer (a sliding layer: its window's)
and writes one token. With no paged attention kernel for the CPU in PyTorch the pages are gathered (copied)
before attention, which at long contexts costs as much as attention itself; yet from one step to the next
only the page each sequence writes changes. A kept gather is brought up to date by copying the positions
that hold a different page than last time (a sequence joined, left, or gained a block), or a page written
since that layer's last refresh (which includes this step's token: the forward writes a layer's K/V before
it attends). Padding positions (masked out) are never copied: the workspace starts as zeros, and whatever a
position held before is finite.

NOTE: the plans of all layers of a kind are made on the host, from the metadata's page lists and slots, and
sent in one copy with the rest of the metadata: no device sync. A gather below `from_bytes` is copied whole
as before: there the extra calls cost more than the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmserve.decoder.kv_cache import KVCache
from mmserve.runtime.host_copy import to_device


@dataclass(frozen=True)
class Refresh:
    """What one layer's kept gather copies this step, and the result."""

    keys: torch.Tensor  # (n, block_size, kv_heads, head_dim): the kept gather of keys, up to date once applied
    values: torch.Tensor  # the same for values
    positions: torch.Tensor | None  # (m,) positions in the gather to copy; None = all n, in order
    pages: torch.Tensor  # (m,) the page each of them holds now

    def apply(self, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the stale positions from the cache -> (keys, values) as `KVCache.gather` returns them."""
        if self.positions is None:  # NOTE: straight into the workspace, no temporary
            torch.index_select(kv.keys, 0, self.pages, out=self.keys)
            torch.index_select(kv.values, 0, self.pages, out=self.values)
        elif self.positions.shape[0]:
            self.keys.index_copy_(0, self.positions, kv.keys.index_select(0, self.pages))
            self.values.index_copy_(0, self.positions, kv.values.index_select(0, self.pages))
        return self.keys, self.values


NO_PAGE = -1  # a kept position whose content is no page's as of the last refresh (padding left uncopied)


class KeptGathers:
    """Per layer, the last decode group's gather, within `budget_bytes` of workspaces in all; gathers of at
    least `from_bytes` (keys and values together) are kept."""

    def __init__(self, kv: KVCache, *, budget_bytes: int, from_bytes: int) -> None:
        self._kv, self._budget, self._from = kv, budget_bytes, from_bytes
        self._page_bytes = 2 * kv.keys[0].numel() * kv.keys.element_size()  # a page's keys and values (bytes)
        self._written = np.zeros(kv.num_pages, dtype=np.int64)  # page -> the last step that wrote it
        self._step = 0  # steps noted so far
        self._kept: dict[int, _Kept] = {}  # layer -> its workspace and the layout it holds
        self.positions = 0  # positions of kept gathers planned so far (pages)
        self.copied = 0  # of them, copied from the cache (pages)

    def wrote(self, pages: np.ndarray) -> None:
        """Start a step whose forward writes `pages` (any shape of page ids, every layer's)."""
        self._step += 1
        self._written[pages.ravel()] = self._step

    def plan(self, layers: tuple[int, ...], pages: np.ndarray, valid: np.ndarray | None,
             device: torch.device) -> tuple[Refresh | None, ...] | None:
        """Each of `layers`' gather of its row of `pages` ((layers, n) ids, the decode group's layout) kept up
        to date (None: gathered whole: too small to pay, or past the budget); None if no layer is kept.
        `valid`: (n,) False where a position is padding (masked); None = all are read."""
        n = pages.shape[1]
        if n * self._page_bytes < self._from:
            return None
        plans = [self._stale(layer, row, valid) for layer, row in zip(layers, pages, strict=True)]
        if all(p is None for p in plans):
            return None
        sizes = [len(p[2]) for p in plans if p is not None]
        # NOTE: one host-to-device copy for the kind's layers: (positions | pages, each layer's to copy)
        sent = to_device(np.concatenate([np.stack(p[1:]) for p in plans if p is not None], axis=1), device)
        parts = iter(sent.split(sizes, dim=1))
        refreshes: list[Refresh | None] = []
        for plan in plans:
            if plan is None:
                refreshes.append(None)
                continue
            kept, _, copy = plan
            part = next(parts)
            whole = len(copy) == n  # NOTE: then every position, in order: straight into the workspace
            refreshes.append(Refresh(kept.keys[:n], kept.values[:n], None if whole else part[0], part[1]))
        return tuple(refreshes)

    def _stale(self, layer: int, pages: np.ndarray, valid: np.ndarray | None) -> tuple[_Kept, np.ndarray,
                                                                                       np.ndarray] | None:
        """(layer's workspace, (m,) positions to copy, (m,) their pages) for the gather of `pages` (n,): all
        n in order when more than half are stale; None past the budget. The workspace records the new layout
        as refreshed at this step."""
        n = pages.shape[0]
        kept = self._kept.get(layer)
        if kept is None or kept.capacity < n:
            kept = self._grow(layer, n)
            if kept is None:
                return None
        old = kept.pages if kept.pages is not None else pages[:0]
        common = min(len(old), n)
        changed = np.ones(n, dtype=bool)  # NOTE: past the old layout, a position holds nothing we know of
        changed[:common] = (pages[:common] != old[:common]) | (self._written[pages[:common]] > kept.step)
        stale = np.flatnonzero(changed if valid is None else changed & valid)
        if 2 * len(stale) > n:
            stale = np.arange(n)  # NOTE: padding too (finite pages): one copy, no index arithmetic
        kept.pages, kept.step = pages.copy(), self._step
        if valid is not None and len(stale) < n:
            # NOTE: a padding position left as it was holds no page as of this step: recorded as none, so that
            # the step where it is read again (a new layout) copies it, whatever page it then holds
            kept.pages[~valid] = NO_PAGE
        self.positions += n
        self.copied += len(stale)
        return kept, stale, pages[stale]

    def forget(self) -> None:
        """Drop every layout: the next plans copy everything. NOTE: after a failed forward, whose refreshes
        may not all have run."""
        for kept in self._kept.values():
            kept.pages = None

    @property
    def nbytes(self) -> int:
        """The kept workspaces' bytes."""
        return sum(k.capacity for k in self._kept.values()) * self._page_bytes

    def _grow(self, layer: int, n: int) -> _Kept | None:
        """A zeroed workspace of at least `n` pages for `layer` (NOTE: up to a quarter more, so that growing
        sequences do not reallocate at every new block), or None past the budget."""
        self._kept.pop(layer, None)
        room = (self._budget - self.nbytes) // self._page_bytes  # pages
        capacity = min(n + n // 4, room)
        if capacity < n:
            return None
        shape = (capacity, *self._kv.keys.shape[1:])
        kept = _Kept(self._kv.keys.new_zeros(shape), self._kv.values.new_zeros(shape), capacity)
        self._kept[layer] = kept
        return kept


@dataclass
class _Kept:
    """One layer's workspace and what it holds."""

    keys: torch.Tensor  # (capacity, block_size, kv_heads, head_dim)
    values: torch.Tensor  # the same for values
    capacity: int  # pages
    pages: np.ndarray | None = None  # (n,) the layout the first n positions hold; None = nothing known
    step: int = 0  # the step whose writes they include
