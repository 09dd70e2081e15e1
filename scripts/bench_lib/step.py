"""The decoder step measured in one process: mmserve's Decoder against transformers' own generate.

Owns: per-token decode time of each at a batch size and context on one checkpoint (the same random
prompt token ids for both), the engine's fixed cost per step on the tiny model, and the KV memory a
sequence holds (per-layer-kind pages against every layer keeping every block). Does not own printing.

transformers' time per token is taken inside `generate`: a logits processor stamps the clock at each
generated token, and the median gap between stamps (after the first, which follows the prefill) is
its decode step. Ours is the median time of `Decoder.step()` once every sequence is decoding.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mmserve.config import DecoderConfig, EngineConfig
from mmserve.decoder.block_pool import BlockPool
from mmserve.decoder.decoder import Decoder
from mmserve.decoder.scheduler import Scheduler
from mmserve.decoder.sequence import Sequence
from mmserve.messages import DecodeRequest, SamplingParams, StructuredOutput
from mmserve.models.base import FULL, AttentionPattern
from mmserve.runtime.step_threads import BIG, HEAVY, SMALL
from mmserve.stages import StageFactory


@dataclass(frozen=True)
class StepTime:
    ms: float  # median time of one decode step: one token for each of `batch` sequences (ms)
    threads: str  # torch threads it ran with
    weights: str = "fixed"  # mmserve's: the layout its weights took for the cell while serving, or "fixed"


def prompts(batch: int, context: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """(batch, context) token ids away from the special tokens at the bottom of the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(300, vocab, (batch, context), generator=gen)


def hf_step_ms(model: Any, ids: torch.Tensor, new_tokens: int, threads: int) -> StepTime:
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return scores

    torch.set_num_threads(threads)
    ids = ids.to(model.device)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                       logits_processor=LogitsProcessorList([Stamp()]))
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # NOTE: stamps[0] follows the prefill
    return StepTime(statistics.median(gaps) * 1e3, str(threads))


def engine_decoder(model_dir: Path, *, max_num_seqs: int, num_blocks: int, measure_forms: bool = True,
                   settle: bool = True, threads: int | None = None, device: str = "cpu",
                   dtype: str = "float32") -> Decoder:
    """A Decoder as the engine builds it on `device` in `dtype`, in a process of `threads` torch threads (default:
    the calling thread's count now; a Decoder keeps it as the most it may use, `StepThreads.available`); `settle`:
    with its thread counts measured again (`settle_threads`). Leaves torch's thread count in the calling thread as
    it found it."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    config = EngineConfig(model=str(model_dir), device=device, dtype=dtype, decoder=DecoderConfig(
        max_num_seqs=max_num_seqs, num_blocks=num_blocks, measure_matmul_forms=measure_forms))
    stages = StageFactory(config)
    decoder = stages.decoder().decoder
    stages.release_unused()
    if settle:
        settle_threads(decoder)
    # NOTE: then fixed: a trial runs steps at the other count, and those would sit among the timed ones (the
    # weights' layout is taken per cell instead: `settle_layout`)
    decoder.runner.threads.trials = {}
    torch.set_num_threads(before)
    return decoder


def twin_decoder(ours: Decoder, model_dir: Path, *, max_num_seqs: int, num_blocks: int = 1024) -> Decoder:
    """A second Decoder of `model_dir` that steps as `ours` does: the same threads (the most it may use and the
    count of each kind of step), matmul forms and weights' layout."""
    # NOTE: built at `ours`' thread count, not torch's of the moment: the steps before leave that at 1 at times
    # (transformers' one-thread steps, the tiny model's), and a twin built then ran every step on one thread,
    # slower than `ours` (docs/benchmarks.md)
    twin = engine_decoder(model_dir, max_num_seqs=max_num_seqs, num_blocks=num_blocks, measure_forms=False,
                          settle=False, threads=ours.runner.threads.available, device=str(ours.runner.device),
                          dtype=str(ours.kv.keys.dtype).removeprefix("torch."))
    for name in ("small", "big", "heavy", "heavy_rows"):
        setattr(twin.runner.threads, name, getattr(ours.runner.threads, name))
    forms, theirs = twin.runner.model.matmul, ours.runner.model.matmul
    forms.chosen = dict(theirs.chosen)
    forms.packing(theirs.pack_rows)
    twin.runner.model.pack_weights()
    return twin


