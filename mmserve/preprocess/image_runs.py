"""Runs of image tokens in a prompt: each maximal run is one image or one pan-and-scan crop.

Owns: finding the runs, as ranges (the preprocessor's placeholders, the scheduler's chunk cuts) or as
a run id per position (the decoder's attention masks). Does not own what a run means to a model
(its `AttentionPattern` says whether a run's tokens attend to each other both ways).
"""

from __future__ import annotations

import numpy as np


def image_token_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `token_id` in `ids`, in order."""
    mask = np.asarray(ids) == token_id  # (T,)
    edges = np.diff(np.concatenate(([False], mask, [False])).astype(np.int8))  # (T + 1,)
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def image_run_ids(token_ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """Id of the run each position is in (0, 1, ...), -1 for other tokens; (T,) int64."""
    is_image = token_ids == image_token_id
    starts = is_image & ~np.concatenate(([False], is_image[:-1]))
    return np.where(is_image, np.cumsum(starts) - 1, -1)
