"""attention.py: a mixed step is attended per group (decodes together, each prefill chunk alone), and the
result equals attending each sequence on its own with its plain causal / image mask."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mmserve.decoder.attention import SeqChunk, build_metadata, paged_attention
from mmserve.models.base import FULL, AttentionPattern
from tests.numerics import assert_close_ulps

PATTERN = AttentionPattern(layer_kinds=(FULL,), sliding_window=None, bidirectional_images=True, scaling=0.5,
                           softcap=None)
HEADS, KV_HEADS, DIM = 4, 2, 8


def chunk(start: int, num_new: int, first_slot: int, images: list[tuple[int, int]] | None = None) -> SeqChunk:
    end = start + num_new
    groups = None
    if images is not None:
        groups = np.full(end, -1, dtype=np.int64)
        for i, (a, b) in enumerate(images):
            groups[a:b] = i
    return SeqChunk(start, num_new, np.arange(first_slot, first_slot + end, dtype=np.int64), groups)


def test_decodes_share_one_group_and_each_prefill_chunk_has_its_own() -> None:
    chunks = [chunk(6, 1, 0), chunk(0, 5, 100), chunk(3, 1, 200), chunk(2, 4, 300), chunk(9, 1, 400)]
    meta = build_metadata(chunks, PATTERN, torch.device("cpu"))
    shapes = [tuple(g.query_index.shape) for g in meta.groups]
    assert shapes == [(3, 1), (1, 5), (1, 4)]  # no decode padded to a 5-token chunk
    assert [g.kv_slots.shape[1] for g in meta.groups] == [10, 5, 6]
    flat = torch.cat([g.token_index for g in meta.groups]).sort().values
    assert flat.tolist() == list(range(1 + 5 + 1 + 4 + 1))  # every new token is a query exactly once
    assert meta.groups[0].token_index.tolist() == [0, 6, 11]


def test_grouped_attention_equals_each_sequence_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    # a decode, a prefill chunk with an image run [1, 4), a decode, a later chunk of a prompt
    chunks = [chunk(6, 1, 0), chunk(0, 5, 100, images=[(1, 4)]), chunk(3, 1, 200), chunk(2, 4, 300)]
    slots = 400
    key_cache = torch.randn(slots, KV_HEADS, DIM, generator=gen)
    value_cache = torch.randn(slots, KV_HEADS, DIM, generator=gen)
    t = sum(c.num_new for c in chunks)
    q = torch.randn(t, HEADS, DIM, generator=gen)  # (T, heads, head_dim)
    k = torch.randn(t, KV_HEADS, DIM, generator=gen)
    v = torch.randn(t, KV_HEADS, DIM, generator=gen)
    meta = build_metadata(chunks, PATTERN, torch.device("cpu"))
    cache = (key_cache.clone(), value_cache.clone())
    out = paged_attention(q, k, v, cache, meta, FULL, PATTERN)  # (T, heads, head_dim)

    offset = 0
    for c in chunks:
        end = c.start + c.num_new
        rows = slice(offset, offset + c.num_new)
        keys, values = cache[0][torch.from_numpy(c.slots)], cache[1][torch.from_numpy(c.slots)]  # (end, kv, d)
        assert torch.equal(keys[c.start :], k[rows]) and torch.equal(values[c.start :], v[rows])  # copies
        qpos = torch.arange(c.start, end)[:, None]
        allowed = torch.arange(end)[None, :] <= qpos  # causal
        if c.image_groups is not None:
            g = torch.from_numpy(c.image_groups)
            allowed |= (g[c.start :, None] == g[None, :]) & (g[c.start :, None] >= 0)  # both ways in an image
        expected = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=allowed[None, None], scale=PATTERN.scaling, enable_gqa=True,
        )[0].transpose(0, 1)  # (num_new, heads, head_dim)
        # NOTE: batched and padded against alone: other SDPA kernels sum the softmax and the weighted
        # values (<= 10 keys, O(1) values) in another order; a few roundings each, 32 ulps in all.
        assert_close_ulps(out[rows], expected, ulps=32)
        offset += c.num_new
