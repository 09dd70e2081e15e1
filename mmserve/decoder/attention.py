"""Paged attention for a whole decoder step, reading only the pages each layer kind keeps.

Owns: the step's attention metadata, built once per step for all layers of a kind (the cache row of
each new token's K/V on every layer, the pages each group reads per layer, the masks), and attention
over the paged cache. Does not own: which tokens run (scheduler), which pages a sequence holds
(kv_blocks.py), the tensors (KVCache), or the model's projections (the model module).

Layout: the step's T new tokens are flat, sequence after sequence. Sequences are attended in groups,
one `scaled_dot_product_attention` per group and layer: decodes together, those of contexts within a
factor 2 of each other in one group (`_decode_groups`), each prefill chunk alone. A group gathers its
sequences' pages of the layer (a full layer every block, a sliding layer the blocks of its window) into
(B, rows) keys and values; a lone sequence then slices the rows it
attends to and needs no mask unless its chunk is causal past position 0 or holds an image.
NOTE: one grid for a whole mixed step would pad every decode to the longest prefill chunk.
NOTE: a decode's query heads that share a kv head go in as that head's query rows, so its GQA needs no
expansion and no `enable_gqa` (which with a mask falls back to the math kernel on CUDA). A prefill chunk
uses `enable_gqa` on the CPU, and off it where it has no mask; a masked chunk off the CPU repeats its K/V
heads instead (`expands_masked_gqa`). On CUDA, PyTorch's FlexAttention is the kernel to move to
(docs/benchmarks.md has why not on the CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mmserve.decoder.kept_gather import KeptGathers, Refresh
from mmserve.decoder.kv_blocks import KindTable, LayerKind
from mmserve.decoder.kv_cache import KVCache
from mmserve.models.base import AttentionPattern
from mmserve.runtime.host_copy import to_device


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a step, as attention needs it (host data)."""

    start: int  # position of its first new token = tokens already in the cache (tokens)
    num_new: int  # new tokens this step (tokens)
    tables: list[KindTable]  # its pages, per layer kind (kv_blocks.SeqBlocks.tables)
    image_runs: np.ndarray | None  # (num_prompt,) image run per prompt position, -1 text; None = no image


@dataclass(frozen=True)
class KindRead:
    """What one group reads on the layers of one kind."""

    pages: tuple[torch.Tensor, ...]  # per layer of the kind, (B * blocks,) page ids; padding repeats a held page
    rows: int  # gathered key rows per sequence: blocks * block_size
    keys: tuple[int, int]  # [a, b): the gathered rows attended to (B > 1: all rows, the mask decides)
    mask: torch.Tensor | None  # (B, 1, Q, b - a) additive, in the attention's dtype: 0 = may attend, -inf not;
    # None = all of [a, b). NOTE: additive, made once per step: SDPA turns a bool mask into this on every call
    causal: bool  # True: SDPA's own causal mask (a lone chunk from position 0 over rows [0, end))
    kept: tuple[Refresh | None, ...] | None = None  # per layer of the kind, its kept gather (decodes only);
    # None = gather `pages` whole


@dataclass(frozen=True)
class AttentionGroup:
    token_index: torch.Tensor | None  # (B * Q,) this group's rows among the step's T; None = all, in order
    batch: int  # sequences B
    queries: int  # new tokens Q per sequence (1 for the decode group)
    reads: tuple[KindRead, ...]  # per layer kind, in `kinds` order


@dataclass(frozen=True)
class AttentionMetadata:
    slots: tuple[torch.Tensor, ...]  # per layer, (T,) cache row (page * block_size + offset) of each new token's K/V
    groups: list[AttentionGroup]  # every new token is a query of exactly one group
    kind_of: tuple[int, ...]  # layer -> index of its kind in `kinds`
    rank_of: tuple[int, ...]  # layer -> its index among the layers of its kind
    max_position: int  # the step's largest position (tokens)


