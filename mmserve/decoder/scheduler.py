"""Continuous-batching FCFS scheduler of the decoder: who computes which tokens in the next step.

Owns: the waiting and running queues, admission, chunked prefill (where a chunk ends: chunking.py),
KV-page allocation per step (what each layer kind needs, through `KVBlockManager`), returning pages
that fell out of the sliding window after each step, preemption (recompute policy), and finishing on
eos / stop tokens / max_tokens / max_model_len. Does not own: the model forward and sampling (the model runner), stop
strings (the output processor calls `finish`), nor the K/V tensors (only page ids).

One rule covers every case: a sequence computes its `num_tokens - num_computed_tokens` remaining
tokens, as many per step as the budget allows; when a step reaches `num_tokens` a token is sampled.
A decode has exactly 1 left; a preempted sequence (blocks freed, `num_computed_tokens` back to 0,
generated tokens kept) re-prefills prompt + outputs.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

from mmserve.config import DecoderConfig
from mmserve.decoder.block_pool import BlockPool
from mmserve.decoder.chunking import awaits_embeddings, chunk_tokens, lacking
from mmserve.decoder.kv_blocks import KVBlockManager
from mmserve.decoder.prefix_cache import BlockHasher, PrefixCache
from mmserve.decoder.sequence import Sequence, SequenceStatus
from mmserve.errors import CapacityError, InvalidRequestError, PromptTooLongError
from mmserve.messages import FinishReason
from mmserve.models.base import AttentionPattern

FINISHED_PLACES = 1024  # finished sequences whose queue places a request's later choice may still take (sequences)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, from `start` (tokens)
    start: int = field(init=False)  # seq.num_computed_tokens when scheduled (tokens)
    samples: bool = field(init=False)  # this chunk reaches num_tokens: a token is sampled for it

    def __post_init__(self) -> None:
        start = self.seq.num_computed_tokens
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "samples", start + self.num_new_tokens == self.seq.num_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # running ones (decodes first, as `schedule` says), then those admitted
    preempted: list[str]  # request ids sent back to the queue this step (their blocks are freed)
    # sequences that lack embeddings their next chunks need (their items' placeholders were cached when
    # the request came, and the cache let them go since): (sequence, feature indices)
    missing: list[tuple[Sequence, list[int]]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerStats:
    running: int  # sequences holding KV pages
    waiting: int  # queued or preempted sequences
    free_blocks: int  # KV pages no sequence holds, cached ones included (pages: one layer's block each)
    total_blocks: int  # KV pages in the pool
    cached_blocks: int  # prefix-cache entries, held or not (blocks of one layer kind)
    prefix_queries: int  # prompt tokens looked up in the prefix cache at first admission (tokens)
    prefix_hits: int  # of those, found cached (tokens)


class Scheduler:
    def __init__(self, config: DecoderConfig, block_pool: BlockPool, pattern: AttentionPattern,
                 max_model_len: int, eos_token_ids: tuple[int, ...], hasher: BlockHasher | None = None,
                 decodes_first: bool = False) -> None:
        self.config = config
        # NOTE: decodes before prefill chunks needs a budget that leaves a chunk room beside every decode
        # (`chunking.decodes_leave_room`, which the Decoder asks); else, and by default, running sequences take
        # the budget in arrival order
        self.decodes_first = decodes_first
        self.block_size = config.block_size
        self.pool = block_pool
        self.hasher = hasher if config.enable_prefix_caching else None  # None: no prefix caching
        cache = PrefixCache(block_pool) if self.hasher is not None else None
        self.kv = KVBlockManager(block_pool, pattern, config.block_size, cache)
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / found (tokens)
        self._asks: list[tuple[Sequence, list[int]]] = []  # embeddings found missing at admission, this step
        self.max_model_len = max_model_len  # tokens the model's positions allow
        # NOTE: a sequence may never hold more tokens than the pool either; capping its length there
        # means a sequence alone in the pool always fits, so preemption can never livelock. It then
        # finishes with "length" when it fills the pool.
        self.max_seq_len = self.kv.max_tokens_alone(config.max_num_batched_tokens, max_model_len)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by arrival_order; preempted ones go back in place
        self.running: list[Sequence] = []  # sorted by arrival_order; the tail is preempted first
        self._seqs: dict[str, Sequence] = {}  # unfinished sequences by request id
        self._finished: OrderedDict[str, int] = OrderedDict()  # the latest finished ones' arrival orders, by id
        self._next_arrival = 0

    # ---- joining and leaving -------------------------------------------------------------------

    def add(self, seq: Sequence, sibling: str | None = None) -> None:
        """Queue a new sequence; raise if it could never be scheduled. `sibling`: the request id of another
        choice of the same request (`n` > 1), scheduled or among the latest finished: the new one queues in its place.

        NOTE: a request's later choices start once its first has prefilled (the decoder service), so that they
        share its prompt's blocks; by arrival they would queue behind every request sent meanwhile, and be the
        first preempted. They keep their request's place instead, as the choices of one request do in vLLM.
        """
        if seq.request_id in self._seqs:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        self._check_schedulable(seq)
        seq.blocks = self.kv.new_blocks()
        if self.hasher is not None:
            self.hasher.extend(seq.block_hashes, seq.token_ids, seq.features, seq.cache_salt)
        placed = self._seqs.get(sibling) if sibling is not None else None
        order = placed.arrival_order if placed is not None else self._finished.get(sibling or "")
        if order is None:
            order, self._next_arrival = self._next_arrival, self._next_arrival + 1
        seq.arrival_order = order
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.request_id] = seq
        bisect.insort(self.waiting, seq, key=_arrival)

    def finish(self, request_id: str, reason: FinishReason) -> Sequence | None:
        """End a request now (stop string, abort); returns it, or None if unknown or already done."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[request_id]
        self._finished[request_id] = seq.arrival_order  # NOTE: a later choice may still take its place
        if len(self._finished) > FINISHED_PLACES:
            self._finished.popitem(last=False)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        return self.finish(request_id, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def stats(self) -> SchedulerStats:
        cache = self.kv.cache
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.num_free, self.pool.num_blocks,
                              len(cache.entries) if cache is not None else 0, self.prefix_queries, self.prefix_hits)

    # ---- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running sequences first (with `decodes_first` their decodes, then their
        prefills' next chunks, each in arrival order; else in arrival order), then admit waiting ones.

        NOTE: decodes before chunks: a long prompt's chunk, which takes all the budget it is left, would else
        stop every decode that arrived after it for as many steps as its prefill lasts (vLLM bounds the same
        with `long_prefill_token_threshold`). A chunk that must preempt takes the latest arrivals, as always,
        and one already scheduled this step gives its tokens back. With a budget that leaves no room for an
        image beside every decode (`decodes_first` off) running sequences go in arrival order instead: a
        prefill's image would else wait for as long as new chats keep arriving.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        preempted: list[str] = []
        for seq in sorted(self.running, key=_prefilling) if self.decodes_first else list(self.running):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted by an earlier one's growth
                continue
            n = chunk_tokens(seq, budget)
            taken = len(preempted)
            if n > 0 and self._grow_or_preempt(seq, n, preempted):
                scheduled[seq.request_id] = ScheduledSeq(seq, n)
                budget -= n
            for rid in preempted[taken:]:
                if (victim := scheduled.pop(rid, None)) is not None:
                    budget += victim.num_new_tokens
        admitted = [] if preempted else self._admit(budget)  # NOTE: a pool that just ran dry admits nobody
        missing, self._asks = self._asks, []
        return SchedulerOutput([*scheduled.values(), *admitted], preempted, missing)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Record a finished step: advance progress, append sampled tokens, finish and free.

        `sampled` maps request id -> token for every scheduled sequence whose chunk reached its end.
        Returns the sequences that finished in this step.
        """
        finished: list[Sequence] = []
        for item in output.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens = item.start + item.num_new_tokens
            if self.hasher is not None:  # index the blocks this step completed, before the window lets go
                self.hasher.extend(seq.block_hashes, seq.token_ids, seq.features, seq.cache_salt)
                self.kv.index(seq.blocks, seq.block_hashes, seq.num_computed_tokens)
            self.kv.trim(seq.blocks, seq.num_computed_tokens)  # the next query sits there
            if not item.samples:
                continue
            if seq.request_id not in sampled:
                raise KeyError(f"no sampled token for {seq.request_id!r}, whose prefill completed")
            seq.token_ids.append(sampled[seq.request_id])
            reason = self._finish_reason(seq)
            if reason is not None:
                self.finish(seq.request_id, reason)
                finished.append(seq)
        return finished

    # ---- internals -------------------------------------------------------------------------------

    def check_length(self, n: int) -> None:
        """Raise for a prompt of `n` tokens that no state of the pool could take: empty, past the model's length,
        or past what the pool holds for one sequence alone. NOTE: reads constants only: any thread may ask."""
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n > self.max_model_len:
            raise PromptTooLongError(f"the prompt has {n} tokens; this model accepts at most "
                                     f"{self.max_model_len}")
        if n > self.max_seq_len:
            raise CapacityError(f"the prompt needs {self.kv.peak_pages(n, self.config.max_num_batched_tokens)} "
                                f"KV blocks (of one layer each); the pool has {self.pool.num_blocks} "
                                f"({self.max_seq_len} tokens)")

    def _check_schedulable(self, seq: Sequence) -> None:
        self.check_length(seq.num_prompt_tokens)
        budget = self.config.max_num_batched_tokens
        longest = max((end - start for start, end in seq.atomic_spans), default=0)
        if longest > budget:
            raise CapacityError(
                f"an image's {longest} tokens attend to each other both ways and must be computed in one "
                f"decoder step, which computes at most {budget} tokens (max_num_batched_tokens)")

    def _pages_needed(self, seq: Sequence, num_new: int) -> int:
        return self.kv.pages_to_grow(seq.blocks, seq.num_computed_tokens + num_new)

    def _grow_or_preempt(self, seq: Sequence, num_new: int, preempted: list[str]) -> bool:
        """Give a running `seq` the blocks for `num_new` tokens, preempting the latest arrivals.

        Returns False when `seq` itself had to be preempted (it was the latest arrival left).
        """
        needed = self._pages_needed(seq, num_new)
        while not self.kv.can_allocate(needed):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                return False
        self.kv.grow(seq.blocks, seq.num_computed_tokens + num_new)
        return True

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        """Move waiting sequences to running, FCFS, while seats, budget and blocks allow.

        NOTE: strict FCFS for room: nobody overtakes a sequence waiting for seats, budget or blocks (else a long
        prompt would wait for ever behind short ones). One that waits for embeddings it lacks (a prefix hit the
        cache let go since its arrival, being fetched) is passed over meanwhile: it holds up nobody's room.
        """
        admitted: list[ScheduledSeq] = []
        k = 0  # the first waiting sequence not passed over
        while k < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[k]
            hit = self._start_from_cache(seq)
            n = chunk_tokens(seq, budget)
            needed = max(self._pages_needed(seq, n), self._prefill_pages(seq))
            if n == 0 or not self.kv.can_allocate(needed):
                self.kv.release(seq.blocks)  # the cached prefix it took, if any: held again next step
                seq.num_computed_tokens = 0
                if n == 0 and awaits_embeddings(seq, hit):
                    k += 1
                    continue
                break
            if seq.num_cached_tokens is None:  # its first admission: what the request's usage reports
                seq.num_cached_tokens = min(hit, seq.num_prompt_tokens)
                self.prefix_queries += seq.num_prompt_tokens
                self.prefix_hits += seq.num_cached_tokens
            self.waiting.pop(k)
            self.kv.grow(seq.blocks, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            admitted.append(ScheduledSeq(seq, n))
            budget -= n
        return admitted

    def _prefill_pages(self, seq: Sequence) -> int:
        """Pages `seq` may still have to take before its prefill ends: its peak less what it holds (a cached prefix).

        NOTE: admitted on its first chunk alone, a long prompt that the pool cannot carry to its end is preempted
        by its own next chunk (it is the latest arrival), then admitted again: its first chunk is computed again
        and again, every other step, until others finish (a preemption storm; docs/benchmarks.md). So it waits
        for the pages its whole prefill takes; a sequence alone in the pool always has them (`max_seq_len`).
        NOTE: a cached sliding-layer block that another sequence holds too costs the pool nothing now, but once
        this one's window has passed it, it takes a new page in its place: not counted as held if it will be.
        """
        peak = self.kv.peak_pages(seq.num_tokens, self.config.max_num_batched_tokens)
        return max(peak - self.kv.pages_in_hand(seq.blocks, seq.num_tokens), 0)

    def _start_from_cache(self, seq: Sequence) -> int:
        """Take the longest cached prefix of a sequence that holds nothing (at least its last token is
        computed, so that there are logits to sample from); returns its tokens. Items it lacks the
        embeddings of and the prefix does not wholly cover are asked for now, before any chunk needs them."""
        hit = self.kv.start_from_cache(seq.blocks, seq.block_hashes, (seq.num_tokens - 1) // self.block_size)
        seq.num_computed_tokens = hit
        needed = [i for i in lacking(seq)
                  if seq.features[i].placeholder.offset + seq.features[i].placeholder.length > hit]
        if needed:
            self._asks.append((seq, needed))
        return hit

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_arrival)

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq.blocks)

    def is_stop_token(self, seq: Sequence, token: int) -> bool:
        """Whether `token` ends `seq`: one of its stop token ids, or the model's end (unless it ignores that)."""
        params = seq.sampling
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        params = seq.sampling
        if self.is_stop_token(seq, seq.token_ids[-1]):
            return "stop"
        if len(seq.token_ids) - seq.num_prompt_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_seq_len:
            return "length"
        return None


def _arrival(seq: Sequence) -> int:
    return seq.arrival_order


def _prefilling(seq: Sequence) -> bool:
    """Whether a running `seq` has more than its next token to compute (a prefill's chunks, or a recompute)."""
    return seq.num_tokens - seq.num_computed_tokens > 1

