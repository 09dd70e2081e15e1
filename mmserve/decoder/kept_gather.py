"""Gathers of a decode group's pages kept from step to step, so that a step copies only the pages that changed.

Owns: one workspace per layer holding the last gather of that layer's decode group (its sequences' pages
side by side, as `KVCache.gather` lays them out), the host's record of which pages each step writes, and
the plan of what a step must copy to bring a kept gather up to date (`Refresh`). Does not own which pages a
group reads (attention.py's metadata), the cache's tensors nor the shared workspace (kv_cache.py).

A decode step reads every page its sequences hold on a full-attention layer and writes one token. With no
paged attention kernel for the CPU in PyTorch the pages are gathered (copied) before attention, which at long
contexts costs as much as attention itself; yet from one step to the next only the page each sequence writes
changes. A kept gather is brought up to date by copying the positions whose page id differs from the last
step's layout, and those whose page was written since that layer's last refresh (which includes this step's
token: the forward writes a layer's K/V before it attends). A different layout (another batch, one more
block) refreshes every position.

NOTE: the plan is made on the host, from the metadata's page lists and slots, and sent as two small tensors
with the rest of the metadata: no device sync, the same path on every device. A gather below
`keep_gathers_from_bytes` is copied whole as before: there the extra calls cost more than the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmserve.decoder.kv_cache import KVCache


@dataclass(frozen=True)
class Refresh:
    """What one layer's kept gather copies this step, and the result."""

    keys: torch.Tensor  # (n, block_size, kv_heads, head_dim): the kept gather of keys, up to date once applied
    values: torch.Tensor  # the same for values
    positions: torch.Tensor  # (m,) positions in the gather to copy
    pages: torch.Tensor  # (m,) the page each of them holds now

    def apply(self, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the stale positions from the cache -> (keys, values) as `KVCache.gather` returns them."""
        if self.positions.shape[0]:
            self.keys.index_copy_(0, self.positions, kv.keys.index_select(0, self.pages))
            self.values.index_copy_(0, self.positions, kv.values.index_select(0, self.pages))
        return self.keys, self.values


class KeptGathers:
    """Per layer, the last decode group's gather, within `budget_bytes` of workspaces in all; gathers of at
    least `from_bytes` (keys and values together) are kept."""

    def __init__(self, kv: KVCache, *, budget_bytes: int, from_bytes: int) -> None:
        self._kv, self._budget, self._from = kv, budget_bytes, from_bytes
        self._page_bytes = 2 * kv.keys[0].numel() * kv.keys.element_size()  # a page's keys and values (bytes)
        self._written = np.zeros(kv.num_pages, dtype=np.int64)  # page -> the last step that wrote it
        self._step = 0  # steps noted so far
        self._kept: dict[int, _Kept] = {}  # layer -> its workspace and the layout it holds

    def wrote(self, pages: np.ndarray) -> None:
        """Start a step whose forward writes `pages` (any shape of page ids, every layer's)."""
        self._step += 1
        self._written[pages.ravel()] = self._step

    def plan(self, layer: int, pages: np.ndarray) -> Refresh | None:
        """`layer`'s gather of `pages` ((n,) ids, the decode group's layout) kept up to date; None: gather it whole
        (too small to pay, or past the budget)."""
        n = pages.shape[0]
        if n * self._page_bytes < self._from:
            return None
        kept = self._kept.get(layer)
        if kept is None or kept.capacity < n:
            kept = self._grow(layer, n)
            if kept is None:
                return None
        if kept.pages is None or kept.pages.shape != pages.shape:
            stale = np.arange(n)
        else:
            stale = np.flatnonzero((pages != kept.pages) | (self._written[pages] > kept.step))
        kept.pages, kept.step = pages.copy(), self._step
        device = self._kv.keys.device
        return Refresh(kept.keys[:n], kept.values[:n], torch.from_numpy(stale).to(device),
                       torch.from_numpy(pages[stale]).to(device))

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
        """A workspace of at least `n` pages for `layer` (NOTE: a quarter more, so that growing sequences do not
        reallocate at every new block), or None past the budget."""
        self._kept.pop(layer, None)
        capacity = n + n // 4
        if self.nbytes + capacity * self._page_bytes > self._budget:
            return None
        shape = (capacity, *self._kv.keys.shape[1:])
        kept = _Kept(self._kv.keys.new_empty(shape), self._kv.values.new_empty(shape), capacity)
        self._kept[layer] = kept
        return kept


@dataclass
class _Kept:
    keys: torch.Tensor  # (capacity, block_size, kv_heads, head_dim)
    values: torch.Tensor  # the same for values
    capacity: int  # pages
    pages: np.ndarray | None = None  # (n,) the layout the first n positions hold; None = nothing valid
    step: int = 0  # the step whose writes they include
