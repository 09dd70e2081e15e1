"""Tolerances for tests that compare two float computations of the same value.

Owns: the rule for "equal to float precision" when the two sides ran different kernels: a batch of
2 against 1, another thread count, another CPU's SIMD width or FMA use. Matmul and reduction kernels
then add the same terms in another order, fused element-wise kernels round once where others round
twice, and each result may move by a few units in the last place (ulps) of the values involved.
Does not own exact comparisons (token ids, copies, cache hits: those stay `==`) nor the parity
tolerance against transformers (tests/unit/test_parity.py).

NOTE: the tolerance is absolute and scales with the largest magnitude in the expected tensor, not
with each element: an element that is small because large terms cancelled (a linear layer's output
near 0) carries the rounding of those large terms, which is of the order of the largest outputs.
A relative tolerance per element fails such elements on one CPU and passes them on another.
"""

from __future__ import annotations

import numpy as np
import torch


def ulps_atol(expected: torch.Tensor, ulps: float) -> float:
    """`ulps` units in the last place of the largest |value| of `expected`, in its own dtype."""
    eps = torch.finfo(expected.dtype).eps
    return ulps * eps * float(expected.abs().max()) if expected.numel() else 0.0


def assert_close_ulps(actual: torch.Tensor | np.ndarray, expected: torch.Tensor | np.ndarray, ulps: float) -> None:
    """`actual` equals `expected` within `ulps` ulps of the expected tensor's largest magnitude.

    `ulps` is the caller's bound for its computation: about one per rounding or short reordered sum,
    more where rounding compounds through layers. Each call site says why it chose its number.
    """
    a, e = torch.as_tensor(actual), torch.as_tensor(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
    torch.testing.assert_close(a, e, atol=ulps_atol(e, ulps), rtol=0)
