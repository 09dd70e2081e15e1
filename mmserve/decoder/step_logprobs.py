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
from dataclasses import dataclass

import torch

from mmserve.decoder.sampler import RowMasks, token_logprobs
from mmserve.messages import SamplingParams, TokenLogprob
from mmserve.runtime.host_copy import ints_to_device


@dataclass(frozen=True)
class AskedLogprobs:
    """The log-probs of a step's asking rows, still on the device (made before its tokens are read)."""

    rows: list[int]  # the step's rows whose requests asked for `logprobs`
    top: int  # the most alternatives any of them asked for
    table: torch.Tensor  # (len(rows), 1 + 2 top) float64: the sampled token's log-prob, the best log-probs, their ids


def asked_logprobs(logits: torch.Tensor, sampled: torch.Tensor, sampling: Sequence[SamplingParams],
                   masks: RowMasks | None = None) -> AskedLogprobs | None:
    """(n, vocab) raw logits, (n,) sampled ids (-1: none), each row's params, the grammar rows' masks -> the
    asking rows' log-probs on the device (None when no row asked); no host sync."""
    rows = [i for i, params in enumerate(sampling) if params.logprobs is not None]
    if not rows:
        return None
    top = max(sampling[i].logprobs or 0 for i in rows)
    index = ints_to_device(rows, logits.device)  # (r,)
    asking = _grammar_masked(logits[index], rows, masks)  # (r, vocab), a copy
    # NOTE: a row left without a token (-1) reads token 0's here, dropped by `shaped_logprobs`
    chosen, best, best_ids = token_logprobs(asking, sampled[index].clamp(min=0), top)  # (r,), (r, top), (r, top)
    # NOTE: float64 holds every token id exactly, so that one copy takes all (`read_tokens`)
    return AskedLogprobs(rows, top, torch.cat((chosen[:, None].double(), best.double(), best_ids.double()), dim=1))


def read_tokens(sampled: torch.Tensor, asked: AskedLogprobs | None) -> tuple[list[int], list[list[float]]]:
    """The (n,) sampled ids and the asking rows' log-prob table, in one copy to the host (a step's one sync)."""
    if asked is None:
        return sampled.tolist(), []
    n, width = sampled.shape[0], asked.table.shape[1]
    flat = torch.cat((sampled.double(), asked.table.flatten())).tolist()  # (n + r * width,)
    return [int(t) for t in flat[:n]], [flat[n + j * width : n + (j + 1) * width] for j in range(len(asked.rows))]


def shaped_logprobs(asked: AskedLogprobs | None, table: list[list[float]], tokens: list[int],
                    sampling: Sequence[SamplingParams], piece: Callable[[int], tuple[str, bytes]]
                    ) -> dict[int, TokenLogprob]:
    """Row -> its token's log-prob and `top_logprobs` alternatives, for the rows that asked and got a token (not
    -1); a token a row's grammar forbids has a log-prob of -inf."""
    if asked is None:
        return {}
    out = {}
    top = asked.top
    for i, row in zip(asked.rows, table, strict=True):
        if tokens[i] < 0:
            continue
        k = sampling[i].logprobs or 0
        ids, values = row[1 + top : 1 + top + k], row[1 : 1 + k]
        alternatives = tuple(_alternative(int(t), lp, piece) for t, lp in zip(ids, values, strict=True))
        text, raw = piece(tokens[i])
        out[i] = TokenLogprob(tokens[i], text, row[0], raw, alternatives)
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
