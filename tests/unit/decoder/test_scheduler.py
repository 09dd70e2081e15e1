"""Scheduler: continuous batching, budgets, chunked prefill, image spans, preemption, finishing."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from mmserve.config import DecoderConfig
from mmserve.decoder.block_pool import BlockPool
from mmserve.decoder.chunking import check_image_budget, decodes_leave_room
from mmserve.decoder.scheduler import Scheduler, SchedulerOutput
from mmserve.decoder.sequence import Sequence, SequenceStatus
from mmserve.errors import CapacityError, PromptTooLongError
from mmserve.messages import MultiModalFeatureSpec, PlaceholderRange, SamplingParams
from mmserve.models.base import FULL, AttentionPattern, ModelSpec

EOS = (1, 106)
# One full-attention layer: a page is a block, as the block arithmetic of these tests counts them.
ONE_FULL_LAYER = AttentionPattern(layer_kinds=(FULL,), sliding_window=None, bidirectional_images=True,
                                  scaling=1.0, softcap=None)
TOKEN = 7  # what the fake model samples unless told otherwise


def make_scheduler(*, budget: int = 64, seqs: int = 8, block_size: int = 4, blocks: int = 64,
                   max_model_len: int = 1024, decodes_first: bool = True) -> Scheduler:
    return Scheduler(DecoderConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=block_size,
                                   num_blocks=blocks), BlockPool(blocks), ONE_FULL_LAYER, max_model_len, EOS,
                     decodes_first=decodes_first)


def make_seq(rid: str, n: int, *, spans: tuple[tuple[int, int], ...] = (), **sampling) -> Sequence:
    sampling.setdefault("max_tokens", 4)
    features = [MultiModalFeatureSpec(f"img{i}", "image", PlaceholderRange(o, ln), ln)
                for i, (o, ln) in enumerate(spans)]
    return Sequence(rid, [100 + i % 50 for i in range(n)], SamplingParams(**sampling), features,
                    atomic_spans=[(o, o + ln) for o, ln in spans])


class Driver:
    """Runs steps like the engine would, checking invariants and recording every chunk."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.chunks: dict[str, list[tuple[int, int]]] = {}
        self.preempted: list[str] = []
        self.finished: dict[str, Sequence] = {}

    def step(self, tokens: dict[str, int] | None = None) -> SchedulerOutput:
        out = self.sched.schedule()
        cfg = self.sched.config
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert len(self.sched.running) <= cfg.max_num_seqs
        for item in out.scheduled:
            seq = item.seq
            assert item.num_new_tokens > 0 and seq.status is SequenceStatus.RUNNING
            assert seq.blocks.num_pages == -(-(item.start + item.num_new_tokens) // self.sched.block_size)
            self.chunks.setdefault(seq.request_id, []).append((item.start, item.start + item.num_new_tokens))
        self.preempted += out.preempted
        sampled = {s.seq.request_id: (tokens or {}).get(s.seq.request_id, TOKEN)
                   for s in out.scheduled if s.samples}
        for seq in self.sched.update(out, sampled):
            self.finished[seq.request_id] = seq
        self.check_blocks()
        return out

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps

    def check_blocks(self) -> None:
        held = [int(p) for s in self.sched.running for t in s.blocks.tables for p in t.pages[t.lo : t.hi].ravel()]
        assert len(held) == len(set(held))
        assert len(held) + self.sched.pool.num_free == self.sched.pool.num_blocks
        assert all(s.blocks.num_pages == 0 for s in self.sched.waiting)
        for seq in self.sched.running:
            assert seq.blocks.num_pages == -(-seq.num_computed_tokens // self.sched.block_size)


def seq_of(sched: Scheduler, rid: str, lookup: Callable[[str], Sequence | None] | None = None) -> Sequence:
    """The sequence `lookup(rid)` returns (default: the scheduler's own), which must exist."""
    seq = (lookup or sched.get)(rid)
    assert seq is not None, rid
    return seq


def ids(out: SchedulerOutput) -> list[str]:
    return [s.seq.request_id for s in out.scheduled]


def test_requests_join_and_leave_between_steps() -> None:
    sched = make_scheduler()
    d = Driver(sched)
    sched.add(make_seq("a", 5, max_tokens=10))
    assert ids(d.step()) == ["a"]
    sched.add(make_seq("b", 3, max_tokens=10))
    out = d.step()
    assert ids(out) == ["a", "b"] and [s.num_new_tokens for s in out.scheduled] == [1, 3]
    assert sched.abort("a") is not None
    assert ids(d.step()) == ["b"]
    assert sched.stats().running == 1 and sched.stats().waiting == 0
    assert sched.abort("a") is None and sched.abort("nope") is None
    sched.abort("b")
    assert not sched.has_unfinished()
    assert sched.stats().free_blocks == sched.stats().total_blocks == 64


def test_budget_and_chunked_prefill_reach_every_token() -> None:
    rng = random.Random(0)
    sched = make_scheduler(budget=32, seqs=4, blocks=256)
    d = Driver(sched)
    lengths = {f"r{i}": rng.randint(1, 100) for i in range(12)}
    for rid, n in lengths.items():
        sched.add(make_seq(rid, n, max_tokens=3))
    d.run()
    assert set(d.finished) == set(lengths)
    for rid, chunks in d.chunks.items():
        assert chunks[0][0] == 0
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks)), "chunks contiguous"
        assert chunks[-1][1] == lengths[rid] + 2  # prompt + 3 outputs, the last one never computed
        assert d.finished[rid].finish_reason == "length" and len(d.finished[rid].output_token_ids) == 3
    assert any(len([c for c in cs if c[1] - c[0] > 1]) > 1 for cs in d.chunks.values()), "some chunking"
    assert sched.pool.num_free == 256


