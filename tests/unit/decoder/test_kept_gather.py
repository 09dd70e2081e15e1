"""KeptGathers: a decode group's gather kept from step to step equals a whole gather at every step, whatever
changed between them; and it keeps only what pays, within its budget."""

from __future__ import annotations

import numpy as np
import torch

from mmserve.config import DecoderConfig
from mmserve.decoder.kept_gather import KeptGathers
from mmserve.decoder.kv_cache import KVCache
from mmserve.models.base import FULL, AttentionPattern, ModelSpec

PATTERN = AttentionPattern(layer_kinds=(FULL, FULL), sliding_window=None, bidirectional_images=False, scaling=0.5,
                           softcap=None)
SPEC = ModelSpec("gemma3", "m", 9, 4, 50, 16, 2, 2, 4, 1024, (1,), PATTERN)
BLOCK = 4


def _cache() -> KVCache:
    kv = KVCache(SPEC, DecoderConfig(block_size=BLOCK, num_blocks=32), dtype=torch.float32, device=torch.device("cpu"))
    kv.keys.copy_(torch.randn(kv.keys.shape))
    kv.values.copy_(torch.randn(kv.values.shape))
    return kv


def _write(kv: KVCache, kept: KeptGathers, pages: np.ndarray) -> None:
    """A step's forward writing one new row into each of `pages`, announced first as the metadata does."""
    kept.wrote(pages)
    for page in pages.tolist():
        kv.keys[page, np.random.randint(BLOCK)] = torch.randn(kv.keys.shape[2:])
        kv.values[page, np.random.randint(BLOCK)] = torch.randn(kv.values.shape[2:])


def _assert_whole(kv: KVCache, kept: KeptGathers, layer: int, pages: np.ndarray) -> None:
    refresh = kept.plan(layer, pages)
    assert refresh is not None
    keys, values = refresh.apply(kv)
    index = torch.from_numpy(pages)
    assert torch.equal(keys, kv.keys[index]) and torch.equal(values, kv.values[index])


def test_a_kept_gather_equals_a_whole_one_through_writes_moves_and_new_layouts() -> None:
    rng = np.random.default_rng(0)
    kv = _cache()
    kept = KeptGathers(kv, budget_bytes=1 << 30, from_bytes=0)
    layout = rng.choice(kv.num_pages, size=12, replace=False)  # 3 sequences x 4 blocks, side by side
    copied = []
    for step in range(60):
        if step % 7 == 3:  # a sequence leaves and another takes its place: its pages change
            layout = layout.copy()
            layout[4:8] = rng.choice(kv.num_pages, size=4, replace=False)
        if step % 11 == 5:  # one block more for every sequence: a new layout
            layout = np.concatenate([layout, rng.choice(kv.num_pages, size=3, replace=False)])
        _write(kv, kept, rng.choice(layout, size=3, replace=False))
        if step % 5 == 0:  # pages outside the group written too (another group, another layer)
            _write(kv, kept, rng.choice(kv.num_pages, size=2))
        refresh = kept.plan(0, layout)
        assert refresh is not None
        copied.append(refresh.positions.shape[0])
        keys, values = refresh.apply(kv)
        index = torch.from_numpy(layout)
        assert torch.equal(keys, kv.keys[index]) and torch.equal(values, kv.values[index]), step
    assert min(copied) <= 5 < len(layout) <= max(copied)  # a step like the last copies only what changed


def test_after_a_failed_forward_everything_is_copied_again() -> None:
    kv = _cache()
    kept = KeptGathers(kv, budget_bytes=1 << 30, from_bytes=0)
    layout = np.arange(8)
    _write(kv, kept, layout[:1])
    _assert_whole(kv, kept, 0, layout)
    _write(kv, kept, layout[1:2])
    kept.plan(0, layout)  # planned, never applied: the forward failed before this layer
    kept.forget()
    kv.keys[5].add_(1.0)  # what the failed forward wrote before it raised is whatever it is
    _write(kv, kept, layout[2:3])
    refresh = kept.plan(0, layout)
    assert refresh is not None and refresh.positions.shape[0] == len(layout)
    keys, _ = refresh.apply(kv)
    assert torch.equal(keys, kv.keys[torch.from_numpy(layout)])


def test_small_gathers_and_gathers_past_the_budget_are_not_kept() -> None:
    kv = _cache()
    page = 2 * kv.keys[0].numel() * kv.keys.element_size()  # a page's keys and values (bytes)
    kept = KeptGathers(kv, budget_bytes=10 * page, from_bytes=4 * page)
    kept.wrote(np.arange(1))
    assert kept.plan(0, np.arange(3)) is None  # below from_bytes: gathered whole
    assert kept.plan(0, np.arange(4)) is not None  # kept, in 5 pages (a quarter more)
    assert kept.plan(1, np.arange(8)) is None  # 10 more pages would pass the budget
    assert kept.plan(1, np.arange(4)) is not None and kept.nbytes == 10 * page
