"""Small building blocks of decoder layers, written for few kernel launches per step.

Owns: an RMSNorm computed in float32 as Gemma's is, and a table of rotary cos/sin by position.
Does not own any model's wiring (the model modules) nor attention (mmserve/decoder/attention.py).

NOTE: a decode step is a long chain of small kernels, so each launch counts (the engine's fixed cost
per step, docs/benchmarks.md). torch 2.13 has no fused RMSNorm on the CPU (`F.rms_norm` runs several
kernels there) but a fused LayerNorm: over `[x, -x]`, whose mean is 0, LayerNorm's variance is
mean(x^2), so its output's first half is x / sqrt(mean(x^2) + eps), RMSNorm itself (to float32
rounding). Other devices use `F.rms_norm`, fused there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class RMSNorm:
    """x / sqrt(mean(x^2) + eps) * gain over the last dim, computed in float32, returned in x's dtype."""

    def __init__(self, gain: torch.Tensor, eps: float) -> None:
        self.gain, self.eps = gain.float(), eps  # (..., d): broadcast over the trailing dims of x
        self.d = gain.shape[-1]
        # the LayerNorm form's weight (NOTE above); per-head gains are applied after it instead
        self.doubled = torch.cat((self.gain, self.gain), dim=-1) if gain.dim() == 1 else None
        self.on_cpu = gain.device.type == "cpu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x if x.dtype == torch.float32 else x.float()
        if self.on_cpu and self.gain.dim() == 1:
            out = torch.layer_norm(torch.cat((x32, -x32), dim=-1), (2 * self.d,), self.doubled, None,
                                   self.eps)[..., : self.d]
        elif self.on_cpu:  # per-head gains: LayerNorm's weight is 1-D, so the gain follows
            out = torch.layer_norm(torch.cat((x32, -x32), dim=-1), (2 * self.d,), None, None,
                                   self.eps)[..., : self.d] * self.gain
        elif self.gain.dim() == 1:
            out = F.rms_norm(x32, (self.d,), self.gain, self.eps)
        else:
            out = F.rms_norm(x32, (self.d,), None, self.eps) * self.gain
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class RopeTable:
    """cos and sin of every position up to the longest seen, one rotary kind; grows by doubling.

    `rotate` applies RoPE as x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] written as
    a roll of x by half the dims times sin with its first half negated (the same products and roundings
    as transformers', in x's dtype). The values come from the model's own rotary module, exactly.
    """

    def __init__(self, compute: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self._compute = compute  # (n,) int64 positions -> ((n, head_dim) cos, (n, head_dim) sin)
        self.head_dim, self.device, self.dtype = head_dim, device, dtype
        self._table = torch.empty(0, 2, head_dim, device=device, dtype=dtype)  # (positions, cos|sin, head_dim)
        half = head_dim // 2
        self._sign = torch.cat((-torch.ones(half), torch.ones(head_dim - half))).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """((T, 1, head_dim) cos, (T, 1, head_dim) signed sin) at `positions` (all <= max_position)."""
        if max_position >= self._table.shape[0]:
            n = max(max_position + 1, 2 * self._table.shape[0], 256)
            cos, sin = self._compute(torch.arange(n, device=self.device))
            self._table = torch.stack((cos.to(self.dtype), (sin * self._sign).to(self.dtype)), dim=1)
        both = self._table.index_select(0, positions)  # (T, 2, head_dim)
        return both[:, :1], both[:, 1:]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(T, heads, head_dim) -> the same, rotated."""
        # NOTE: not addcmul, which rounds once where transformers rounds twice (visible in bfloat16)
        return x * cos + torch.roll(x, self.head_dim // 2, dims=-1) * sin
