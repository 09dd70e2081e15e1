"""The log-probabilities a decoder step reports: each asking row's sampled token and its best alternatives.

Owns: picking the step's rows whose requests asked for `logprobs`, computing theirs in one batched call
from the step's raw logits (`sampler.token_logprobs`: before temperature, penalties and grammar masks, as
vLLM's default `raw_logprobs`), and shaping them as `TokenLogprob`s, each token's text decoded alone.
Does not own sampling, the step, nor how the edge renders them (`mmserve/api/logprobs.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mmserve.decoder.sampler import token_logprobs
from mmserve.messages import SamplingParams, TokenLogprob
from mmserve.runtime.host_copy import ints_to_device


def step_logprobs(logits: torch.Tensor, sampled: torch.Tensor, tokens: list[int], sampling: Sequence[SamplingParams],
                  text: Callable[[int], str]) -> dict[int, TokenLogprob]:
    """(n, vocab) raw logits, (n,) sampled ids (and the same as `tokens`), each row's params -> row -> its
    token's log-prob and `top_logprobs` alternatives, for the rows that asked and got a token (not -1)."""
    rows = [i for i, params in enumerate(sampling) if params.logprobs is not None and tokens[i] >= 0]
    if not rows:
        return {}
    top = max(sampling[i].logprobs or 0 for i in rows)
    index = ints_to_device(rows, logits.device)  # (r,)
    chosen, best, best_ids = (t.tolist() for t in token_logprobs(logits[index], sampled[index], top))
    out = {}
    for j, i in enumerate(rows):
        k = sampling[i].logprobs or 0
        alternatives = tuple((t, text(t), lp) for t, lp in zip(best_ids[j][:k], best[j][:k], strict=True))
        out[i] = TokenLogprob(tokens[i], text(tokens[i]), chosen[j], alternatives)
    return out
