"""Logit adjustments a request asks for: OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty`,
and vLLM's `repetition_penalty` and `min_tokens`.

Owns: applying them to one step's logits, rows that ask for none untouched (and no work at all when no
row asks). Does not own: sampling (sampler.py) nor the log-probs a request sees (those come from the raw
logits, before any of this).

Order, per row: the bias is added; the repetition penalty divides the positive logits (multiplies the
negative ones) of every token in the prompt or the output so far, as transformers and vLLM define it; the
frequency penalty subtracts `frequency_penalty` times a token's count in the output, the presence penalty
`presence_penalty` once for a token that occurs there at all (OpenAI's definitions); below `min_tokens`
output tokens the end-of-sequence and stop token ids are masked.

NOTE: a loop over the rows that ask (each a few vector ops on its own row), not one batched kernel.
"""

from __future__ import annotations

import torch

from mmserve.messages import SamplingParams


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
    """Adjust one (vocab,) row in place."""
    vocab, device = row.shape[0], row.device
    for token, bias in p.logit_bias:
        if 0 <= token < vocab:
            row[token] += bias
    out = torch.tensor(output, dtype=torch.int64, device=device)  # (t,)
    if p.repetition_penalty != 1.0:
        seen = torch.unique(torch.cat([torch.tensor(prompt, dtype=torch.int64, device=device), out]))  # (u,)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and len(output):
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)  # (vocab,)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if len(output) < p.min_tokens:
        ends = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
        row[ends] = float("-inf")
