"""The decoder step measured in one process: mmserve's Decoder against transformers' own generate.

Owns: per-token decode time of each at a batch size and context on one checkpoint (the same random
prompt token ids for both), the engine's fixed cost per step on the tiny model, and the KV memory a
sequence holds (per-layer-kind pages against every layer keeping every block). Does not own printing.

transformers' time per token is taken inside `generate`: a logits processor stamps the clock at each
generated token, and the median gap between stamps (after the first, which follows the prefill) is
its decode step. Ours is the median time of `Decoder.step()` once every sequence is decoding.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import time
from collections.abc import Iterator
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
from mmserve.stages import StageFactory


@dataclass(frozen=True)
class StepTime:
    ms: float  # median time of one decode step: one token for each of `batch` sequences (ms)
    threads: str  # torch threads it ran with


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
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                       logits_processor=LogitsProcessorList([Stamp()]))
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]  # NOTE: stamps[0] follows the prefill
    return StepTime(statistics.median(gaps) * 1e3, str(threads))


def engine_decoder(model_dir: Path, *, max_num_seqs: int, num_blocks: int) -> Decoder:
    config = EngineConfig(model=str(model_dir), decoder=DecoderConfig(max_num_seqs=max_num_seqs,
                                                                      num_blocks=num_blocks))
    stages = StageFactory(config)
    decoder = stages.decoder().decoder
    stages.release_unused()
    return decoder


# A constraint that lasts: an array of at least 200 small records, each a few dozen tokens.
LONG_JSON = StructuredOutput("json", json.dumps({
    "type": "array", "minItems": 200, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty", "note"], "properties": {
            "sku": {"enum": ["A1", "B2", "C3"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "note": {"type": "string", "maxLength": 24}}}}))


def our_step_ms(decoder: Decoder, ids: torch.Tensor, new_tokens: int,
                constrained: int = 0) -> tuple[StepTime, list[int]]:
    """Median decode step with `ids.shape[0]` sequences decoding, the first `constrained` of them under
    LONG_JSON; and the pages each one held."""
    free = SamplingParams(max_tokens=new_tokens + 8, temperature=0.0, ignore_eos=True)
    names = [f"bench-{i}-{time.monotonic_ns()}" for i in range(ids.shape[0])]
    for i, (name, row) in enumerate(zip(names, ids.tolist(), strict=True)):
        sampling = replace(free, structured=LONG_JSON) if i < constrained else free
        decoder.add(DecodeRequest(name, row, [], [], sampling))
    while any(s.is_prefill for s in decoder.scheduler.running) or decoder.scheduler.waiting:
        decoder.step()
    pages = [s.blocks.num_pages for s in decoder.scheduler.running]
    times = []
    for _ in range(new_tokens):
        started = time.perf_counter()
        decoder.step()
        times.append(time.perf_counter() - started)
    for name in names:
        decoder.abort(name)
    threads = decoder.runner.threads
    return StepTime(statistics.median(times[2:]) * 1e3, f"{threads.small}/{threads.big}"), pages


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


@dataclass(frozen=True)
class GrammarCost:
    step_ms: float  # median decode step of the batch with `constrained` rows under LONG_JSON (ms)
    critical_us: float  # of which, per step, grammar work the step waits for: the masks' tail, advancing (µs)
    share: float  # critical_us plus the sampler's masking over the step: what the grammar rows add to it
    beside_us: float  # per step, the masks' computation on the grammar thread, beside the forward (µs)
    constrained: int  # rows with a grammar in the batch (rows)
    free_ms: float  # median step of the same batch with no constraint, interleaved rounds (ms)
    mixed_ms: float  # the same with the grammar rows, each round between two free runs (ms)
    slowed: float  # median over the rounds of mixed / the mean of its two free neighbours: the target's ratio
    sample_free_us: float  # Sampler.sample over the batch's logits, no mask (µs)
    sample_masked_us: float  # the same with the constrained rows masked (µs)


def grammar_cost(decoder: Decoder, ids: torch.Tensor, new_tokens: int, rounds: int = 7) -> GrammarCost:
    """What grammar rows cost their batch: the grammar work the step waits for, timed inside the same steps
    (robust to the machine's drift), beside whole steps with and without them in interleaved rounds."""
    constrained = ids.shape[0] // 2
    free, mixed, ratios, waited, beside = [], [], [], [], []
    for _ in range(rounds):  # NOTE: free, mixed, free: the machine's drift and a run's place fall on both alike
        before = our_step_ms(decoder, ids, new_tokens)[0].ms
        with _timing(decoder.grammar_step, "finish", "advance") as on_path, \
                _timing(decoder.grammars, "forbidden") as off_path:
            mixed.append(our_step_ms(decoder, ids, new_tokens, constrained)[0].ms)
        after = our_step_ms(decoder, ids, new_tokens)[0].ms
        free.append((before + after) / 2)
        ratios.append(mixed[-1] / free[-1])
        waited.append(on_path.total / off_path.calls)
        beside.append(off_path.total / off_path.calls)
    n = ids.shape[0]
    matchers = [decoder.grammars.matcher(LONG_JSON) if i < constrained else None for i in range(n)]
    logits = torch.randn(n, decoder.spec.vocab_size)
    params = [SamplingParams(temperature=0.0)] * n
    generators: list[torch.Generator | None] = [None] * n
    forbid = decoder.grammars.forbidden(matchers, logits.device)
    sample_free = _best_us(lambda: decoder.sampler.sample(logits, params, generators))
    sample_masked = _best_us(lambda: decoder.sampler.sample(logits, params, generators, forbidden=forbid))
    step_ms, critical_us = statistics.median(mixed), statistics.median(waited) * 1e6
    return GrammarCost(step_ms, critical_us, (critical_us + max(0.0, sample_masked - sample_free)) / 1e3 / step_ms,
                       statistics.median(beside) * 1e6, constrained, statistics.median(free), step_ms,
                       statistics.median(ratios), sample_free, sample_masked)


@dataclass
class _Timer:
    total: float = 0.0  # seconds inside the timed calls
    calls: int = 0  # calls of the first timed method


@contextlib.contextmanager
def _timing(owner: Any, *names: str) -> Iterator[_Timer]:
    """Time calls of `owner`'s methods `names` (instance-level wrappers, removed on exit)."""
    timer = _Timer()

    def timed(fn: Any, first: bool) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.total += time.perf_counter() - started
                timer.calls += first
        return call

    for i, name in enumerate(names):
        setattr(owner, name, timed(getattr(owner, name), i == 0))
    try:
        yield timer
    finally:
        for name in names:
            delattr(owner, name)


def _best_us(fn: Any, repeat: int = 200) -> float:
    """Median of `repeat` calls of `fn` (µs)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6
