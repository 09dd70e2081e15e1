"""The KV cache tensors: pages of keys and values, shared by every decoder layer.

Owns: the memory. A page holds one layer's keys (and, in the other tensor, values) of `block_size`
positions; a cache row is `page * block_size + offset`. Which pages a sequence holds on which layer
is `kv_blocks.py`'s business; which rows a step reads is attention's. The pool holds
`num_blocks * num_layers` pages: the memory of `num_blocks` blocks on every layer, which the layer
kinds share (a sliding layer keeps only its window). Also owns the workspace that attention gathers a
group's pages into (`gather`).

NOTE: the workspace is kept and reused, not allocated per layer and step. A gather above glibc's mmap
threshold (32 MiB at most: a batch of long decodes reaches it) is otherwise mapped afresh each time, and
each of its 4 KiB pages faults on first write, every layer and step (docs/benchmarks.md has the cost).
It does not shrink. On a CPU it grows by doubling (fewer fresh mappings while a batch grows); elsewhere by a
quarter, since device memory is what the KV pool is sized against (a batch of long decodes gathers gigabytes:
doubling could hold twice that), yet each growth is a fresh allocation the caching allocator cannot serve from
the smaller blocks it freed, so growing to each new largest gather exactly would fragment it step after step.
"""

from __future__ import annotations

import logging
import math

import torch

from mmserve.config import DecoderConfig
from mmserve.models.base import ModelSpec

log = logging.getLogger(__name__)
GiB = 1 << 30
ROOM = 0.1  # the share of an accelerator's free memory a pool should leave for a step's activations and gathers


class KVCache:
    def __init__(self, spec: ModelSpec, config: DecoderConfig, *, dtype: torch.dtype, device: torch.device):
        self.block_size = config.block_size
        self.num_pages = config.num_blocks * spec.num_layers
        shape = (self.num_pages, self.block_size, spec.num_kv_heads, spec.head_dim)
        check_pool_fits(2 * math.prod(shape) * dtype.itemsize, config.num_blocks, device)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (pages, block_size, kv_heads, head_dim)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        rows = (self.num_pages * self.block_size, spec.num_kv_heads, spec.head_dim)
        self.key_rows, self.value_rows = self.keys.view(rows), self.values.view(rows)  # (rows, kv_heads, head_dim)
        self._workspace = torch.empty((2, 0, *shape[1:]), dtype=dtype, device=device)  # (K|V, pages, ...)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # n -> the workspace's first n pages, K and V

    def gather(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n,) page ids -> ((n, block_size, kv_heads, head_dim) keys, the same for values): copies in the
        workspace, valid until the next `gather`."""
        n = pages.shape[0]
        views = self._views.get(n)
        if views is None:  # NOTE: kept: on a small model, slicing them anew each layer cost more than the copy
            if n > self._workspace.shape[1]:
                held = self._workspace.shape[1]
                grown = max(n, 2 * held if self.keys.device.type == "cpu" else held + held // 4)
                self._views.clear()  # NOTE: the old workspace let go first, so that both are not held at once
                self._workspace = self.keys.new_empty((2, 0, *self.keys.shape[1:]))
                self._workspace = self.keys.new_empty((2, grown, *self.keys.shape[1:]))
            views = self._views[n] = (self._workspace[0, :n], self._workspace[1, :n])
        keys = torch.index_select(self.keys, 0, pages, out=views[0])
        values = torch.index_select(self.values, 0, pages, out=views[1])
        return keys, values

    @property
    def nbytes(self) -> int:
        """The pages' bytes (the workspace, sized by the largest gather, is not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


def check_pool_fits(pool_bytes: int, num_blocks: int, device: torch.device) -> None:
    """On an accelerator, before the pool is allocated: refuse one its free memory cannot hold (torch's own error
    would name no setting), and warn of one that leaves it less than ROOM, naming `decoder.num_blocks` and the most
    blocks that would leave that room. NOTE: `num_blocks` is set, not sized from the device as vLLM's pool is."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    # NOTE: what torch's allocator holds unused (transformers' layers dropped after the load, a warm-up's activations)
    # the device counts as used, yet an allocation gets it back
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    fit = int(num_blocks * free * (1 - ROOM) / pool_bytes)
    need = f"decoder.num_blocks={num_blocks} makes a KV cache of {pool_bytes / GiB:.1f} GiB; {device} has " \
           f"{free / GiB:.1f} GiB free now (the weights loaded; another stage on it may take more later)"
    if pool_bytes > free:
        raise ValueError(f"{need}: set decoder.num_blocks to at most {fit} (or use a device with more memory)")
    if pool_bytes > free * (1 - ROOM):
        log.warning("%s, leaving %.1f GiB for the steps' activations; %d blocks would leave %.0f%%", need,
                    (free - pool_bytes) / GiB, fit, 100 * ROOM)