def settle_threads(decoder: Decoder, most_requests: int = 64, most_heavy_steps: int = 600) -> None:
    """Serve requests until each open thread count's trial has run (and checked any change it chose), as a
    serving Decoder's would after its first requests: short ones (one 128-token prefill chunk and 24 decodes
    each) for the light decodes and the prefill chunks, then one long sequence decoding for the heavy decodes.

    NOTE: the start-up measurement alone is one sample of the machine's minute: on a VM that had just
    started it chose 1 thread where 2 were 1.6x faster (docs/benchmarks.md), and the benchmark's figures
    would carry that."""
    threads, vocab = decoder.runner.threads, decoder.spec.vocab_size
    trials = [t for kind, t in threads.trials.items() if kind in (SMALL, BIG)]
    for i in range(most_requests):
        if all(t.trials and t.pending is None for t in trials):  # NOTE: a change waits for a second trial
            break
        names = start(decoder, prompts(1, 128, vocab, seed=10_000 + i), 24)
        for _ in range(24):
            decoder.step()
        stop(decoder, names)
    heavy = threads.trials.get(HEAVY)
    long = min(2 * threads.heavy_rows, decoder.scheduler.max_seq_len - most_heavy_steps - 8)
    if heavy is None or not threads.heavy_rows or long <= threads.heavy_rows:
        return
    names = start(decoder, prompts(1, long, vocab, seed=20_000), most_heavy_steps)
    for _ in range(most_heavy_steps):
        if heavy.trials and heavy.pending is None:
            break
        decoder.step()
    stop(decoder, names)


def start(decoder: Decoder, ids: torch.Tensor, new_tokens: int, constrained: int = 0,
          structured: StructuredOutput | None = None) -> list[str]:
    """Add `ids.shape[0]` sequences to `decoder`, the first `constrained` of them under `structured`, and run
    their prefill: every one is decoding on return -> the request names (for `stop`)."""
    free = SamplingParams(max_tokens=new_tokens + 8, temperature=0.0, ignore_eos=True)
    names = [f"bench-{i}-{time.monotonic_ns()}" for i in range(ids.shape[0])]
    for i, (name, row) in enumerate(zip(names, ids.tolist(), strict=True)):
        sampling = replace(free, structured=structured) if i < constrained else free
        decoder.add(DecodeRequest(name, row, [], [], sampling))
    while any(s.is_prefill for s in decoder.scheduler.running) or decoder.scheduler.waiting:
        decoder.step()
    return names


def stop(decoder: Decoder, names: list[str]) -> None:
    for name in names:
        decoder.abort(name)


def timed_step(decoder: Decoder) -> float:
    """One `decoder.step()` (s)."""
    started = time.perf_counter()
    decoder.step()
    return time.perf_counter() - started


def our_step_ms(decoder: Decoder, ids: torch.Tensor, new_tokens: int) -> tuple[StepTime, list[int]]:
    """Median decode step with `ids.shape[0]` sequences decoding; and the pages each one held."""
    names = start(decoder, ids, new_tokens)
    pages = [s.blocks.num_pages for s in decoder.scheduler.running]
    threads = decoder.runner.threads
    decode = threads.threads_for(len(names), sum(s.num_tokens for s in decoder.scheduler.running))
    layout = settle_layout(decoder, len(names), decode)
    times = [timed_step(decoder) for _ in range(new_tokens)]
    stop(decoder, names)
    return StepTime(statistics.median(times[2:]) * 1e3, f"{decode}/{threads.big}", layout), pages


def settle_layout(decoder: Decoder, rows: int, threads: int) -> str:
    """The weights in the layout that a Decoder running only steps of `rows` rows at `threads` threads settles
    on while serving (its policy's choice for those steps), taken at once -> which ("packed", "plain", or
    "fixed" where it is not chosen while serving)."""
    layout = decoder.runner.layout
    if layout is None:
        return "fixed"
    # NOTE: a layout losing anything beyond `close` on every step of the cell would be changed after some
    # steps of it (as many as a change's cost takes to lose), and then kept
    layout.finish()
    if layout.policy.excess(rows, threads, layout.packed) > 0:
        layout.take(not layout.packed, at_once=True)
    layout.policy.freeze()  # NOTE: then fixed for the cell's timed steps
    return "packed" if layout.packed else "plain"


def uniform_pages(context: int, num_layers: int, block_size: int) -> int:
    """Pages a sequence held before per-kind tables: every layer kept every block."""
    return -(-context // block_size) * num_layers


def most_long_sequences(pattern: AttentionPattern, config: DecoderConfig, context: int, *,
                        candidates: int = 64) -> tuple[int, int]:
    """(most sequences of `context` tokens decoding at once, preemptions) in a pool of `config.num_blocks`
    blocks on every layer, scheduling only (no model): each step every sequence gets its token."""
    pool = BlockPool(config.num_blocks * len(pattern.layer_kinds))
    sched = Scheduler(config, pool, pattern, max_model_len=context + 64, eos_token_ids=(1,))
    for i in range(candidates):
        sched.add(Sequence(f"s{i}", [7] * context, SamplingParams(max_tokens=32, ignore_eos=True)))
    most, preempted = 0, 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted)
        decoding = sum(1 for s in sched.running if not s.is_prefill)
        most = max(most, decoding)
        sched.update(out, {s.seq.request_id: 7 for s in out.scheduled if s.samples})
    return most, preempted


def all_full(pattern: AttentionPattern) -> AttentionPattern:
    """The same model as if every layer kept every block (how the pool was counted before)."""
    return AttentionPattern((FULL,) * len(pattern.layer_kinds), None, pattern.bidirectional_images,
                            pattern.scaling, pattern.softcap)