def build_metadata(steps: list[SeqStep], kinds: tuple[LayerKind, ...], block_size: int,
                   pattern: AttentionPattern, device: torch.device, dtype: torch.dtype,
                   kept: KeptGathers | None = None) -> AttentionMetadata:
    """Everything attention needs for one step, built once on the host and moved in a few copies; masks in
    `dtype`, the attention's. With `kept`, the decode group's gathers are kept from step to step."""
    if len(steps) == 1 and steps[0].num_new == 1:
        return _lone_decode(steps[0], kinds, block_size, device, kept)
    kind_of, rank_of, layers_of = _layer_map(kinds)
    offsets = np.concatenate(([0], np.cumsum([s.num_new for s in steps])))  # (B + 1,)
    slots = np.empty((len(kind_of), int(offsets[-1])), dtype=np.int64)
    for s, offset in zip(steps, offsets, strict=False):
        block, within = np.divmod(np.arange(s.start, s.start + s.num_new), block_size)
        for layers, table in zip(layers_of, s.tables, strict=True):
            slots[layers, offset : offset + s.num_new] = (table.pages[block] * block_size + within[:, None]).T
    if kept is not None:
        kept.wrote(slots // block_size)
    decodes = _decode_groups([i for i, s in enumerate(steps) if s.num_new == 1], steps, block_size)
    members = decodes + [[i] for i, s in enumerate(steps) if s.num_new != 1]
    # NOTE: the longest decode group keeps its gathers (kept_gather.py holds one group's per layer)
    groups = [_group([steps[i] for i in idx], offsets[idx], kinds, block_size, pattern, device, dtype,
                     whole=len(members) == 1, kept=kept if g == 0 else None) for g, idx in enumerate(members)]
    # NOTE: per-layer rows split off in one call here, not indexed out once per layer
    return AttentionMetadata(to_device(slots, device).unbind(0), groups, kind_of, rank_of,
                             max(s.start + s.num_new for s in steps) - 1)


def _lone_decode(s: SeqStep, kinds: tuple[LayerKind, ...], block_size: int, device: torch.device,
                 kept: KeptGathers | None) -> AttentionMetadata:
    """`build_metadata` of a step that is one sequence's decode (one client's every step), in fewer calls.

    NOTE: the general path's lists, padding and concatenations cost more than its arithmetic here.
    """
    kind_of, rank_of, layers_of = _layer_map(kinds)
    position = s.start
    block, within = divmod(position, block_size)
    written = np.empty(len(kind_of), dtype=np.int64)  # (layers,) the page each layer's new K/V goes to
    for table, layers in zip(s.tables, layers_of, strict=True):
        written[layers] = table.pages[block]
    if kept is not None:
        kept.wrote(written)
    reads = []
    for kind, table in zip(kinds, s.tables, strict=True):
        first_key = _first_key(position, kind.window)
        lo = first_key // block_size
        held = np.ascontiguousarray(table.pages[lo : block + 1].T)  # (layers, blocks)
        keys = (first_key - lo * block_size, position + 1 - lo * block_size)
        reads.append(KindRead(to_device(held, device).unbind(0), (block + 1 - lo) * block_size, keys, None,
                              False, kept.plan(kind.layers, held, None, device) if kept is not None else None))
    slots = written[:, None] * block_size + within  # (layers, 1)
    group = AttentionGroup(None, 1, 1, tuple(reads))
    return AttentionMetadata(to_device(slots, device).unbind(0), [group], kind_of, rank_of, position)


def _decode_groups(decodes: list[int], steps: list[SeqStep], block_size: int) -> list[list[int]]:
    """The decodes (indices into `steps`) in groups whose every member's context is over half the group's longest
    (each group in step order; the group of the longest contexts first); none for no decodes.

    NOTE: a group gathers and attends over B x its longest context's pages on a full layer: one long chat
    among short ones made every short one read (and, on CUDA, hold) as many pages as the long one, e.g. 64 x
    a 32k context's. At most twice the pages read now, in at most log2(longest / shortest) + 1 groups.
    """
    blocks = {i: -(-(steps[i].start + 1) // block_size) for i in decodes}  # a full layer's pages of each
    groups: list[list[int]] = []
    for i in sorted(decodes, key=lambda i: -blocks[i]):
        if groups and 2 * blocks[i] > blocks[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(group) for group in groups]


@functools.cache
def _layer_map(kinds: tuple[LayerKind, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[np.ndarray, ...]]:
    """(layer -> its kind's index, layer -> its rank within the kind, each kind's layers as an index array)."""
    num_layers = sum(len(k.layers) for k in kinds)
    kind_of, rank_of = [0] * num_layers, [0] * num_layers
    for k, kind in enumerate(kinds):
        for rank, layer in enumerate(kind.layers):
            kind_of[layer], rank_of[layer] = k, rank
    return tuple(kind_of), tuple(rank_of), tuple(np.asarray(k.layers) for k in kinds)


def _group(steps: list[SeqStep], offsets: np.ndarray, kinds: tuple[LayerKind, ...], block_size: int,
           pattern: AttentionPattern, device: torch.device, dtype: torch.dtype, *, whole: bool,
           kept: KeptGathers | None) -> AttentionGroup:
    q = steps[0].num_new
    index = np.concatenate([np.arange(o, o + s.num_new) for s, o in zip(steps, offsets, strict=True)])
    reads = tuple(_read(steps, k, kind, block_size, pattern, device, dtype, kept if q == 1 else None)
                  for k, kind in enumerate(kinds))
    return AttentionGroup(None if whole else to_device(index, device), len(steps), q, reads)


def _read(steps: list[SeqStep], k: int, kind: LayerKind, block_size: int, pattern: AttentionPattern,
          device: torch.device, dtype: torch.dtype, kept: KeptGathers | None) -> KindRead:
    window = kind.window
    first_key = [_first_key(s.start, window) for s in steps]  # (B,) positions
    lo = [f // block_size for f in first_key]  # first block each sequence reads
    hi = [-(-(s.start + s.num_new) // block_size) for s in steps]
    blocks = max(h - b for b, h in zip(lo, hi, strict=True))
    pages = np.empty((len(kind.layers), len(steps), blocks), dtype=np.int64)
    for i, s in enumerate(steps):
        held = s.tables[k].pages[lo[i] : hi[i]].T  # (layers, n)
        pages[:, i, : held.shape[1]] = held
        pages[:, i, held.shape[1] :] = held[:, -1:]  # padding: any page the sequence holds; masked
    rows = blocks * block_size
    per_layer = pages.reshape(len(kind.layers), -1)  # (layers, B * blocks)
    flat = to_device(per_layer, device).unbind(0)
    if len(steps) > 1:  # decodes: a mask per sequence over its rows
        base = np.asarray(lo)[:, None] * block_size + np.arange(rows)[None]  # (B, rows) positions
        ends = np.asarray([s.start + 1 for s in steps])[:, None]
        valid = (base >= np.asarray(first_key)[:, None]) & (base < ends)
        read = np.arange(blocks)[None, :] < (np.asarray(hi) - np.asarray(lo))[:, None]  # (B, blocks): not padding
        plans = None if kept is None else kept.plan(kind.layers, per_layer, read.ravel(), device)
        return KindRead(flat, rows, (0, rows), _additive(to_device(valid[:, None, None], device), dtype),
                        False, plans)
    s = steps[0]
    a, b = first_key[0] - lo[0] * block_size, s.start + s.num_new - lo[0] * block_size
    # NOTE: only the chunk's own image tokens see both ways; an image before the chunk is causal past
    images = pattern.bidirectional_images and s.image_runs is not None and bool(
        (s.image_runs[s.start : s.start + s.num_new] >= 0).any())
    if s.num_new == 1:  # a decode alone in its group
        plans = None if kept is None else kept.plan(kind.layers, per_layer, None, device)
        return KindRead(flat, rows, (a, b), None, False, plans)
    if not images and window is None and s.start == 0:
        return KindRead(flat, rows, (a, b), None, causal=True)
    return KindRead(flat, rows, (a, b), _additive(_chunk_mask(s, first_key[0], window, images, device), dtype), False)


def _first_key(start: int, window: int | None) -> int:
    """The first position a query at `start` sees on a layer with `window` (None: the whole context)."""
    return max(start - window + 1, 0) if window is not None else 0


def _chunk_mask(s: SeqStep, first_key: int, window: int | None, images: bool,
                device: torch.device) -> torch.Tensor:
    """(1, 1, Q, keys) bool for a prefill chunk: causal OR same image, AND within the window."""
    q_pos = torch.arange(s.start, s.start + s.num_new, device=device)[:, None]  # (Q, 1)
    k_pos = torch.arange(first_key, s.start + s.num_new, device=device)[None, :]  # (1, keys)
    allowed = k_pos <= q_pos
    if images:
        assert s.image_runs is not None
        runs = to_device(_runs_at(s.image_runs, first_key, s.start + s.num_new), device)
        q_runs = runs[s.start - first_key :][:, None]
        allowed = allowed | ((q_runs == runs[None, :]) & (q_runs >= 0))  # an image's tokens see each other
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)  # NOTE: as transformers: AND(window, OR(causal, image))
    return allowed[None, None]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = may attend) as SDPA adds it to the scores: 0 where allowed, -inf elsewhere.

    NOTE: off the CPU its rows start at multiples of MASK_ALIGNMENT elements (a view of a wider tensor): CUDA's
    memory-efficient kernel otherwise copies a mask whose strides are not, on every call (torch's `pad_bias`),
    i.e. on each masked layer of a prefill chunk, whose keys are any number. The CPU's kernel needs no such rows.
    """
    keys, align = allowed.shape[-1], mask_alignment(allowed.device)
    padded = torch.zeros((*allowed.shape[:-1], -(-keys // align) * align), dtype=dtype, device=allowed.device)
    return padded[..., :keys].masked_fill_(~allowed, float("-inf"))


def mask_alignment(device: torch.device) -> int:
    """The multiple (elements) a mask's row strides are made of on `device` (`_additive`)."""
    return 1 if device.type == "cpu" else 8  # NOTE: 8, the alignment torch's `preprocess_mask` checks


def _runs_at(image_runs: np.ndarray, start: int, end: int) -> np.ndarray:
    """Image run of positions [start, end): the prompt's, -1 past it (outputs are text)."""
    out = np.full(end - start, -1, dtype=np.int64)
    stop = min(end, len(image_runs))
    if stop > start:
        out[: stop - start] = image_runs[start:stop]
    return out


def paged_attention(
    q: torch.Tensor,  # (T, heads, head_dim), rotary applied
    k: torch.Tensor,  # (T, kv_heads, head_dim), rotary applied
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    kv: KVCache,
    meta: AttentionMetadata,
    layer: int,
    pattern: AttentionPattern,
) -> torch.Tensor:
    """Write this step's K/V of `layer` into the cache, attend over what each group reads; (T, heads * head_dim),
    each token's heads side by side (the output projection's input)."""
    slots = meta.slots[layer]
    kv.key_rows.index_copy_(0, slots, k)
    kv.value_rows.index_copy_(0, slots, v)
    kind, rank = meta.kind_of[layer], meta.rank_of[layer]
    if len(meta.groups) == 1 and meta.groups[0].token_index is None:
        return _attend(q, kv, meta.groups[0], meta.groups[0].reads[kind], rank, pattern)
    out = q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))  # (T, heads * head_dim)
    for group in meta.groups:
        assert group.token_index is not None
        rows = q.index_select(0, group.token_index)
        out.index_copy_(0, group.token_index, _attend(rows, kv, group, group.reads[kind], rank, pattern))
    return out


def _attend(q: torch.Tensor, kv: KVCache, group: AttentionGroup, read: KindRead, rank: int,
            pattern: AttentionPattern) -> torch.Tensor:
    """(B * Q, heads, head_dim) queries of one group -> their outputs, (B * Q, heads * head_dim), same order."""
    b, n = group.batch, group.queries
    heads, kv_heads, d = q.shape[1], kv.keys.shape[2], q.shape[2]
    lo, hi = read.keys
    refresh = read.kept[rank] if read.kept is not None else None
    # each (B * blocks, block_size, kv_heads, d)
    gathered_keys, gathered_values = kv.gather(read.pages[rank]) if refresh is None else refresh.apply(kv)
    keys = _attended(gathered_keys, b, read.rows, lo, hi)  # (B, kv_heads, hi - lo, d)
    values = _attended(gathered_values, b, read.rows, lo, hi)
    gqa = n > 1 and kv_heads != heads
    if gqa and (pattern.softcap is not None or (read.mask is not None and expands_masked_gqa(q.device))):
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # (1, heads, hi - lo, d)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        gqa = False
    # decodes: (B, kv_heads, heads per kv head, d), each kv head's query heads as its query rows;
    # one prefill chunk: (1, heads, Q, d)
    queries = q.reshape(b, kv_heads, heads // kv_heads, d) if n == 1 else q.transpose(0, 1)[None]
    if pattern.softcap is None:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=read.mask, is_causal=read.causal,
                                             scale=pattern.scaling, enable_gqa=gqa)
    else:
        out = _softcapped_attention(queries, keys, values, read.mask, read.causal, pattern.scaling, pattern.softcap)
    if n == 1:
        return out.reshape(b, heads * d)
    return out[0].transpose(0, 1).reshape(n, heads * d)


def expands_masked_gqa(device: torch.device) -> bool:
    """Whether a masked prefill chunk's K/V heads are repeated to its query heads before SDPA on `device`.

    NOTE: on CUDA no fused SDPA kernel takes both an attention mask and `enable_gqa` (flash attention takes
    no mask, the memory-efficient kernel no GQA), so SDPA would fall back to its math kernel and hold the
    whole score matrix; with the heads repeated, the memory-efficient kernel takes the chunk. The CPU's
    flash kernel takes both. Decodes need neither: their query heads go in as rows of their kv head.
    """
    return device.type != "cpu"


def _attended(gathered: torch.Tensor, b: int, rows: int, lo: int, hi: int) -> torch.Tensor:
    """(B * blocks, block_size, kv_heads, d) contiguous gathered pages -> (B, kv_heads, hi - lo, d): each
    sequence's rows [lo, hi), heads first; `view(B, rows, ...)[:, lo:hi].transpose(1, 2)` in one call."""
    kv_heads, d = gathered.shape[2], gathered.shape[3]
    return gathered.as_strided((b, kv_heads, hi - lo, d), (rows * kv_heads * d, d, kv_heads * d, 1),
                               gathered.storage_offset() + lo * kv_heads * d)


def _softcapped_attention(q, k, v, mask, causal: bool, scaling: float, softcap: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling  # (..., Q, keys)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril(),
                                    float("-inf"))
    if mask is not None:
        scores = scores + mask  # additive: 0 or -inf
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
