"""Prefix caching: block hashes name content (tokens, items, salt, model), the pool keeps freed cached blocks
findable in LRU order, and only full, computed blocks are ever found."""

from __future__ import annotations

import numpy as np

from mmserve.config import DecoderConfig
from mmserve.decoder.block_pool import BlockPool
from mmserve.decoder.kv_blocks import KVBlockManager
from mmserve.decoder.prefix_cache import BlockHasher, PrefixCache
from mmserve.decoder.scheduler import Scheduler
from mmserve.decoder.sequence import Sequence
from mmserve.messages import MultiModalFeatureSpec, PlaceholderRange, SamplingParams
from mmserve.models.base import FULL, SLIDING, AttentionPattern

BS = 4
FULL_ONLY = AttentionPattern((FULL,), None, True, 1.0, None)
MIXED = AttentionPattern((SLIDING, FULL), 6, True, 1.0, None)


def hashes(tokens: list[int], features: list[MultiModalFeatureSpec] = (), salt: str | None = None,  # type: ignore[assignment]
           model: str = "m") -> list[bytes]:
    out: list[bytes] = []
    BlockHasher(model, "float32", BS).extend(out, tokens, list(features), salt)
    return out


def item(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(identifier, "image", PlaceholderRange(offset, length), length)


def test_hashes_chain_over_tokens_items_salt_and_model() -> None:
    tokens = list(range(100, 118))  # 4 full blocks and 2 tokens
    base = hashes(tokens)
    assert len(base) == 4 and len(set(base)) == 4 and all(len(h) == 32 for h in base)
    assert hashes(tokens) == base  # a pure function of the content
    other = hashes([*tokens[:9], 7, *tokens[10:]])  # one token of block 2 differs
    assert other[:2] == base[:2] and other[2] != base[2] and other[3] != base[3]  # chained
    one = hashes(tokens, [item("img-a", 6, 8)])
    pixel = hashes(tokens, [item("img-b", 6, 8)])  # same tokens, another image (one pixel off: another id)
    assert one[0] == base[0] and one[1] != base[1]  # blocks before the item are the template's
    assert pixel[0] == one[0] and all(a != b for a, b in zip(pixel[1:], one[1:], strict=True))
    moved = hashes(tokens, [item("img-a", 5, 8)])  # the same image elsewhere: other offsets inside it
    assert moved[1] != one[1]
    salted = hashes(tokens, salt="tenant-1")
    assert all(a != b for a, b in zip(salted, base, strict=True)) and salted != hashes(tokens, salt="tenant-2")
    assert hashes(tokens, model="other")[0] != base[0]


def seq(rid: str, tokens: list[int], manager: KVBlockManager) -> Sequence:
    s = Sequence(rid, tokens, SamplingParams())
    s.blocks = manager.new_blocks()
    BlockHasher("m", "float32", BS).extend(s.block_hashes, s.token_ids, [], None)
    return s


def test_only_computed_full_blocks_are_found_and_freed_ones_stay_until_needed() -> None:
    pool = BlockPool(8)
    cache = PrefixCache(pool)
    manager = KVBlockManager(pool, FULL_ONLY, BS, cache)
    a = seq("a", list(range(10)), manager)  # 2 full blocks and a partial one
    manager.grow(a.blocks, 10)
    manager.index(a.blocks, a.block_hashes, 7)  # K/V written for 7 positions: block 0 only
    assert manager.cached_prefix(a.block_hashes, 10) == 1
    manager.index(a.blocks, a.block_hashes, 10)
    assert manager.cached_prefix(a.block_hashes, 10) == 2  # never the partial third block
    manager.release(a.blocks)
    assert pool.num_free == 6 and manager.num_free == 8 and len(cache.entries) == 2  # cached, yet free
    b = seq("b", list(range(10)), manager)
    assert manager.start_from_cache(b.blocks, b.block_hashes, limit=2) == 8
    c = seq("c", list(range(10)), manager)
    assert manager.start_from_cache(c.blocks, c.block_hashes, limit=1) == 4  # while b holds it too
    assert cache.find(0, b.block_hashes[0]).holders == 2  # type: ignore[union-attr]
    manager.release(c.blocks)
    manager.release(b.blocks)
    assert manager.num_free == 8 and all(e.holders == 0 for e in cache.entries.values())


def test_free_cached_blocks_are_evicted_least_recently_freed_first_and_tail_first() -> None:
    pool = BlockPool(6)
    cache = PrefixCache(pool)
    manager = KVBlockManager(pool, FULL_ONLY, BS, cache)
    old, new = seq("old", list(range(8)), manager), seq("new", list(range(50, 58)), manager)
    for s in (old, new):
        manager.grow(s.blocks, 8)
        manager.index(s.blocks, s.block_hashes, 8)
    manager.release(old.blocks)  # freed first: its tail block first
    manager.release(new.blocks)
    taker = seq("taker", list(range(90, 94)), manager)
    manager.grow(taker.blocks, 4)  # 2 pool pages were free: no eviction yet
    assert len(cache.entries) == 4
    more = seq("more", list(range(70, 74)), manager)
    manager.grow(more.blocks, 4)
    manager.grow(seq("x", list(range(80, 84)), manager).blocks, 4)  # the pool is dry: old's tail goes first
    assert manager.cached_prefix(old.block_hashes, 2) == 1 and manager.cached_prefix(new.block_hashes, 2) == 2
    manager.grow(seq("y", list(range(60, 64)), manager).blocks, 4)  # then its head; `new` is still whole
    assert manager.cached_prefix(old.block_hashes, 2) == 0 and manager.cached_prefix(new.block_hashes, 2) == 2


def test_a_sliding_layer_hit_needs_only_the_window_before_its_end() -> None:
    pool = BlockPool(64)
    manager = KVBlockManager(pool, MIXED, BS, PrefixCache(pool))
    a = seq("a", list(range(24)), manager)
    manager.grow(a.blocks, 24)
    manager.index(a.blocks, a.block_hashes, 24)
    manager.trim(a.blocks, 24)  # the sliding layer let go of blocks before its window: still cached
    manager.release(a.blocks)
    b = seq("b", [*range(24), 5], manager)
    assert manager.start_from_cache(b.blocks, b.block_hashes, limit=6) == 24
    sliding, full = b.blocks.tables
    assert (full.lo, full.hi) == (0, 6)
    assert sliding.lo == (24 - 6 + 1) // BS and sliding.hi == 6  # 2 blocks: the window before position 24
    manager.release(b.blocks)
    assert manager.num_free == 64


def test_the_scheduler_starts_a_repeat_on_its_cached_prefix_and_counts_it() -> None:
    config = DecoderConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=BS, num_blocks=32)
    sched = Scheduler(config, BlockPool(32), FULL_ONLY, 256, (1,), BlockHasher("m", "float32", BS))
    prompt = list(range(100, 118))

    def finish(rid: str) -> Sequence:
        s = Sequence(rid, list(prompt), SamplingParams(max_tokens=1, ignore_eos=True))
        sched.add(s)
        while sched.has_unfinished():
            out = sched.schedule()
            sched.update(out, {x.seq.request_id: 7 for x in out.scheduled if x.samples})
        return s

    first, again = finish("a"), finish("b")
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 16  # 4 full blocks; 2 tokens computed
    stats = sched.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (36, 16) and stats.free_blocks == 32
    assert np.all([e.holders == 0 for e in sched.kv.cache.entries.values()])  # type: ignore[union-attr]



