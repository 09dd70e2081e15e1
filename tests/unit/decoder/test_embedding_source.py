"""The encoder calls a request's missing items go in: runs that each fit the encoder cache, in order."""

from __future__ import annotations

from mmserve.decoder.embedding_source import parts
from mmserve.messages import MultiModalFeatureSpec, PlaceholderRange


def features(*rows: int) -> list[MultiModalFeatureSpec]:
    return [MultiModalFeatureSpec(f"img{i}", "image", PlaceholderRange(100 * i, n), n) for i, n in enumerate(rows)]


def test_items_go_in_runs_that_fit_the_rows_in_order() -> None:
    f = features(16, 16, 48, 8, 8, 16)
    assert parts([0, 1, 2, 3, 4, 5], f, 32) == [[0, 1], [2], [3, 4, 5]]  # 48 > 32 goes alone (the encoder refuses it)
    assert parts([1, 3, 5], f, 32) == [[1, 3], [5]]  # only the missing ones, in their order
    assert parts([0, 1, 2], f, None) == [[0, 1, 2]]  # no bound: one call
    assert parts([], f, 32) == [] and parts([], f, None) == []
