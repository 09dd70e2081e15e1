"""The decoder's rotary table (mmserve/models/layers.py): it grows by doubling as longer positions come, never past
the model's longest context unless a position asks for more, and each row is what the rotary module computes."""

from __future__ import annotations

import torch

from mmserve.models.layers import RopeTable

HEAD_DIM = 8


def compute(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in rotary: (n, HEAD_DIM) cos and sin of position / (1 + column)."""
    angles = positions[:, None].float() / torch.arange(1, HEAD_DIM + 1).float()
    return angles.cos(), angles.sin()


def rows(table: RopeTable) -> int:
    return int(table._table.shape[0])


def test_the_table_doubles_up_to_its_limit_and_past_it_only_as_far_as_asked() -> None:
    table = RopeTable(compute, HEAD_DIM, torch.device("cpu"), torch.float32, limit=300)
    table.lookup(torch.tensor([10]), 10)
    assert rows(table) == 256
    table.lookup(torch.tensor([270]), 270)
    assert rows(table) == 300  # doubling would hold 512
    table.lookup(torch.tensor([400]), 400)
    assert rows(table) == 401  # a position past the limit (a caller's own bound) still gets its row
    unbounded = RopeTable(compute, HEAD_DIM, torch.device("cpu"), torch.float32)
    unbounded.lookup(torch.tensor([10]), 10)
    unbounded.lookup(torch.tensor([270]), 270)
    assert rows(unbounded) == 512


def test_each_row_is_the_rotary_modules_own() -> None:
    table = RopeTable(compute, HEAD_DIM, torch.device("cpu"), torch.float32, limit=300)
    positions = torch.tensor([0, 7, 299])
    cos, signed_sin = table.lookup(positions, 299)  # (3, 1, HEAD_DIM) each
    want_cos, want_sin = compute(positions)
    half = HEAD_DIM // 2
    assert torch.equal(cos[:, 0], want_cos)
    assert torch.equal(signed_sin[:, 0, :half], -want_sin[:, :half])  # rotate_half's sign on the first half
    assert torch.equal(signed_sin[:, 0, half:], want_sin[:, half:])
