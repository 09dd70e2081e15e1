"""Shared pytest fixtures: tiny random-weight Gemma 3 checkpoints built offline once per session.

Owns: the session-scoped `tiny_ckpt` (896 px / patch 14 / 256 image tokens, the real model's data
shapes), `tiny_ckpt_224` (224 px / patch 14 / 16 tokens) and `tiny_ckpt_gqa` (the parity suite's third:
GQA, its own attention scale, an odd window, wide heads, Google's config keys) folders, built into pytest
temp dirs, never into the user cache. Does not own: how the checkpoints are made (mmserve.models.tiny_checkpoint).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# NOTE: set before anything imports transformers / huggingface_hub, which read these at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray in tests: no usage stats,
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token file written under $HOME


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmserve.models.tiny_checkpoint import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_896"))


@pytest.fixture(scope="session")
def tiny_ckpt_gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A third parity checkpoint for what the other two leave alike: query heads sharing each of several KV
    heads, an attention scale that is not head_dim's, a sliding window that is no multiple of a block, heads
    wider than hidden / heads (as gemma-3-4b's 8 x 256 against 2,560), and a config.json in the older keys of
    Google's releases, which transformers converts as it reads (`rope_scaling`, `sliding_window_pattern`)."""
    from mmserve.models.tiny_checkpoint import build_tiny_gemma3

    return build_tiny_gemma3(
        tmp_path_factory.mktemp("tiny_gemma3_gqa"), image_size=224, patch_size=14, mm_tokens=16, text_heads=4,
        kv_heads=2, head_dim=24, query_pre_attn_scalar=48, sliding_window=50, seed=1, google_format=True,
    )


@pytest.fixture(scope="session")
def tiny_ckpt_224(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmserve.models.tiny_checkpoint import build_tiny_gemma3

    return build_tiny_gemma3(
        tmp_path_factory.mktemp("tiny_gemma3_224"), image_size=224, patch_size=14, mm_tokens=16
    )
