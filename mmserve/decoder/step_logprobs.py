"""The log-probabilities a decoder step reports: each asking row's sampled token and its best alternatives.

Owns: picking the step's rows whose requests asked for `logprobs`, computing theirs in one batched call
from the step's raw logits (`sampler.token_logprobs`: before temperature and penalties, as vLLM's default
`raw_logprobs`; a grammar row's over the tokens its grammar allows, as vLLM applies the grammar's bitmask to
the logits before its sampler reads them), and shaping them as `TokenLogprob`s, each token's text decoded
alone and its own bytes.
Does not own sampling, the step, nor how the edge renders them (`mmserve/api/logprobs.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mmserve.decoder.sampler import RowMasks, token_logprobs
from mmserve.messages import SamplingParams, TokenLogprob
from mmserve.runtime.host_copy import ints_to_device


def step_logprobs(logits: torch.Tensor, sampled: torch.Tensor, tokens: list[int], sampling: Sequence[SamplingParams],
                  piece: Callable[[int], tuple[str, bytes]], masks: RowMasks | None = None) -> dict[int, TokenLogprob]:
    """(n, vocab) raw logits, (n,) sampled ids (and the same as `tokens`), each row's params, the grammar rows'
    masks -> row -> its token's log-prob and `top_logprobs` alternatives, for the rows that asked and got a token
    (not -1); a token a row's grammar forbids has a log-prob of -inf."""
    rows = [i for i, params in enumerate(sampling) if params.logprobs is not None and tokens[i] >= 0]
    if not rows:
        return {}
    top = max(sampling[i].logprobs or 0 for i in rows)
    index = ints_to_device(rows, logits.device)  # (r,)
    asking = _grammar_masked(logits[index], rows, masks)  # (r, vocab), a copy
    chosen, best, best_ids = (t.tolist() for t in token_logprobs(asking, sampled[index], top))
    out = {}
    for j, i in enumerate(rows):
        k = sampling[i].logprobs or 0
        alternatives = tuple(_alternative(t, lp, piece) for t, lp in zip(best_ids[j][:k], best[j][:k], strict=True))
        text, raw = piece(tokens[i])
        out[i] = TokenLogprob(tokens[i], text, chosen[j], raw, alternatives)
    return out


def _alternative(token: int, logprob: float, piece: Callable[[int], tuple[str, bytes]]
                 ) -> tuple[int, str, float, bytes]:
    text, raw = piece(token)
    return token, text, logprob, raw


def _grammar_masked(asking: torch.Tensor, rows: list[int], masks: RowMasks | None) -> torch.Tensor:
    """The asking `rows`' (r, vocab) logits (a copy of the step's), with what their grammars forbid at -inf."""
    if masks is None:
        return asking
    where = {row: k for k, row in enumerate(masks.rows)}  # batch row -> its mask
    pairs = [(j, where[i]) for j, i in enumerate(rows) if i in where]
    if pairs:
        mine = ints_to_device([j for j, _ in pairs], asking.device)  # (m,)
        forbid = masks.forbid.index_select(0, ints_to_device([k for _, k in pairs], masks.forbid.device))  # (m, V)
        asking[mine] = asking[mine].masked_fill(forbid.to(asking.device), float("-inf"))
    return asking
