"""Paged attention for a whole decoder step: decodes batched in one call, prefill chunks one call each.

Owns: the step's attention metadata (where each new token's K/V goes, which slots each sequence
reads, the masks of each layer kind) and the attention computation over the paged KV cache.
Does not own: which tokens run (the scheduler), the tensors' memory (KVCache), or the model's
projections (the model module).

Layout: the step's T new tokens are flat, sequence after sequence. For attention, sequences are
split into groups, each one scaled-dot-product call over a padded (B, Qmax) query grid and (B, Lmax)
context slots: all decodes together (Qmax = 1), and each prefill chunk alone (B = 1, no padding).
NOTE: one grid for a whole mixed step would pad every decode to the longest prefill chunk: with 7
decodes beside a 300-token chunk that is ~8x the chunk's attention work.
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
class AttentionGroup:
    """Sequences attended in one call."""

    token_index: torch.Tensor  # (n,) positions among the step's T new tokens of this group's queries
    query_index: torch.Tensor  # (B, Qmax) index into the T new tokens; padded with 0
    query_valid: torch.Tensor  # (B, Qmax) bool, False on padding
    kv_slots: torch.Tensor  # (B, Lmax) cache slots of each sequence's context; padded with 0
    masks: dict[str, torch.Tensor]  # layer kind -> (B, 1, Qmax, Lmax) bool, True = may attend


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot each new token's K/V is written to
    groups: list[AttentionGroup]  # every new token is a query of exactly one group


def build_metadata(chunks: list[SeqChunk], pattern: AttentionPattern, device: torch.device) -> AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""
    offsets = np.concatenate(([0], np.cumsum([c.num_new for c in chunks])))  # (B + 1,)
    decodes = [i for i, c in enumerate(chunks) if c.num_new == 1]
    members = ([decodes] if decodes else []) + [[i] for i, c in enumerate(chunks) if c.num_new != 1]
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate([c.slots[c.start : c.start + c.num_new] for c in chunks]))
        .to(device),
        groups=[_group([chunks[i] for i in idx], offsets[idx], pattern, device) for idx in members],
    )


def _group(chunks: list[SeqChunk], offsets: np.ndarray, pattern: AttentionPattern,
           device: torch.device) -> AttentionGroup:
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
    for i, (c, offset) in enumerate(zip(chunks, offsets, strict=True)):
        end = c.start + c.num_new
        query_index[i, : c.num_new] = np.arange(offset, offset + c.num_new)
        query_valid[i, : c.num_new] = True
        q_pos[i, : c.num_new] = np.arange(c.start, end)
        kv_slots[i, :end] = c.slots
        kv_len[i] = end
        if c.image_groups is not None and pattern.bidirectional_images:
            groups[i, :end] = c.image_groups
            q_groups[i, : c.num_new] = c.image_groups[c.start : end]
    masks = _masks(q_pos, query_valid, kv_len, groups, q_groups, l_max, pattern)
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return AttentionGroup(
        token_index=as_tensor(query_index[query_valid]),
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
    if len(meta.groups) == 1:
        return _attend_group(q, key_cache, value_cache, meta.groups[0], kind, pattern)
    out = torch.empty_like(q)
    for group in meta.groups:
        out[group.token_index] = _attend_group(q, key_cache, value_cache, group, kind, pattern)
    return out


def _attend_group(q, key_cache, value_cache, group: AttentionGroup, kind: str,
                  pattern: AttentionPattern) -> torch.Tensor:
    """(n, heads, head_dim) outputs of the group's queries, in `token_index` order."""
    qb = q[group.query_index].transpose(1, 2)  # (B, heads, Qmax, head_dim)
    kb = key_cache[group.kv_slots].transpose(1, 2)  # (B, kv_heads, Lmax, head_dim)
    vb = value_cache[group.kv_slots].transpose(1, 2)  # (B, kv_heads, Lmax, head_dim)
    mask = group.masks[kind]  # (B, 1, Qmax, Lmax)
    if pattern.softcap is None:
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=pattern.scaling, enable_gqa=True)
    else:
        out = _softcapped_attention(qb, kb, vb, mask, pattern.scaling, pattern.softcap)
    return out.transpose(1, 2)[group.query_valid]  # (n, heads, head_dim)


def _softcapped_attention(qb, kb, vb, mask, scaling: float, softcap: float) -> torch.Tensor:
    rep = qb.shape[1] // kb.shape[1]
    kb, vb = kb.repeat_interleave(rep, dim=1), vb.repeat_interleave(rep, dim=1)
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scaling  # (B, heads, Qmax, Lmax)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(vb.dtype), vb)