def test_image_span_is_never_split() -> None:
    rng = random.Random(1)
    sched = make_scheduler(budget=24, seqs=3, blocks=512)
    d = Driver(sched)
    spans: dict[str, tuple[tuple[int, int], ...]] = {}
    for i in range(10):
        pos, parts = rng.randint(0, 5), []
        for _ in range(rng.randint(1, 4)):
            length = rng.choice([4, 16, 24])  # 24 = the whole budget
            parts.append((pos, length))
            pos += length + rng.randint(0, 7)
        spans[f"r{i}"] = tuple(parts)
        sched.add(make_seq(f"r{i}", pos + rng.randint(1, 5), spans=tuple(parts), max_tokens=2))
    d.run()
    assert set(d.finished) == set(spans)
    for rid, chunks in d.chunks.items():
        for _, end in chunks:
            assert not any(o < end < o + ln for o, ln in spans[rid]), (rid, end, spans[rid])


def test_chunk_stops_before_a_span_that_does_not_fit() -> None:
    sched = make_scheduler(budget=10)
    d = Driver(sched)
    sched.add(make_seq("a", 20, spans=((6, 8),)))
    assert [s.num_new_tokens for s in d.step().scheduled] == [6]  # not 10: that would cut [6, 14)
    assert [s.num_new_tokens for s in d.step().scheduled] == [10]  # the span whole, plus 2


def test_item_splits_between_its_crops_not_inside_one() -> None:
    """Only a run of image tokens is atomic: one item's crops (a placeholder of 2 runs and the text
    between them, 22 tokens) go to different steps when the budget holds one run but not the item."""
    sched = make_scheduler(budget=12)
    d = Driver(sched)
    features = [MultiModalFeatureSpec("img0", "image", PlaceholderRange(2, 22), 20)]
    seq = Sequence("a", [100 + i for i in range(30)], SamplingParams(max_tokens=1), features,
                   atomic_spans=[(2, 12), (14, 24)])
    sched.add(seq)  # the whole item (22 tokens) would not fit a step of 12
    assert [s.num_new_tokens for s in d.step().scheduled] == [12]  # [0, 12): text + the first crop
    assert [s.num_new_tokens for s in d.step().scheduled] == [12]  # [12, 24): text + the second crop
    assert [s.num_new_tokens for s in d.step().scheduled] == [6]


def test_span_blocks_head_of_queue_but_not_decodes() -> None:
    sched = make_scheduler(budget=10)
    d = Driver(sched)
    sched.add(make_seq("a", 3, max_tokens=5))
    sched.add(make_seq("b", 12, spans=((0, 10),)))
    assert ids(d.step()) == ["a"]  # 7 tokens left: b's span needs 10, so b waits (no split)
    assert ids(d.step()) == ["a"]  # 9 left
    out = d.step()
    assert ids(out) == ["a"] and sched.stats().waiting == 1
    sched.abort("a")
    assert [s.num_new_tokens for s in d.step().scheduled] == [10]


