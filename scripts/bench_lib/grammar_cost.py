"""What structured-output rows cost the rest of their batch, measured on the decoder step in one process.

Owns: whole decode steps of a batch with some rows under a JSON schema against the same batch with none,
taken on two Decoders of the same checkpoint and settings whose steps alternate in blocks (A B B A ...) so that the
machine's drift, which on our VMs moves whole runs by several percent, falls on both alike, and taken
twice with the roles swapped (A constrained, then B): two Decoder instances differ by ~1% in speed on
their own (the placebo showed it), and the geometric mean of the two ratios cancels that difference; a
placebo (both batches free, both orders) in the same run that shows the method's own floor; and, inside
the same steps, the grammar work the step waits for and the masks' work beside the forward. Does not own
printing or the other step measures (`step.py`).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench_lib.step import start, stop, timed_step
from mmserve.decoder.decoder import Decoder
from mmserve.messages import SamplingParams, StructuredOutput

BLOCK = 8  # steps each Decoder runs in a row (`paired`)

# A constraint that lasts: an array of at least 200 small records, each a few dozen tokens.
LONG_JSON = StructuredOutput("json", json.dumps({
    "type": "array", "minItems": 200, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty", "note"], "properties": {
            "sku": {"enum": ["A1", "B2", "C3"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            "note": {"type": "string", "maxLength": 24}}}}))


@dataclass(frozen=True)
class GrammarCost:
    constrained: int  # rows with a grammar in the batch (rows)
    steps: int  # paired steps timed, both role assignments together (steps)
    mixed_ms: float  # median decode step of the batch with `constrained` rows under LONG_JSON (ms)
    free_ms: float  # median step of the same batch with no constraint, on the other Decoder (ms)
    slowed: float  # geometric mean, over both role assignments, of the median over adjacent pairs of
    # mixed / free step: the target's ratio
    slowed_by_role: tuple[float, float]  # that median with the first Decoder constrained, then the second
    placebo: float  # the same ratio with both batches free: the method's floor, ideally 1.0
    critical_us: float  # per mixed step, grammar work the step waits for: starting the masks (computing and
    # unpacking them all when not beside), their tail, advancing the matchers (µs)
    share: float  # critical_us plus the sampler's masking over the step: what the grammar rows add to it
    masks_us: float  # per mixed step, llguidance computing the masks, wall time: on the grammar thread after
    # the last step's advance (made ahead), else before the forward where its threads fill the cores or
    # beside it (µs)
    beside: bool  # whether the masks are made beside the forward (ahead, after each advance), or before it
    sample_free_us: float  # Sampler.sample over the batch's logits, no mask (µs)
    sample_masked_us: float  # the same with the constrained rows masked (µs)


def grammar_cost(decoder: Decoder, twin: Decoder, ids: torch.Tensor, steps: int = 240) -> GrammarCost:
    """Half of the batch `ids` under LONG_JSON on one Decoder against all of it free on the other (the same
    checkpoint, config and thread counts), step by step, once each way round; then the same with both free."""
    constrained = ids.shape[0] // 2
    on_path, masks = _Timer(), _Timer()
    by_role = (timed_pairs(decoder, twin, ids, steps, constrained, on_path, masks),
               timed_pairs(twin, decoder, ids, steps, constrained, on_path, masks))
    placebo = (paired(decoder, twin, ids, steps, 0), paired(twin, decoder, ids, steps, 0))
    sample_free, sample_masked = sampler_us(decoder, ids.shape[0], constrained)
    pairs = [pair for role in by_role for pair in role]
    mixed_ms = statistics.median(a for a, _ in pairs) * 1e3
    masks_us = masks.total / on_path.calls * 1e6  # NOTE: on_path counts `finish`: one call per step
    beside = decoder.runner.threads.leaves_a_core(ids.shape[0], sum(s.num_tokens for s in decoder.scheduler.running))
    critical_us = on_path.total / on_path.calls * 1e6
    ratios = tuple(statistics.median(a / b for a, b in role) for role in by_role)
    return GrammarCost(
        constrained, len(pairs), mixed_ms, statistics.median(b for _, b in pairs) * 1e3,
        _geomean(ratios), (ratios[0], ratios[1]),
        _geomean([statistics.median(a / b for a, b in role) for role in placebo]), critical_us,
        (critical_us + max(0.0, sample_masked - sample_free)) / 1e3 / mixed_ms, masks_us, beside,
        sample_free, sample_masked)


def timed_pairs(a: Decoder, b: Decoder, ids: torch.Tensor, steps: int, constrained: int, on_path: _Timer,
                masks: _Timer) -> list[tuple[float, float]]:
    """`paired`, adding `a`'s grammar work on the step's path and its masks' to the two timers."""
    with _timing(a.grammar_step, "finish", "advance", "start") as path, _timing(a.grammars, "bitmask") as made:
        pairs = paired(a, b, ids, steps, constrained)
    for total, part in ((on_path, path), (masks, made)):
        total.total += part.total
        total.calls += part.calls
    return pairs


