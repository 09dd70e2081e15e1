"""The decoder's start-up steps on scratch sequences: timed on a CPU to choose its step threads and to price
its weights' layouts, untimed on an accelerator to load its kernels before the first request.

Owns: the scratch steps (`scratch_steps`): a prefill chunk of one short scratch sequence and decodes of 1, 2,
4, ... short ones (as many as asked and the pool has room for), and a heavy decode of a batch of longer ones
where the pool has room; timing them to choose the threads of each kind of step (`runtime.step_threads`:
the lone decode, the chunk, the heavy decode) and to price the layouts (`runtime.layout_steps`: the short
decodes and the chunk); and the accelerator's warm-up, a prefill chunk and a decode of one scratch sequence,
each sampled. The scratch sequences hold KV pages only while they run, and their KV is never computed: a
step's time does not depend on the values it reads. Does not own the choices (StepThreads, the layout
policy) nor the trials while serving (`runtime.thread_trials`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mmserve.decoder.model_runner import ModelRunner
from mmserve.decoder.sampler import Sampler
from mmserve.decoder.scheduler import Scheduler
from mmserve.decoder.sequence import Sequence
from mmserve.messages import SamplingParams
from mmserve.runtime.layout_steps import price_by_steps
from mmserve.runtime.weight_layout import WeightLayout

log = logging.getLogger(__name__)
PROMPT_TOKENS = 128  # the light decode's context and the prefill chunk (tokens)
HEAVY_CONTEXT = 1024  # each of the heavy decode's sequences (tokens)
_WARM_ROWS = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9))  # the warm-up's draws


@dataclass(frozen=True)
class ScratchSteps:
    """Steps of the scratch sequences `scratch_steps` holds, each a call that runs one."""

    big: Callable[[], object]  # a prefill chunk: the first short sequence's `prompt` tokens at once
    decodes: dict[int, Callable[[], object]]  # k -> a decode of the first k short sequences (1 new token each)
    heavy: Callable[[], object] | None  # a decode of `batch` sequences of `long` tokens each; None: no room
    prompt: int  # tokens of each short sequence
    batch: int  # sequences of the heavy decode (0 without one)
    long: int  # tokens of each of them

    def by_rows(self) -> dict[int, Callable[[], object]]:
        """new tokens -> a step computing that many: the short decodes, and the prefill chunk where it computes
        more than any of them."""
        rows = dict(self.decodes)
        return rows | ({self.prompt: self.big} if self.prompt > max(rows) else {})


@contextmanager
def scratch_steps(runner: ModelRunner, scheduler: Scheduler, token_id: int, *, short: int = 1,
                  heavy: bool = True) -> Iterator[ScratchSteps | None]:
    """The steps of scratch sequences holding KV pages meanwhile: up to `short` short sequences (as many as the
    pool has room for, decoded 1, 2, 4, ... and all of them at once) and, if `heavy`, a batch of longer ones;
    None where the pool or the model's length leaves no room for one short sequence."""
    config = scheduler.config
    n = min(PROMPT_TOKENS, config.max_num_batched_tokens, scheduler.max_seq_len - 1)
    first = _scratch(scheduler, 1, n, token_id) if n >= 2 else []
    if not first:
        yield None
        return
    held = list(first)
    try:
        seqs = [*first, *(_scratch(scheduler, short - 1, n, token_id, first=1, all_or_none=False)
                          if short > 1 else [])]
        held = list(seqs)
        long = min(HEAVY_CONTEXT, scheduler.max_seq_len - 1)
        most = min(config.max_num_seqs, config.small_step_tokens)
        batch = _scratch(scheduler, most, long, token_id) if heavy and long > n else []
        held += batch
        batch = batch if len(batch) > 1 else []
        yield ScratchSteps(
            big=functools.partial(_prefill, runner, first[0]),
            decodes={k: functools.partial(_decode, runner, seqs[:k]) for k in _sizes(len(seqs))},
            heavy=functools.partial(_decode, runner, batch) if batch else None,
            prompt=n, batch=len(batch), long=long)
    finally:
        _release(scheduler, held)


