"""The KV cache tensors: pages of keys and values, shared by every decoder layer.

Owns: the memory. A page holds one layer's keys (and, in the other tensor, values) of `block_size`
positions; a cache row is `page * block_size + offset`. Which pages a sequence holds on which layer
is `kv_blocks.py`'s business; which rows a step reads is attention's. The pool holds
`num_blocks * num_layers` pages: the memory of `num_blocks` blocks on every layer, which the layer
kinds share (a sliding layer keeps only its window).
"""

from __future__ import annotations

import torch

from mmserve.config import DecoderConfig
from mmserve.models.base import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, config: DecoderConfig, *, dtype: torch.dtype, device: torch.device):
        self.block_size = config.block_size
        self.num_pages = config.num_blocks * spec.num_layers
        shape = (self.num_pages, self.block_size, spec.num_kv_heads, spec.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (pages, block_size, kv_heads, head_dim)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        rows = (self.num_pages * self.block_size, spec.num_kv_heads, spec.head_dim)
        self.key_rows, self.value_rows = self.keys.view(rows), self.values.view(rows)  # (rows, kv_heads, head_dim)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))