def test_a_long_prefills_chunks_take_what_the_decodes_leave_never_a_decode() -> None:
    """A document cut before an image leaves room to admit two short chats; its next chunks would take the whole
    budget for steps on end. The chats, admitted after it, still decode every step (a review's scenario)."""
    sched = make_scheduler(budget=64, blocks=256)
    d = Driver(sched)
    sched.add(make_seq("doc", 300, spans=((50, 40),)))
    sched.add(make_seq("b", 5, max_tokens=20))
    sched.add(make_seq("c", 5, max_tokens=20))
    out = d.step()  # the doc's chunk ends before its image (50 tokens); the chats take the 14 left
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("doc", 50), ("b", 5), ("c", 5)]
    while seq_of(sched, "doc").num_computed_tokens < 300:
        out = d.step()
        assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled][:2] == [("b", 1), ("c", 1)]
        assert out.num_batched_tokens == 64 or seq_of(sched, "doc").num_computed_tokens == 300


@pytest.mark.parametrize("decodes_first", [True, False])
def test_a_budget_with_no_room_for_an_image_beside_the_decodes_serves_in_arrival_order(decodes_first: bool) -> None:
    """A budget under an image plus the decodes (warned of at start): decodes first, the document's image would
    wait for as long as new chats keep coming; such a Decoder serves its running sequences in arrival order."""
    sched = make_scheduler(budget=40, seqs=8, blocks=256, decodes_first=decodes_first)
    d = Driver(sched)
    sched.add(make_seq("doc", 60, spans=((20, 40),)))
    for k in range(30):
        if k % 3 == 0:
            sched.add(make_seq(f"c{k}", 5, max_tokens=6, ignore_eos=True))
        d.step()
    doc = sched.get("doc")
    assert (doc is None or doc.num_computed_tokens == 60) is not decodes_first  # None: it has even finished


def test_a_chunk_that_preempts_a_decode_scheduled_before_it_leaves_it_out_of_the_step() -> None:
    """Decodes go first; a prefill that arrived earlier and must grow preempts the latest arrival, which may be a
    decode this step already took: it leaves the step (its blocks are gone) and waits, as before."""
    sched = make_scheduler(budget=16, block_size=4, blocks=6)
    d = Driver(sched)
    sched.add(make_seq("doc", 20, spans=((8, 12),)))
    sched.add(make_seq("b", 4, max_tokens=20))
    assert [(s.seq.request_id, s.num_new_tokens) for s in d.step().scheduled] == [("doc", 8), ("b", 4)]
    out = d.step()  # b's decode takes a second page; the doc's span then needs 3 of the 2 left: b goes
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("doc", 12)]
    assert out.preempted == ["b"] and seq_of(sched, "b").status is SequenceStatus.WAITING
    d.run()
    assert set(d.finished) == {"doc", "b"}


def test_preemption_under_a_tiny_pool_then_completion() -> None:
    sched = make_scheduler(budget=64, block_size=4, blocks=8)
    d = Driver(sched)
    for rid in "abc":
        sched.add(make_seq(rid, 8, max_tokens=12))  # each ends holding 5 of the 8 blocks
    out = d.step()
    assert ids(out) == ["a", "b", "c"]  # 2 blocks each: 6 of 8
    victims = []
    for _ in range(200):
        out = d.step()
        victims += out.preempted
        if victims:
            break
    assert victims[0] == "c", "the latest-arrived running sequence is preempted"
    b = sched.get("c")
    assert b is not None and b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.blocks.num_pages == 0 and len(b.output_token_ids) > 0, "outputs kept for recompute"
    assert set(d.preempted) <= {"b", "c"}, "a, the oldest, is never preempted"
    d.run()
    assert {rid: len(s.output_token_ids) for rid, s in d.finished.items()} == dict.fromkeys("abc", 12)
    assert all(s.finish_reason == "length" for s in d.finished.values())
    re_prefill = [c for c in d.chunks["c"] if c[0] == 0]
    assert len(re_prefill) >= 2 and re_prefill[-1][1] > 8, "c re-prefilled prompt + outputs"
    assert sched.pool.num_free == 8