def test_a_head_of_queue_whose_hit_ends_inside_a_skipped_item_asks_for_it_and_is_not_stuck() -> None:
    """The request came while its image was cached (so it was not encoded); by admission the cache let
    the tail go and the hit ends inside the image: the scheduler asks for the embeddings at once and
    admits the request once they came, instead of waiting at the head of the queue forever; the requests
    behind it go on meanwhile."""
    config = DecoderConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=BS, num_blocks=32)
    sched = Scheduler(config, BlockPool(32), FULL_ONLY, 256, (1,), BlockHasher("m", "float32", BS))
    prompt = [5] * 4 + [9] * 8 + [6] * 6  # an image's 8 tokens at [4, 12)
    image = item("img", 4, 8)

    def sequence(rid: str, embeddings: list[object]) -> Sequence:
        s = Sequence(rid, list(prompt), SamplingParams(max_tokens=1, ignore_eos=True), [image], embeddings,
                     atomic_spans=[(4, 12)])
        sched.add(s)
        return s

    def drive() -> list[tuple[Sequence, list[int]]]:
        out = sched.schedule()
        sched.update(out, {x.seq.request_id: 7 for x in out.scheduled if x.samples})
        return out.missing

    sequence("a", [object()])
    while sched.has_unfinished():
        drive()
    cache = sched.kv.cache
    assert cache is not None
    taken = cache.allocate(sched.kv.num_free - 2)  # evicts the tail entries, least recently freed first
    sched.pool.free(taken)
    b = sequence("b", [None])
    c = Sequence("c", [3] * 10, SamplingParams(max_tokens=1, ignore_eos=True))  # text, behind b in the queue
    sched.add(c)
    assert sched.kv.cached_prefix(b.block_hashes, 4) == 2  # blocks [0, 8): the hit ends inside the image
    assert drive() == [(b, [0])] and b.status.value == "waiting"  # asked at once, not admitted yet
    assert c.status.value == "finished"  # NOTE: b waits for its embeddings, not for room: c was not held up
    b.embeddings[0] = object()  # as Decoder.provide_embeddings does
    drive()
    assert b.status.value in ("running", "finished") and b.num_cached_tokens == 8


