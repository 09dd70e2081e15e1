"""Logit adjustments a request asks for: OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty`,
and vLLM's `allowed_token_ids`, `repetition_penalty` and `min_tokens`.

Owns: applying them to one step's logits, rows that ask for none untouched (and no work at all when no
row asks). Does not own: sampling (sampler.py) nor the log-probs a request sees (those come from the raw
logits, before any of this).

Order, per row: every token outside `allowed_token_ids` (when set) is masked; the bias is added; the
repetition penalty divides the positive logits (multiplies the negative ones) of every token in the prompt
or the output so far, as transformers and vLLM define it; the frequency penalty subtracts
`frequency_penalty` times a token's count in the output, the presence penalty `presence_penalty` once for a
token that occurs there at all (OpenAI's definitions); below `min_tokens` output tokens the end-of-sequence
and stop token ids are masked.

NOTE: a loop over the rows that ask (each a few vector ops on its own row), not one batched kernel.
Nothing here reads a device value back.
"""

from __future__ import annotations

import numpy as np
import torch

from mmserve.messages import SamplingParams
from mmserve.runtime.host_copy import floats_to_device, ints_to_device, to_device


def penalized(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
              prompts: list[list[int]], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """(n, vocab) float32 logits -> the same, adjusted (a new tensor when any row asks, else `logits`)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        _adjust(logits[i], params[i], outputs[i], prompts[i], eos_token_ids)
    return logits


def _adjust(row: torch.Tensor, p: SamplingParams, output: list[int], prompt: list[int],
            eos_token_ids: tuple[int, ...]) -> None:
    """Adjust one (vocab,) row in place.

    NOTE: which tokens and by how much is worked out on the host (numpy over the token lists) and sent in
    non-blocking copies: on an accelerator, `unique`, `bincount` and indexing with a Python list each
    wait for the device.
    """
    vocab, device = row.shape[0], row.device
    if p.allowed_token_ids is not None:
        allowed = ints_to_device([t for t in p.allowed_token_ids if 0 <= t < vocab], device)
        allowed_logits = row.index_select(0, allowed)  # (a,)
        row.fill_(float("-inf")).index_copy_(0, allowed, allowed_logits)
    bias = [(token, value) for token, value in p.logit_bias if 0 <= token < vocab]
    if bias:
        row.index_add_(0, ints_to_device([t for t, _ in bias], device), floats_to_device([v for _, v in bias], device))
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.asarray([*prompt, *output], dtype=np.int64))  # (u,)
        index = to_device(seen[(seen >= 0) & (seen < vocab)], device)
        values = row[index]
        row.index_copy_(0, index, torch.where(values > 0, values / p.repetition_penalty,
                                              values * p.repetition_penalty))
    if (p.frequency_penalty or p.presence_penalty) and len(output):
        ids, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)  # (u,) each
        kept = (ids >= 0) & (ids < vocab)
        # NOTE: float32, as the whole-row form computed it: frequency times count, plus presence once
        cost = np.float32(p.frequency_penalty) * counts[kept].astype(np.float32) + np.float32(p.presence_penalty)
        row.index_add_(0, to_device(ids[kept], device), to_device(-cost, device).to(row.dtype))
    if len(output) < p.min_tokens:
        ends = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
        row.index_fill_(0, ints_to_device(ends, device), float("-inf"))
