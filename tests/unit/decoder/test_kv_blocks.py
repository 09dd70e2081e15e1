"""KVBlockManager: full layers keep every block, sliding layers only their window, and the pages a sliding
layer frees go back to the one pool and are taken again while the sequence goes on."""

from __future__ import annotations

from mmserve.config import DecoderConfig
from mmserve.decoder.block_pool import BlockPool
from mmserve.decoder.kv_blocks import KVBlockManager
from mmserve.decoder.scheduler import Scheduler
from mmserve.decoder.sequence import Sequence
from mmserve.messages import SamplingParams
from mmserve.models.base import FULL, SLIDING, AttentionPattern

WINDOW, BLOCK = 8, 4
# Gemma 3's shape: five sliding layers to one full one
PATTERN = AttentionPattern(layer_kinds=(SLIDING,) * 5 + (FULL,), sliding_window=WINDOW,
                           bidirectional_images=True, scaling=1.0, softcap=None)


def held(manager: KVBlockManager, blocks) -> dict[str, set[int]]:
    return {k.name: {int(p) for p in t.pages[t.lo : t.hi].ravel()} for k, t in zip(manager.kinds, blocks.tables,
                                                                                  strict=True)}


def test_a_long_decode_holds_its_window_on_sliding_layers_and_reuses_their_freed_pages() -> None:
    pool = BlockPool(200)
    manager = KVBlockManager(pool, PATTERN, BLOCK)
    blocks = manager.new_blocks()
    freed: set[int] = set()
    reused = 0
    for end in range(1, 161):  # one token per step, as decoding does, to 20 windows
        before = set(range(200)) - {p for s in held(manager, blocks).values() for p in s}
        manager.grow(blocks, end)
        taken = {p for s in held(manager, blocks).values() for p in s} - (set(range(200)) - before)
        reused += len(taken & freed)
        pages = held(manager, blocks)
        # the next query at `end` sees [end - 7, end]: at most 3 blocks of 4 on each sliding layer
        assert len(pages[SLIDING]) <= 5 * (-(-(WINDOW - 1) // BLOCK) + 1)
        assert len(pages[FULL]) == -(-end // BLOCK)  # every block, one page each
        before_trim = pages[SLIDING]
        manager.trim(blocks, end)
        freed |= before_trim - held(manager, blocks)[SLIDING]
        assert pool.num_free + blocks.num_pages == 200
    assert freed and reused > 0, "pages a sliding layer gave back served the same sequence later"
    manager.release(blocks)
    assert pool.num_free == 200


def test_a_shared_pool_runs_several_times_the_long_sequences_of_uniform_blocks() -> None:
    """Six sequences growing to 160 tokens: a pool that holds 2 of them if every layer kept every block
    runs all 6 at once when sliding layers keep their window, and the scheduler counts it so: no
    preemption."""
    length, prompt = 160, 120
    uniform = 6 * -(-length // BLOCK)  # pages of one such sequence if every layer kept every block
    pool_pages = 2 * uniform
    manager = KVBlockManager(BlockPool(pool_pages), PATTERN, BLOCK)
    assert manager.peak_pages(length, 1) <= 0.35 * uniform
    config = DecoderConfig(max_num_seqs=12, max_num_batched_tokens=32, block_size=BLOCK, num_blocks=pool_pages // 6)
    sched = Scheduler(config, BlockPool(pool_pages), PATTERN, max_model_len=1024, eos_token_ids=(1,))
    for i in range(6):
        sched.add(Sequence(f"s{i}", [7] * prompt, SamplingParams(max_tokens=length - prompt, ignore_eos=True)))
    most_running, preempted = 0, 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted)
        most_running = max(most_running, len(sched.running))
        sched.update(out, {s.seq.request_id: 7 for s in out.scheduled if s.samples})
    assert most_running == 6 and preempted == 0
