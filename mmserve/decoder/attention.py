"""Paged attention for a whole decoder step: every scheduled sequence in one batched call.

Owns: the step's attention metadata (where each new token's K/V goes, which slots each sequence
reads, the masks of each layer kind) and the attention computation over the paged KV cache.
Does not own: which tokens run (the scheduler), the tensors' memory (KVCache), or the model's
projections (the model module).

Layout: the step's T new tokens are flat, sequence after sequence. For attention they are
gathered into a padded (B, Qmax) grid and each sequence's context into (B, Lmax) slots, so one
scaled-dot-product call serves prefill chunks and decodes alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mmserve.models.base import FULL, SLIDING, AttentionPattern


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step, as attention needs it."""

    start: int  # position of the first new token (= tokens already in the cache)
    num_new: int  # new tokens this step
    slots: np.ndarray  # (start + num_new,) int64 cache slot of every context position
    image_groups: np.ndarray | None  # (start + num_new,) image-run id per position, -1 = text; None = no image


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot each new token's K/V is written to
    query_index: torch.Tensor  # (B, Qmax) index into the T new tokens; padded with 0
    query_valid: torch.Tensor  # (B, Qmax) bool, False on padding
    kv_slots: torch.Tensor  # (B, Lmax) cache slots of each sequence's context; padded with 0
    masks: dict[str, torch.Tensor]  # layer kind -> (B, 1, Qmax, Lmax) bool, True = may attend


def build_metadata(chunks: list[SeqChunk], pattern: AttentionPattern, device: torch.device) -> AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""
    b = len(chunks)
    q_max = max(c.num_new for c in chunks)
    l_max = max(c.start + c.num_new for c in chunks)
    query_index = np.zeros((b, q_max), dtype=np.int64)
    query_valid = np.zeros((b, q_max), dtype=bool)
    q_pos = np.full((b, q_max), -1, dtype=np.int64)
    kv_slots = np.zeros((b, l_max), dtype=np.int64)
    kv_len = np.zeros((b,), dtype=np.int64)
    groups = np.full((b, l_max), -1, dtype=np.int64)
    q_groups = np.full((b, q_max), -1, dtype=np.int64)
    slot_mapping, offset = [], 0
    for i, c in enumerate(chunks):
        end = c.start + c.num_new
        query_index[i, : c.num_new] = np.arange(offset, offset + c.num_new)
        query_valid[i, : c.num_new] = True
        q_pos[i, : c.num_new] = np.arange(c.start, end)
        kv_slots[i, :end] = c.slots
        kv_len[i] = end
        if c.image_groups is not None and pattern.bidirectional_images:
            groups[i, :end] = c.image_groups
            q_groups[i, : c.num_new] = c.image_groups[c.start : end]
        slot_mapping.append(c.slots[c.start : end])
        offset += c.num_new
    masks = _masks(q_pos, query_valid, kv_len, groups, q_groups, l_max, pattern)
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=as_tensor(np.concatenate(slot_mapping)),
        query_index=as_tensor(query_index),
        query_valid=as_tensor(query_valid),
        kv_slots=as_tensor(kv_slots),
        masks={kind: as_tensor(m) for kind, m in masks.items()},
    )


def _masks(q_pos, query_valid, kv_len, groups, q_groups, l_max, pattern) -> dict[str, np.ndarray]:
    kv_pos = np.arange(l_max)[None, None, :]  # (1, 1, Lmax)
    qp = q_pos[:, :, None]  # (B, Qmax, 1)
    in_context = kv_pos < kv_len[:, None, None]
    same_image = (q_groups[:, :, None] == groups[:, None, :]) & (q_groups[:, :, None] >= 0)
    full = in_context & ((kv_pos <= qp) | same_image)  # (B, Qmax, Lmax)
    masks = {FULL: full}
    if SLIDING in pattern.layer_kinds:
        assert pattern.sliding_window is not None
        # NOTE: as in transformers: AND(window, OR(causal, same image)); future image tokens pass.
        masks[SLIDING] = full & (kv_pos > qp - pattern.sliding_window)
    for m in masks.values():
        m[~query_valid, 0] = True  # padding rows attend somewhere, so softmax stays finite
    return {kind: m[:, None] for kind, m in masks.items()}


def paged_attention(
    q: torch.Tensor,  # (T, heads, head_dim), rotary applied
    k: torch.Tensor,  # (T, kv_heads, head_dim), rotary applied
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    cache: tuple[torch.Tensor, torch.Tensor],  # layer's (num_slots, kv_heads, head_dim) keys, values
    meta: AttentionMetadata,
    kind: str,
    pattern: AttentionPattern,
) -> torch.Tensor:
    """Write this step's K/V into the cache, attend over each sequence's context; (T, heads, head_dim)."""
    key_cache, value_cache = cache
    key_cache.index_copy_(0, meta.slot_mapping, k)
    value_cache.index_copy_(0, meta.slot_mapping, v)
    qb = q[meta.query_index].transpose(1, 2)  # (B, heads, Qmax, head_dim)
    kb = key_cache[meta.kv_slots].transpose(1, 2)  # (B, kv_heads, Lmax, head_dim)
    vb = value_cache[meta.kv_slots].transpose(1, 2)  # (B, kv_heads, Lmax, head_dim)
    mask = meta.masks[kind]  # (B, 1, Qmax, Lmax)
    if pattern.softcap is None:
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=pattern.scaling, enable_gqa=True)
    else:
        out = _softcapped_attention(qb, kb, vb, mask, pattern.scaling, pattern.softcap)
    out = out.transpose(1, 2)  # (B, Qmax, heads, head_dim)
    return out[meta.query_valid]  # (T, heads, head_dim), flat order = query_index order


def _softcapped_attention(qb, kb, vb, mask, scaling: float, softcap: float) -> torch.Tensor:
    rep = qb.shape[1] // kb.shape[1]
    kb, vb = kb.repeat_interleave(rep, dim=1), vb.repeat_interleave(rep, dim=1)
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scaling  # (B, heads, Qmax, Lmax)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(vb.dtype), vb)