def _sizes(most: int) -> list[int]:
    """1, 2, 4, ... below `most`, and `most`."""
    return sorted({1 << i for i in range(most.bit_length()) if 1 << i < most} | {most})


def _prefill(runner: ModelRunner, seq: Sequence) -> None:
    seq.num_computed_tokens = 0
    runner.execute([(seq, seq.num_tokens)])


def _decode(runner: ModelRunner, seqs: list[Sequence]) -> None:
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    runner.execute([(seq, 1) for seq in seqs])


def calibrate_threads(runner: ModelRunner, scheduler: Scheduler, token_id: int) -> None:
    """Fill the step thread counts the config left open; counts stay open (all threads) where the pool or
    the model's length leaves no room for the scratch sequences."""
    with scratch_steps(runner, scheduler, token_id) as steps:
        if steps is None:
            return
        heavy = (steps.heavy, steps.prompt, steps.batch * steps.long) if steps.heavy is not None else None
        runner.threads.calibrate(small_step=steps.decodes[1], big_step=steps.big, heavy_step=heavy)


def price_layouts(runner: ModelRunner, scheduler: Scheduler, token_id: int, layout: WeightLayout) -> None:
    """Price the weights' two layouts by scratch steps (`layout_steps.py`): decodes of 1, 2, 4, ... short
    sequences up to the most a small step holds, and a prefill chunk. Where there is no room for one short
    sequence, the policy keeps the products' own timings.
    NOTE: short ones: attention, the same in both layouts, then takes little of a step, and the policy's
    margin (a share of the step) stays near a share of the products."""
    config = scheduler.config
    most = min(config.max_num_seqs, config.small_step_tokens)
    with scratch_steps(runner, scheduler, token_id, short=most, heavy=False) as steps:
        if steps is None:
            return
        if max(steps.decodes) < most:
            log.info("decoder weights: the KV pool had room for %d of %d scratch sequences; steps of more rows are "
                     "priced from theirs", max(steps.decodes), most)
        price_by_steps(layout, runner.threads, steps.by_rows())


def warm_up(runner: ModelRunner, scheduler: Scheduler, token_id: int, sampler: Sampler) -> None:
    """A prefill chunk and a decode of one scratch sequence, each step's logits sampled greedily and drawn and
    read back, untimed.

    NOTE: on an accelerator the first call of each kernel loads it, and the first product starts cuBLAS: work
    that would otherwise fall on the first request (and on a new replica's first, under autoscaling)."""
    n = min(PROMPT_TOKENS, scheduler.config.max_num_batched_tokens, scheduler.max_seq_len - 1)
    scratch = _scratch(scheduler, 1, n, token_id) if n >= 2 else []
    try:
        for seq in scratch:
            for start in (0, n - 1):
                seq.num_computed_tokens = start
                logits = runner.execute([(seq, n - start)]).logits  # (1, vocab)
                sampler.sample(logits.expand(2, -1), list(_WARM_ROWS), [None, None]).tolist()
    finally:
        _release(scheduler, scratch)


def _scratch(scheduler: Scheduler, count: int, tokens: int, token_id: int, *, first: int = 0,
             all_or_none: bool = True) -> list[Sequence]:
    """`count` scratch sequences of `tokens` tokens holding their KV pages (numbered from `first`); where the
    pool lacks room for all of them, [] (`all_or_none`) or as many as it has room for."""
    seqs: list[Sequence] = []
    try:
        for i in range(first, first + count):
            seq = Sequence(f"thread-calibration-{tokens}-{i}", [token_id] * tokens, SamplingParams())
            seq.blocks = scheduler.kv.new_blocks()
            seqs.append(seq)  # NOTE: before it grows: released below whatever it got to hold
            if not scheduler.pool.can_allocate(scheduler.kv.pages_to_grow(seq.blocks, tokens)):
                break
            scheduler.kv.grow(seq.blocks, tokens)
        else:
            return seqs
    except BaseException:
        _release(scheduler, seqs)
        raise
    if all_or_none:
        _release(scheduler, seqs)  # no room for all of them
        return []
    _release(scheduler, seqs[-1:])  # the one without room
    return seqs[:-1]


def _release(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    for seq in seqs:
        scheduler.kv.release(seq.blocks)
