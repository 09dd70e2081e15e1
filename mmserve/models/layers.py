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
        # NOTE: the form is chosen here, once: a call is a few small kernels, and its own Python counts
        self._norm = self._form(gain.device.type == "cpu", gain.dim() == 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32:
            return self._norm(x)
        return self._norm(x.float()).to(x.dtype)

    def _form(self, on_cpu: bool, one_gain: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        """The float32 norm: on a CPU LayerNorm over [x, -x] (NOTE above), else F.rms_norm."""
        d, doubled, gain, eps = self.d, (2 * self.d,), self.gain, self.eps
        if on_cpu and one_gain:
            weight = torch.cat((gain, gain), dim=-1)  # the LayerNorm form's weight: the gain on both halves
            return lambda x: torch.layer_norm(torch.cat((x, x.neg()), dim=-1), doubled, weight, None, eps)[..., :d]
        if on_cpu:  # per-head gains: LayerNorm's weight is 1-D, so the gain follows
            return lambda x: torch.layer_norm(torch.cat((x, x.neg()), dim=-1), doubled, None, None, eps)[..., :d] * gain
        if one_gain:
            return lambda x: F.rms_norm(x, (d,), gain, eps)
        return lambda x: F.rms_norm(x, (d,), None, eps) * gain


class RopeTable:
    """cos and sin of every position up to the longest seen, one rotary kind; grows by doubling, never past
    `limit` positions (the model's longest context) unless a position asks for more.

    `rotate` applies RoPE as x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] written as
    a roll of x by half the dims times sin with its first half negated (the same products and roundings
    as transformers', in x's dtype). The values come from the model's own rotary module, exactly.
    """

    def __init__(self, compute: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], head_dim: int,
                 device: torch.device, dtype: torch.dtype, limit: int | None = None) -> None:
        self._compute = compute  # (n,) int64 positions -> ((n, head_dim) cos, (n, head_dim) sin)
        self.head_dim, self.device, self.dtype = head_dim, device, dtype
        # NOTE: a doubling past the longest context would hold up to twice its table for good (gemma-3-4b in
        # bf16: 1 KiB a position, per rotary kind)
        self.limit = limit  # positions (None = no bound)
        self._table = torch.empty(0, 2, head_dim, device=device, dtype=dtype)  # (positions, cos|sin, head_dim)
        half = head_dim // 2
        self._sign = torch.cat((-torch.ones(half), torch.ones(head_dim - half))).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """((T, 1, head_dim) cos, (T, 1, head_dim) signed sin) at `positions` (all <= max_position)."""
        if max_position >= self._table.shape[0]:
            n = max(2 * self._table.shape[0], 256)
            n = max(max_position + 1, n if self.limit is None else min(n, self.limit))
            cos, sin = self._compute(torch.arange(n, device=self.device))
            self._table = torch.stack((cos.to(self.dtype), (sin * self._sign).to(self.dtype)), dim=1)
        both = self._table.index_select(0, positions)  # (T, 2, head_dim)
        return both[:, :1], both[:, 1:]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(T, heads, head_dim) -> the same, rotated."""
        # NOTE: not addcmul, which rounds once where transformers rounds twice (visible in bfloat16)
        return x * cos + torch.roll(x, self.head_dim // 2, dims=-1) * sin
