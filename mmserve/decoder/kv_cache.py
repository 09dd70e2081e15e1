"""The KV cache tensors: one key and one value tensor per decoder layer, addressed by slot.

Owns: the memory. A slot is `block_id * block_size + offset`; which blocks a sequence holds is the
BlockPool's and the scheduler's business, not this module's. Does not own: attention math.
"""

from __future__ import annotations

import torch

from mmserve.config import DecoderConfig
from mmserve.models.base import ModelSpec


class KVCache:
    def __init__(self, spec: ModelSpec, config: DecoderConfig, *, dtype: torch.dtype, device: torch.device):
        self.block_size = config.block_size
        self.num_slots = config.num_blocks * config.block_size
        shape = (self.num_slots, spec.num_kv_heads, spec.head_dim)
        # NOTE: sliding-window layers keep every position too; freeing blocks that fell out of the
        # window is a later optimisation (it needs per-layer-kind block tables).
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer, each (num_slots, kv_heads, head_dim)."""
        return self.keys[index], self.values[index]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
