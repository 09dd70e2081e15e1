"""Embeddings on the way between processes: numpy out, the same tensor back, for every stage dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.runtime.embeddings_wire import from_wire, to_wire


def _read_only(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """As the object store hands them out."""
    for a in arrays:
        a.setflags(write=False)
    return arrays


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_exact_and_writable(dtype):
    embeddings = [torch.randn(256, 40).to(dtype), torch.randn(512, 40).to(dtype)]  # (num_embeds, hidden)
    arrays, name = to_wire(embeddings)
    back = from_wire(_read_only(arrays), name)
    assert name == str(dtype).removeprefix("torch.")
    for sent, got in zip(embeddings, back, strict=True):
        assert got.dtype == dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
        got.add_(1)  # a writable copy of its own
    assert all(a.ctypes.data != t.data_ptr() for a, t in zip(arrays, back, strict=True))  # copies, not views


def test_bfloat16_travels_in_half_the_bytes_of_float32():
    embeddings = [torch.randn(256, 64, dtype=torch.bfloat16)]
    arrays, _ = to_wire(embeddings)
    assert arrays[0].nbytes == 256 * 64 * 2
    assert arrays[0].nbytes * 2 == to_wire([embeddings[0].float()])[0][0].nbytes


def test_mixed_dtypes_are_refused_and_no_embeddings_is_fine():
    with pytest.raises(ValueError, match="share a dtype"):
        to_wire([torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bfloat16)])
    assert to_wire([]) == ([], "float32")
    assert from_wire([], "bfloat16") == []
