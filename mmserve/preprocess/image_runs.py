"""Runs of image tokens in a prompt: each maximal run is one image or one pan-and-scan crop.

Owns: finding the runs as ranges (the preprocessor's placeholders). The decoder finds its runs inside the
features' placeholders instead (`mmserve/decoder/sequence.py: PromptImages`). Does not own what a run means to a model
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