def test_latest_arrival_preempts_itself_never_an_earlier_one() -> None:
    sched = make_scheduler(budget=64, block_size=2, blocks=5)
    d = Driver(sched)
    sched.add(make_seq("a", 4, max_tokens=20))
    sched.add(make_seq("b", 3, max_tokens=20))
    d.step()
    d.step()  # a at 5 computed (3 blocks), b at 4 (2 blocks): the pool is dry
    out = d.step()  # a fits its 3 blocks; b needs a 3rd and is the latest arrival: it yields
    assert out.preempted == ["b"] and ids(out) == ["a"]
    assert sched.running == [sched.get("a")] and seq_of(sched, "b").status is SequenceStatus.WAITING
    out = d.step()  # a needs a 4th block: b's freed ones; nobody is admitted while the pool is short
    assert ids(out) == ["a"] and out.preempted == []


def test_a_prompt_the_pool_cannot_carry_to_its_end_waits_instead_of_being_preempted_by_its_own_chunks() -> None:
    """Its first chunk fits, its whole prefill does not: admitted, its next chunk would preempt it (the latest
    arrival) and it would come back for its first chunk again, step after step, while `a` decodes."""
    sched = make_scheduler(budget=8, block_size=4, blocks=10)
    d = Driver(sched)
    sched.add(make_seq("a", 16, max_tokens=8))  # ends holding 6 of the 10 blocks
    sched.add(make_seq("b", 24, max_tokens=2))  # 2 blocks a chunk, 7 in all: only once a has finished
    for _ in range(4):
        out = d.step()
        assert "b" not in ids(out) and out.preempted == []
    d.run()
    assert d.preempted == [] and [c for c in d.chunks["b"] if c[0] == 0] == [(0, 8)]  # its first chunk, once
    assert d.finished["a"].finish_reason == d.finished["b"].finish_reason == "length"


def test_sequence_stops_at_the_pool_size_instead_of_livelocking() -> None:
    sched = make_scheduler(block_size=4, blocks=3, max_model_len=100)
    d = Driver(sched)
    sched.add(make_seq("a", 5, max_tokens=50))
    d.run()
    assert d.finished["a"].finish_reason == "length" and d.finished["a"].num_tokens == 12
    assert sched.pool.num_free == 3


def test_abort_waiting_running_and_mid_prefill_returns_every_block() -> None:
    sched = make_scheduler(budget=16, seqs=2, blocks=32)
    d = Driver(sched)
    sched.add(make_seq("run", 4, max_tokens=50))
    sched.add(make_seq("long", 40, max_tokens=50))
    sched.add(make_seq("wait", 4, max_tokens=50))
    d.step()
    d.step()
    long = sched.get("long")
    assert long is not None and 0 < long.num_computed_tokens < 40, "mid-prefill"
    assert seq_of(sched, "wait").status is SequenceStatus.WAITING
    assert seq_of(sched, "wait", sched.abort).finish_reason == "abort"
    assert seq_of(sched, "long", sched.abort).status is SequenceStatus.FINISHED
    out = sched.schedule()
    assert sched.abort("run") is not None  # aborted while its step runs
    assert sched.update(out, {"run": TOKEN}) == []
    assert not sched.has_unfinished() and sched.pool.num_free == 32


def test_capacity_errors_at_add() -> None:
    sched = make_scheduler(budget=16, block_size=4, blocks=8, max_model_len=100)
    with pytest.raises(CapacityError, match="max_num_batched_tokens"):
        sched.add(make_seq("img", 30, spans=((2, 17),)))
    with pytest.raises(CapacityError, match="KV blocks"):
        sched.add(make_seq("big", 33))
    with pytest.raises(PromptTooLongError):
        make_scheduler(max_model_len=10).add(make_seq("long", 11))
    sched.add(make_seq("ok", 32, spans=((0, 16),)))
    with pytest.raises(ValueError, match="already"):
        sched.add(make_seq("ok", 3))
    assert sched.stats().waiting == 1