def test_a_sliding_layers_cached_blocks_another_sequence_holds_too_are_not_in_hand_once_its_window_passes() -> None:
    """Those its window moves past take new pages in their place while they stay with the other: admission
    counts them as pages still to take; those still in the window at its last token are in hand."""
    pool = BlockPool(64)
    manager = KVBlockManager(pool, MIXED, BS, PrefixCache(pool))  # window 6, blocks of 4
    a = seq("a", list(range(24)), manager)
    manager.grow(a.blocks, 24)
    manager.index(a.blocks, a.block_hashes, 24)  # a still holds all of it
    # the sliding rows 4 and 5 are shared; the last token (at tokens - 1) reads back from (tokens - 6)
    for tokens, passed in ((44, 2), (26, 1), (25, 0)):
        b = seq("b", [*range(24), *range(100, 100 + tokens - 24)], manager)
        assert manager.start_from_cache(b.blocks, b.block_hashes, limit=6) == 24
        sliding, _ = b.blocks.tables
        assert (sliding.lo, sliding.hi) == (4, 6)
        assert manager.pages_in_hand(b.blocks, tokens) == b.blocks.num_pages - passed, tokens
        manager.release(b.blocks)
    manager.release(a.blocks)  # now b alone would hold them: they come back to the pool when it lets go
    b = seq("b", [*range(24), *range(100, 120)], manager)
    manager.start_from_cache(b.blocks, b.block_hashes, limit=6)
    assert manager.pages_in_hand(b.blocks, 44) == b.blocks.num_pages


def test_a_running_sequence_grows_into_free_cached_blocks_without_preempting() -> None:
    """Free cached blocks count as free: a decode crossing a block boundary evicts one, not a neighbour."""
    config = DecoderConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=BS, num_blocks=8)
    sched = Scheduler(config, BlockPool(8), FULL_ONLY, 256, (1,), BlockHasher("m", "float32", BS))
    preempted = 0

    def run(rid: str, prompt: list[int], max_tokens: int) -> None:
        nonlocal preempted
        sched.add(Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        while sched.has_unfinished():
            out = sched.schedule()
            preempted += len(out.preempted)
            sched.update(out, {x.seq.request_id: 7 for x in out.scheduled if x.samples})

    run("a", list(range(100, 116)), 1)  # leaves 4 cached blocks, all free
    run("b", list(range(200, 208)), 20)  # grows to 7 blocks: 3 of them evicted from the cache
    assert preempted == 0 and sched.stats().free_blocks == 8


class _Found:
    """A prefix cache stand-in that finds the (kind, block) pairs it is given, and counts its lookups."""

    def __init__(self, present: set[tuple[int, bytes]]) -> None:
        self.present, self.lookups = present, 0

    def find(self, kind: int, block_hash: bytes) -> object | None:
        self.lookups += 1
        return object() if (kind, block_hash) in self.present else None


def _is_hit(m: int, kinds: tuple, present: set[tuple[int, bytes]], blocks: list[bytes], window: int) -> bool:
    """The rule read directly: full kinds find blocks [0, m), sliding ones those a query at m * BS reads."""
    first = max(m * BS - window + 1, 0) // BS
    return all((k, blocks[b]) in present for k, kind in enumerate(kinds)
               for b in range(0 if kind.window is None else first, m))


def test_the_longest_hit_of_sliding_layers_is_found_in_linear_lookups() -> None:
    """Against a direct reading of the rule: an end of m blocks is a hit when full layers find blocks [0, m) and a
    sliding layer those its window reads from a query at m * BS; cached blocks drawn at random, and one sliding
    block missing in the middle (a search that tried ends one by one looked up most of a window at each end
    whose window held it). At most one lookup per kind and block."""
    window = 81  # 20 to 21 blocks
    rng = np.random.default_rng(0)
    blocks = [bytes([b]) for b in range(40)]
    for pattern in ((SLIDING,), (SLIDING, FULL, SLIDING)):
        manager = KVBlockManager(BlockPool(8), AttentionPattern(pattern, window, True, 1.0, None), BS,
                                 PrefixCache(BlockPool(8)))
        kinds = manager.kinds
        one_missing = {(k, h) for k, kind in enumerate(kinds) for h in blocks
                       if kind.window is None or h != blocks[20]}
        for trial in range(201):
            density = rng.uniform(0.5, 1.0)
            present = one_missing if trial == 200 else \
                {(k, h) for k in range(len(kinds)) for h in blocks if rng.random() < density}
            found = _Found(present)
            manager.cache = found  # type: ignore[assignment]
            limit = len(blocks) if trial == 200 else int(rng.integers(0, len(blocks) + 1))

            longest = max(m for m in range(limit + 1) if _is_hit(m, kinds, present, blocks, window))
            assert manager.cached_prefix(blocks, limit) == longest, trial
            assert found.lookups <= len(kinds) * (limit + 1), (pattern, trial, found.lookups)
