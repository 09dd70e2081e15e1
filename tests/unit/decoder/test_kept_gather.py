"""KeptGathers: a decode group's gather kept from step to step equals a whole one at every step, whatever
changed between them, copying only what changed; and it keeps only what pays, within its budget."""

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
CPU = torch.device("cpu")


def _cache() -> KVCache:
    kv = KVCache(SPEC, DecoderConfig(block_size=BLOCK, num_blocks=32), dtype=torch.float32, device=CPU)
    kv.keys.copy_(torch.randn(kv.keys.shape))
    kv.values.copy_(torch.randn(kv.values.shape))
    return kv


def _write(kv: KVCache, kept: KeptGathers, pages: np.ndarray, rng: np.random.Generator) -> None:
    """A step's forward writing one new row into each of `pages`, announced first as the metadata does."""
    kept.wrote(pages)
    for page in pages.tolist():
        kv.keys[page, int(rng.integers(BLOCK))] = torch.randn(kv.keys.shape[2:])
        kv.values[page, int(rng.integers(BLOCK))] = torch.randn(kv.values.shape[2:])


def _gathered(kv: KVCache, kept: KeptGathers, layout: np.ndarray, valid: np.ndarray | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Layer 0's kept gather of `layout`, brought up to date -> (keys, values, positions copied)."""
    before = kept.copied
    plans = kept.plan((0,), layout[None], valid, CPU)
    assert plans is not None and plans[0] is not None
    keys, values = plans[0].apply(kv)
    return keys, values, kept.copied - before


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
        if step % 11 == 5:  # a new layout, one page longer
            layout = np.concatenate([layout, rng.choice(kv.num_pages, size=1)])
        if step % 13 == 6 and len(layout) > 12:  # and two shorter
            layout = layout[:-2]
        _write(kv, kept, rng.choice(layout, size=3, replace=False), rng)
        if step % 5 == 0:  # pages outside the group written too (another group, another layer)
            _write(kv, kept, rng.choice(kv.num_pages, size=2), rng)
        keys, values, n = _gathered(kv, kept, layout)
        copied.append(n)
        index = torch.from_numpy(layout)
        assert torch.equal(keys, kv.keys[index]) and torch.equal(values, kv.values[index]), step
    assert min(copied) <= 5 < len(layout) <= max(copied)  # most steps copy only what changed
    assert kept.positions > 2 * kept.copied


def test_padding_is_never_copied_and_a_longer_layout_copies_only_its_new_pages() -> None:
    rng = np.random.default_rng(1)
    kv = _cache()
    kept = KeptGathers(kv, budget_bytes=1 << 30, from_bytes=0)
    layout = np.array([3, 4, 5, 9, 9, 9])  # a second sequence of one page, padded with it
    valid = np.array([True, True, True, True, False, False])
    _write(kv, kept, np.array([5, 9]), rng)
    keys, _, _ = _gathered(kv, kept, layout, valid)
    for _ in range(3):
        _write(kv, kept, np.array([5, 9]), rng)  # both sequences write their last page every step
        keys, _, n = _gathered(kv, kept, layout, valid)
        assert n == 2  # pages 5 and 9 once: the padding that repeats page 9 is not copied
        assert torch.equal(keys[valid], kv.keys[torch.from_numpy(layout[valid])])
    _write(kv, kept, np.array([12]), rng)  # a lone sequence gains a block
    keys, _, n = _gathered(kv, kept, np.array([3, 4, 5, 12]))
    assert n == 1 and torch.equal(keys, kv.keys[[3, 4, 5, 12]])


def test_a_padding_position_read_again_with_the_page_it_was_padded_with_is_copied() -> None:
    """A sequence's padding repeats its last page, which a later layout can hold at that very position as a real
    page (the group reordered), after its last write: the padding was never copied, so it must be now."""
    rng = np.random.default_rng(3)
    kv = _cache()
    kept = KeptGathers(kv, budget_bytes=1 << 30, from_bytes=0)
    _write(kv, kept, np.array([7, 9]), rng)
    _gathered(kv, kept, np.array([5, 6, 7, 8, 9, 9]), np.array([True, True, True, True, True, False]))
    _write(kv, kept, np.array([7, 9]), rng)  # page 9 changes; position 5 (padding) is not copied
    _gathered(kv, kept, np.array([5, 6, 7, 8, 9, 9]), np.array([True, True, True, True, True, False]))
    _write(kv, kept, np.array([11]), rng)  # the next step writes elsewhere; page 9 now sits at position 5
    layout = np.array([5, 6, 7, 8, 10, 9])
    keys, values, _ = _gathered(kv, kept, layout)
    assert torch.equal(keys, kv.keys[torch.from_numpy(layout)])
    assert torch.equal(values, kv.values[torch.from_numpy(layout)])


def test_after_a_failed_forward_everything_is_copied_again() -> None:
    rng = np.random.default_rng(2)
    kv = _cache()
    kept = KeptGathers(kv, budget_bytes=1 << 30, from_bytes=0)
    layout = np.arange(8)
    _write(kv, kept, layout[:1], rng)
    _gathered(kv, kept, layout)
    _write(kv, kept, layout[1:2], rng)
    kept.plan((0,), layout[None], None, CPU)  # planned, never applied: the forward failed before this layer
    kept.forget()
    _write(kv, kept, layout[2:3], rng)
    keys, _, n = _gathered(kv, kept, layout)
    assert n == len(layout) and torch.equal(keys, kv.keys[torch.from_numpy(layout)])


def test_small_gathers_and_gathers_past_the_budget_are_not_kept() -> None:
    kv = _cache()
    page = 2 * kv.keys[0].numel() * kv.keys.element_size()  # a page's keys and values (bytes)
    kept = KeptGathers(kv, budget_bytes=10 * page, from_bytes=4 * page)
    kept.wrote(np.arange(1))
    assert kept.plan((0,), np.arange(3)[None], None, CPU) is None  # below from_bytes: gathered whole
    assert kept.plan((0,), np.arange(4)[None], None, CPU) is not None  # kept, in 5 pages (a quarter more)
    assert kept.plan((1,), np.arange(8)[None], None, CPU) is None  # 8 more pages would pass the budget
    plans = kept.plan((1, 2), np.stack([np.arange(5), np.arange(5, 10)]), None, CPU)  # room for one more layer
    assert plans is not None and plans[0] is not None and plans[1] is None and kept.nbytes == 10 * page