def test_max_model_len_ends_generation_with_length() -> None:
    sched = make_scheduler(max_model_len=10)
    d = Driver(sched)
    sched.add(make_seq("a", 7, max_tokens=100))  # not an error: stops at the context
    sched.add(make_seq("b", 10, max_tokens=100))  # a full context still yields one token
    d.run()
    assert d.finished["a"].num_tokens == 10 and d.finished["a"].finish_reason == "length"
    assert len(d.finished["b"].output_token_ids) == 1 and d.finished["b"].finish_reason == "length"


@pytest.mark.parametrize(
    ("sampling", "tokens", "reason", "n_out"),
    [
        ({}, [5, 5, 5, 5, 5], "length", 4),
        ({}, [5, 106], "stop", 2),  # <end_of_turn>
        ({}, [1], "stop", 1),  # <eos>
        ({"stop_token_ids": (9,)}, [5, 9], "stop", 2),
        ({"ignore_eos": True}, [1, 106, 5, 1], "length", 4),
        ({"ignore_eos": True, "stop_token_ids": (9,)}, [1, 9], "stop", 2),
        ({}, [5, 5, 5, 106], "stop", 4),  # the end on the last token allowed is a stop, not the length
        ({"stop_token_ids": (9,)}, [5, 5, 5, 9], "stop", 4),
    ],
)
def test_finish_conditions(sampling: dict, tokens: list[int], reason: str, n_out: int) -> None:
    sched = make_scheduler()
    d = Driver(sched)
    sched.add(make_seq("a", 5, max_tokens=4, **sampling))
    for token in tokens:
        if not sched.has_unfinished():
            break
        d.step({"a": token})
    assert d.finished["a"].finish_reason == reason
    assert d.finished["a"].output_token_ids == tokens[:n_out]
    assert sched.pool.num_free == 64


def test_finish_by_stop_string_frees_blocks() -> None:
    sched = make_scheduler()
    d = Driver(sched)
    sched.add(make_seq("a", 5, max_tokens=40))
    d.step()
    seq = sched.finish("a", "stop")
    assert seq is not None and seq.finish_reason == "stop" and seq.is_finished and seq.blocks.num_pages == 0
    assert sched.finish("a", "stop") is None
    assert sched.stats().free_blocks == 64 and sched.schedule().is_empty


def test_missing_sample_is_an_error() -> None:
    sched = make_scheduler()
    sched.add(make_seq("a", 5))
    out = sched.schedule()
    with pytest.raises(KeyError, match="no sampled token"):
        sched.update(out, {})


def test_max_num_seqs_caps_admission() -> None:
    sched = make_scheduler(seqs=2)
    d = Driver(sched)
    for rid in "abc":
        sched.add(make_seq(rid, 3, max_tokens=2))
    assert ids(d.step()) == ["a", "b"]
    assert ids(d.step()) == ["a", "b"]  # both finish here
    assert ids(d.step()) == ["c"]


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_keeps_every_invariant(seed: int) -> None:
    """Joins, aborts, stop-string finishes and preemptions in random order; the pool ends full."""
    rng = random.Random(seed)
    sched = make_scheduler(budget=24, seqs=4, block_size=4, blocks=24, max_model_len=80)
    d = Driver(sched)
    added = 0
    for _ in range(400):
        if added < 30 and rng.random() < 0.3:
            n = rng.randint(1, 40)
            offset = rng.randint(0, n - 1)
            span = ((offset, min(rng.randint(1, 16), n - offset)),) if rng.random() < 0.5 else ()
            sched.add(make_seq(f"r{added}", n, spans=span, max_tokens=rng.randint(1, 30)))
            added += 1
        live = [s.request_id for s in sched.running + sched.waiting]
        if live and rng.random() < 0.05:
            sched.abort(rng.choice(live))
        if live and rng.random() < 0.03:
            sched.finish(rng.choice(live), "stop")
        d.step()
        for rid, chunks in d.chunks.items():
            seq = sched.get(rid) or d.finished.get(rid)
            if seq is not None:
                assert not any(lo < end < hi for _, end in chunks for lo, hi in seq.atomic_spans)
    d.run()
    assert d.preempted, "the tiny pool forces preemptions"
    assert sched.pool.num_free == 24 and not sched.running and not sched.waiting


