"""The decoder's start-up steps on scratch sequences: timed on a CPU to choose its step threads, untimed on an
accelerator to load its kernels before the first request.

Owns: the steps timed to choose the threads of each kind of step (`runtime.step_threads`): a prefill chunk
and a light decode of one short scratch sequence, and a heavy decode of a batch of longer ones where the
pool has room; and the accelerator's warm-up, a prefill chunk and a decode of one scratch sequence, each
sampled. The scratch sequences hold KV pages only while they run, and their KV is never computed:
a step's time does not depend on the values it reads. Does not own the choice (StepThreads) nor the
trials while serving (`runtime.thread_trials`).
"""

from __future__ import annotations

from mmserve.decoder.model_runner import ModelRunner
from mmserve.decoder.sampler import Sampler
from mmserve.decoder.scheduler import Scheduler
from mmserve.decoder.sequence import Sequence
from mmserve.messages import SamplingParams

PROMPT_TOKENS = 128  # the light decode's context and the prefill chunk (tokens)
HEAVY_CONTEXT = 1024  # each of the heavy decode's sequences (tokens)
_WARM_ROWS = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9))  # the warm-up's draws


def calibrate_threads(runner: ModelRunner, scheduler: Scheduler, token_id: int) -> None:
    """Fill the step thread counts the config left open; counts stay open (all threads) where the pool or
    the model's length leaves no room for the scratch sequences."""
    config = scheduler.config
    n = min(PROMPT_TOKENS, config.max_num_batched_tokens, scheduler.max_seq_len - 1)
    light = _scratch(scheduler, 1, n, token_id) if n >= 2 else []
    if not light:
        return
    [seq] = light
    long = min(HEAVY_CONTEXT, scheduler.max_seq_len - 1)
    batch: list[Sequence] = []

    def run(start: int) -> None:
        seq.num_computed_tokens = start
        runner.execute([(seq, n - start)])

    def decode_batch() -> None:
        for s in batch:
            s.num_computed_tokens = long - 1
        runner.execute([(s, 1) for s in batch])

    try:
        if long > n:
            batch = _scratch(scheduler, min(config.max_num_seqs, config.small_step_tokens), long, token_id)
        heavy = (decode_batch, n, len(batch) * long) if len(batch) > 1 else None
        runner.threads.calibrate(small_step=lambda: run(n - 1), big_step=lambda: run(0), heavy_step=heavy)
    finally:
        _release(scheduler, [*light, *batch])


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


def _scratch(scheduler: Scheduler, count: int, tokens: int, token_id: int) -> list[Sequence]:
    """`count` scratch sequences of `tokens` tokens holding their KV pages, or [] if the pool lacks room."""
    seqs: list[Sequence] = []
    try:
        for i in range(count):
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
    _release(scheduler, seqs)  # no room for all of them
    return []


def _release(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    for seq in seqs:
        scheduler.kv.release(seq.blocks)
