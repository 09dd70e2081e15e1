"""attention.py: a mixed step is attended per group (decodes of like contexts together, each prefill chunk
alone) over the pages each layer kind keeps, and equals attending each sequence alone over its dense context with its
causal / image / window mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmserve.config import DecoderConfig
from mmserve.decoder import attention
from mmserve.decoder.attention import SeqStep, build_metadata, paged_attention
from mmserve.decoder.block_pool import BlockPool
from mmserve.decoder.kv_blocks import KVBlockManager
from mmserve.decoder.kv_cache import KVCache
from mmserve.models.base import FULL, SLIDING, AttentionPattern, ModelSpec
from tests.device import TEST_DEVICE
from tests.numerics import assert_close_ulps

WINDOW, BLOCK = 5, 4
PATTERN = AttentionPattern(layer_kinds=(FULL, SLIDING), sliding_window=WINDOW, bidirectional_images=True,
                           scaling=0.5, softcap=None)
HEADS, KV_HEADS, DIM = 4, 2, 8
SPEC = ModelSpec("gemma3", "m", 9, 4, 50, 16, 2, KV_HEADS, DIM, 1024, (1,), PATTERN)


def runs_of(length: int, images: list[tuple[int, int]]) -> np.ndarray:
    runs = np.full(length, -1, dtype=np.int64)
    for i, (a, b) in enumerate(images):
        runs[a:b] = i
    return runs


# (start, new tokens, image runs of the prompt or None): a decode, a first chunk with an image run
# [1, 4), a decode far past the window, a later chunk of a prompt (its image is in the earlier part)
SEQS = [(6, 1, None), (0, 5, [(1, 4)]), (12, 1, None), (5, 4, [(1, 4)])]


def test_decodes_of_like_contexts_share_a_group_and_each_prefill_chunk_has_its_own() -> None:
    _, manager = _cache()
    steps = [_step(manager, start, n, None) for start, n in [(6, 1), (0, 5), (3, 1), (2, 4), (9, 1)]]
    meta = build_metadata(steps, manager.kinds, BLOCK, PATTERN, torch.device("cpu"), torch.float32)
    # decodes of 2, 1 and 3 blocks: those of 2 and 3 together (the longest group first), the 1-block one apart
    assert [(g.batch, g.queries) for g in meta.groups] == [(2, 1), (1, 1), (1, 5), (1, 4)]  # no decode padded
    first = meta.groups[0].token_index
    assert first is not None and first.tolist() == [0, 11]  # in step order within a group
    flat = torch.cat([g.token_index for g in meta.groups if g.token_index is not None]).sort().values
    assert flat.tolist() == list(range(1 + 5 + 1 + 4 + 1))  # every new token is a query exactly once
    assert len(meta.slots) == 2 and meta.slots[0].shape == (12,) and meta.max_position == 9
    sliding = meta.groups[0].reads[1]
    assert len(sliding.pages) == 1 and sliding.rows <= 3 * BLOCK  # the window's blocks, not all of them
    # masks are made once per step as SDPA adds them, in the attention's dtype: 0 may attend, -inf not
    half = build_metadata(steps, manager.kinds, BLOCK, PATTERN, torch.device("cpu"), torch.bfloat16)
    for group in half.groups:
        for read in group.reads:
            if read.mask is not None:
                assert read.mask.dtype == torch.bfloat16
                assert set(read.mask.unique().tolist()) <= {0.0, float("-inf")} and (read.mask == 0).any()
    decodes = half.groups[0].reads[0].mask  # (2, 1, 1, rows): each decode sees positions 0..its own
    assert decodes is not None and ((decodes == 0).sum(dim=-1).flatten().tolist() == [7, 10])


def test_a_long_decode_among_short_ones_pads_none_of_them_to_its_length() -> None:
    """A group reads B x its longest context's pages on a full layer: each decode's context is over half its
    group's longest, and the groups together read at most twice the pages the decodes hold."""
    _, manager = _cache()
    starts = [40, 3, 5, 2, 21, 7, 11, 0]  # one long context, several short ones, a middle one
    steps = [_step(manager, start, 1, None) for start in starts]
    meta = build_metadata(steps, manager.kinds, BLOCK, PATTERN, torch.device("cpu"), torch.float32)
    held = [-(-(start + 1) // BLOCK) for start in starts]  # a full layer's pages of each
    read, queried = 0, []
    for group in meta.groups:
        assert group.token_index is not None  # several groups: each names its rows
        queried += group.token_index.tolist()
        members = [held[i] for i in group.token_index.tolist()]
        assert 2 * min(members) > max(members)
        assert group.reads[0].rows == max(members) * BLOCK  # padded to its own longest only
        read += group.batch * max(members)
    assert read <= 2 * sum(held) and sorted(queried) == list(range(8))


@pytest.mark.parametrize("expanded", [False, True], ids=["enable_gqa", "repeated_heads"])
def test_grouped_attention_equals_each_sequence_alone(expanded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: `repeated_heads` is an accelerator's form of a masked GQA chunk (`expands_masked_gqa`), run here, and
    # so are an accelerator's masks: views whose rows start at multiples of 8 elements (`mask_alignment`)
    monkeypatch.setattr(attention, "expands_masked_gqa", lambda device: expanded)
    monkeypatch.setattr(attention, "mask_alignment", lambda device: 8 if expanded else 1)
    for out, expected in _grouped_against_alone(torch.device("cpu"), torch.float32):
        # NOTE: batched, padded and sliced against dense: other SDPA kernels sum the softmax and the
        # weighted values (<= 9 keys, O(1) values) in another order; a few roundings each, 32 ulps.
        assert_close_ulps(out, expected, ulps=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_grouped_attention_on_the_test_device_in_each_dtype(dtype: torch.dtype) -> None:
    """The served dtype's kernels (on a GPU: flash attention for unmasked chunks, the memory-efficient one with
    additive masks over strided pages) against the float32 dense reference on the CPU."""
    device = torch.device(TEST_DEVICE)
    # NOTE: bfloat16 keeps 8 significant bits: its inputs alone are off by 2^-9 relative, values O(1)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (4e-2, 2e-2)
    for out, expected in _grouped_against_alone(device, dtype):
        torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


def _grouped_against_alone(device: torch.device, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the batched step's output, the dense float32 reference on the CPU) of each sequence of SEQS and layer:
    their keys, values and queries drawn in float32 on the CPU, the step run on `device` in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    kv, manager = _cache(device, dtype)
    steps, history = [], []
    for start, n, images in SEQS:
        runs = runs_of(start + n, images) if images is not None else None
        steps.append(_step(manager, start, n, runs))
        keys = torch.randn(2, start + n, KV_HEADS, DIM, generator=gen)  # (layers, positions, kv, d)
        values = torch.randn(2, start + n, KV_HEADS, DIM, generator=gen)
        # NOTE: the reference sees the values the cache holds (rounded to `dtype`), so only the kernels differ
        keys, values = keys.to(dtype).float(), values.to(dtype).float()
        history.append((keys, values))
        _write_past(kv, manager, steps[-1], keys, values)
    t = sum(n for _, n, _ in SEQS)
    q = torch.randn(t, HEADS, DIM, generator=gen).to(dtype).float()  # (T, heads, head_dim)
    meta = build_metadata(steps, manager.kinds, BLOCK, PATTERN, device, dtype)
    pairs = []
    for layer, kind in enumerate(PATTERN.layer_kinds):
        new_k = torch.cat([k[layer, s.start :] for s, (k, _) in zip(steps, history, strict=True)])
        new_v = torch.cat([v[layer, s.start :] for s, (_, v) in zip(steps, history, strict=True)])
        q_on, k_on, v_on = (x.to(device=device, dtype=dtype) for x in (q, new_k, new_v))
        out = paged_attention(q_on, k_on, v_on, kv, meta, layer, PATTERN)
        out = out.view(t, HEADS, DIM)  # (T, heads, head_dim)
        offset = 0
        for s, (keys, values) in zip(steps, history, strict=True):
            rows = slice(offset, offset + s.num_new)
            pairs.append((out[rows], _reference(q[rows], keys[layer], values[layer], s, kind)))
            offset += s.num_new
    return pairs


def test_a_lone_decode_equals_the_dense_reference_at_every_position() -> None:
    """One sequence decoding (its own lean metadata path): across block edges and far past the window."""
    gen = torch.Generator().manual_seed(1)
    for start in range(0, 3 * BLOCK + 2 * WINDOW):
        kv, manager = _cache()
        step = _step(manager, start, 1, None)
        keys = torch.randn(2, start + 1, KV_HEADS, DIM, generator=gen)  # (layers, positions, kv, d)
        values = torch.randn(2, start + 1, KV_HEADS, DIM, generator=gen)
        _write_past(kv, manager, step, keys, values)
        q = torch.randn(1, HEADS, DIM, generator=gen)
        meta = build_metadata([step], manager.kinds, BLOCK, PATTERN, torch.device("cpu"), torch.float32)
        assert meta.max_position == start and [len(s) for s in meta.slots] == [1, 1]
        for layer, kind in enumerate(PATTERN.layer_kinds):
            out = paged_attention(q, keys[layer, start:], values[layer, start:], kv, meta, layer, PATTERN)
            assert_close_ulps(out.view(1, HEADS, DIM), _reference(q, keys[layer], values[layer], step, kind), ulps=32)


def test_a_sliding_layer_reads_only_its_window_far_into_a_sequence() -> None:
    _, manager = _cache()
    step = _step(manager, 40, 1, None)
    meta = build_metadata([step], manager.kinds, BLOCK, PATTERN, torch.device("cpu"), torch.float32)
    full, sliding = meta.groups[0].reads
    assert full.keys == (0, 41) and full.pages[0].shape[0] == 11  # every block of a full layer
    lo, hi = sliding.keys  # a window of 5 keys inside at most 2 blocks, no mask
    assert hi - lo == WINDOW and sliding.pages[0].shape[0] <= 2 and sliding.mask is None


def _cache(device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> tuple[KVCache, KVBlockManager]:
    config = DecoderConfig(block_size=BLOCK, num_blocks=32)
    kv = KVCache(SPEC, config, dtype=dtype, device=device or torch.device("cpu"))
    return kv, KVBlockManager(BlockPool(kv.num_pages), PATTERN, BLOCK)


def _step(manager: KVBlockManager, start: int, n: int, runs: np.ndarray | None) -> SeqStep:
    blocks = manager.new_blocks()
    manager.grow(blocks, start + n)
    manager.trim(blocks, start)  # as after the previous step: sliding blocks out of the window are gone
    return SeqStep(start, n, blocks.tables, runs)


def _write_past(kv: KVCache, manager: KVBlockManager, step: SeqStep, keys: torch.Tensor,
                values: torch.Tensor) -> None:
    """Put positions [0, start) of each layer where its table says, as earlier steps would have."""
    for kind, table in zip(manager.kinds, step.tables, strict=True):
        for rank, layer in enumerate(kind.layers):
            for pos in range(step.start):
                page = table.pages[pos // BLOCK, rank]
                if page >= 0:  # blocks freed from a sliding layer hold nothing any more
                    kv.keys[page, pos % BLOCK] = keys[layer, pos]
                    kv.values[page, pos % BLOCK] = values[layer, pos]


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, s: SeqStep, kind: str) -> torch.Tensor:
    end = s.start + s.num_new
    qpos = torch.arange(s.start, end)[:, None]
    kpos = torch.arange(end)[None, :]
    allowed = kpos <= qpos  # causal
    if s.image_runs is not None:
        g = torch.from_numpy(s.image_runs)
        allowed |= (g[s.start : end, None] == g[None, :end]) & (g[s.start : end, None] >= 0)
    if kind == SLIDING:
        allowed &= kpos > qpos - WINDOW
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=allowed[None, None], scale=PATTERN.scaling, enable_gqa=True,
    )[0].transpose(0, 1)  # (num_new, heads, head_dim)


def test_an_accelerators_mask_rows_start_at_aligned_strides(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's memory-efficient SDPA copies a mask whose row strides are not multiples of 8, on every call."""
    monkeypatch.setattr(attention, "mask_alignment", lambda device: 8)
    allowed = torch.rand(1, 1, 5, 13) > 0.5  # (1, 1, Q, keys): 13 keys, a prefill chunk's odd count
    mask = attention._additive(allowed, torch.bfloat16)
    assert mask.shape == allowed.shape and mask.stride()[:3] == (80, 80, 16) and mask.stride(-1) == 1
    assert torch.equal(mask == 0, allowed) and bool(mask[~allowed].isneginf().all())