def test_a_later_choice_of_a_request_queues_in_its_first_choices_place() -> None:
    """The later choices of an n > 1 request join once the first has prefilled: they go ahead of the requests
    sent meanwhile (their request came first), also when the first has ended already."""
    sched = make_scheduler(seqs=1)
    d = Driver(sched)
    sched.add(make_seq("r/0", 5, max_tokens=3))
    assert ids(d.step()) == ["r/0"]  # running: the one seat
    sched.add(make_seq("later", 5))
    sched.add(make_seq("r/1", 5, max_tokens=3), sibling="r/0")
    sched.add(make_seq("r/2", 5, max_tokens=3), sibling="r/0")
    assert [s.request_id for s in sched.waiting] == ["r/1", "r/2", "later"]
    d.run()
    order = [rid for rid in d.finished]
    assert order == ["r/0", "r/1", "r/2", "later"], order
    sched.add(make_seq("after", 5))
    sched.add(make_seq("r/3", 5), sibling="r/0")  # its first choice has finished (one token): its place holds
    sched.add(make_seq("x/1", 5), sibling="x/0")  # a sibling never scheduled here: it queues by arrival
    assert [s.request_id for s in sched.waiting] == ["r/3", "after", "x/1"]


IMAGE_SPEC = ModelSpec("x", "x", image_token_id=9, mm_tokens_per_image=256, vocab_size=16, hidden_size=4,
                       num_layers=1, num_kv_heads=1, head_dim=4, max_model_len=1024, eos_token_ids=(1,),
                       attention=AttentionPattern((FULL,), None, True, 1.0, None))


@pytest.mark.parametrize(("budget", "warned"), [(256 + 7, False), (256 + 6, True)])
def test_a_budget_that_may_leave_an_image_waiting_is_warned_of(budget: int, warned: bool,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mmserve.decoder.chunking"):
        check_image_budget(IMAGE_SPEC, DecoderConfig(max_num_batched_tokens=budget, max_num_seqs=8))
    assert ("at least 263" in caplog.text) is warned


@pytest.mark.parametrize(("budget", "spec", "room"), [
    (263, IMAGE_SPEC, True), (262, IMAGE_SPEC, False),  # an image beside 7 decodes
    (8, replace(IMAGE_SPEC, attention=replace(ONE_FULL_LAYER, bidirectional_images=False)), True),
    (7, replace(IMAGE_SPEC, attention=replace(ONE_FULL_LAYER, bidirectional_images=False)), False),  # a token
])
def test_decodes_go_first_only_where_the_budget_leaves_a_chunk_room(budget: int, spec: ModelSpec, room: bool) -> None:
    assert decodes_leave_room(spec, DecoderConfig(max_num_batched_tokens=budget, max_num_seqs=8)) is room


def test_a_budget_below_one_image_is_refused_at_start() -> None:
    """Every request with an image would be refused, each after its encode."""
    with pytest.raises(ValueError, match="below one image's 256 tokens"):
        check_image_budget(IMAGE_SPEC, DecoderConfig(max_num_batched_tokens=255))



def test_a_failed_fetch_fails_a_sequence_only_while_the_items_lie_ahead_of_it() -> None:
    """A sequence that lacked an item's embeddings may have gone past it on a prefix the cache found after
    its ask: the fetch's failure then only forgets the ask (a preemption that needs them asks again)."""
    from types import SimpleNamespace

    from mmserve.decoder.decoder import Decoder

    seq = make_seq("r", 40, spans=((8, 8), (24, 8)))
    seq.requested.update({0, 1})
    decoder = SimpleNamespace(scheduler=SimpleNamespace(get=lambda rid: seq if rid == "r" else None))
    seq.num_computed_tokens = 16  # past the first image, before the second
    Decoder.fetch_failed(decoder, "r", [0], RuntimeError("encoder lost"))  # type: ignore[arg-type]
    assert seq.requested == {1}
    with pytest.raises(RuntimeError, match="encoder lost"):
        Decoder.fetch_failed(decoder, "r", [1], RuntimeError("encoder lost"))  # type: ignore[arg-type]
    Decoder.fetch_failed(decoder, "gone", [0], RuntimeError("encoder lost"))  # type: ignore[arg-type]