def _geomean(ratios: Sequence[float]) -> float:
    """NOTE: a speed difference between the two Decoders multiplies one role's ratio and divides the other's."""
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def paired(a: Decoder, b: Decoder, ids: torch.Tensor, steps: int, constrained: int,
           block: int = BLOCK) -> list[tuple[float, float]]:
    """`steps` decode steps on each of `a` (the first `constrained` rows under LONG_JSON) and `b` (all free), in
    blocks of `block` steps alternated A B B A A B ... -> (a's step, b's step at the same place of the adjacent
    block) per pair (s); each block's first step and the first two rounds (A B, then B A) dropped.

    NOTE: in blocks, not step by step: a constrained step's masks for its next step are made on the grammar
    thread beside that next step's forward, as in a served batch. Alternated one step at a time, they ran
    beside the other Decoder's step instead, which flattered the constrained side twice (its own step had its
    masks ready and none of their work beside it; the free step had it). A block's first step may still have
    the other Decoder's grammar work beside it: dropped."""
    names_a = start(a, ids, steps, constrained, LONG_JSON)
    names_b = start(b, ids, steps)
    pairs = []
    for k in range(steps // block):
        order = (a, b) if k % 2 == 0 else (b, a)
        runs = {id(d): [timed_step(d) for _ in range(block)][1:] for d in order}
        pairs += list(zip(runs[id(a)], runs[id(b)], strict=True))
    stop(a, names_a)
    stop(b, names_b)
    return pairs[2 * (block - 1):]


def sampler_us(decoder: Decoder, n: int, constrained: int) -> tuple[float, float]:
    """`Sampler.sample` over (n, vocab) random logits, without and with the first `constrained` rows masked
    by LONG_JSON (µs)."""
    matchers = [decoder.grammars.matcher(LONG_JSON) if i < constrained else None for i in range(n)]
    device = decoder.runner.device
    logits = torch.randn(n, decoder.spec.vocab_size, device=device)  # (n, vocab), where the decoder samples
    params = [SamplingParams(temperature=0.0)] * n
    generators: list[torch.Generator | None] = [None] * n
    forbid = decoder.grammars.forbidden(matchers, device)  # (n, vocab) bool
    return (_best_us(lambda: decoder.sampler.sample(logits, params, generators), device),
            _best_us(lambda: decoder.sampler.sample(logits, params, generators, forbidden=forbid), device))


@dataclass
class _Timer:
    total: float = 0.0  # seconds inside the timed calls
    calls: int = 0  # calls of the first timed method


@contextlib.contextmanager
def _timing(owner: Any, *names: str) -> Iterator[_Timer]:
    """Time calls of `owner`'s methods `names` (instance-level wrappers, removed on exit)."""
    timer, lock = _Timer(), threading.Lock()

    def timed(fn: Any, first: bool) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:  # NOTE: the masks made ahead are timed on the grammar thread
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


def _best_us(fn: Any, device: torch.device, repeat: int = 200) -> float:
    """Median of `repeat` calls of `fn` (µs), each waited for on `device` (an accelerator queues its work)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6
