"""tests/numerics.py: the ulps tolerance accepts a reordered sum and refuses a real difference."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import assert_close_ulps, ulps_atol


def test_a_reordered_sum_with_cancellation_is_close() -> None:
    terms = torch.tensor([540.25, -538.5, 0.0001234, 3.0], dtype=torch.float32)
    forward = ((terms[0] + terms[1]) + terms[2]) + terms[3]
    backward = ((terms[3] + terms[2]) + terms[1]) + terms[0]
    assert forward != backward  # ~2.5 ulps of the small result, under 1 ulp of the large terms
    with pytest.raises(AssertionError):  # why the tolerance is not relative per element
        torch.testing.assert_close(backward, forward, rtol=torch.finfo(torch.float32).eps, atol=0)
    expected = torch.stack([forward, torch.tensor(540.25)])  # small result beside a large one
    assert_close_ulps(torch.stack([backward, torch.tensor(540.25)]), expected, ulps=1)


def test_a_real_difference_is_refused() -> None:
    expected = torch.linspace(-8.0, 8.0, 17)
    assert ulps_atol(expected, 4) == pytest.approx(4 * torch.finfo(torch.float32).eps * 8)
    with pytest.raises(AssertionError):
        assert_close_ulps(expected * (1 + 1e-5), expected, ulps=4)  # ~84 ulps
    with pytest.raises(AssertionError):
        assert_close_ulps(expected.double(), expected, ulps=4)  # the dtype is part of the claim
