"""Logit adjustments a request asks for: OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty`,
and vLLM's `allowed_token_ids`, `bad_words`, `repetition_penalty` and `min_tokens`.

Owns: applying them to one step's logits, rows that ask for none untouched (and no work at all when no
row asks). Does not own: sampling (sampler.py) nor the log-probs a request sees (those come from the raw
logits, before any of this).

Order, per row: every token outside `allowed_token_ids` (when set) is masked; the bias is added; the
repetition penalty divides the positive logits (multiplies the negative ones) of every token in the prompt
or the output so far, as transformers and vLLM define it; the frequency penalty subtracts
`frequency_penalty` times a token's count in the output, the presence penalty `presence_penalty` once for a
token that occurs there at all (OpenAI's definitions); below `min_tokens` output tokens the end-of-sequence
and stop token ids are masked; a bad word's last token is masked where the output ends with the rest of it
(vLLM's definition: a one-token word always).

NOTE: a loop over the rows that ask (each a few vector ops on its own row), not one batched kernel.
Nothing here reads a device value back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from mmserve.decoder.token_history import TokenHistory
from mmserve.errors import InvalidSamplingError
from mmserve.messages import SamplingParams
from mmserve.runtime.host_copy import floats_to_device, ints_to_device, to_device


def penalized(logits: torch.Tensor, params: list[SamplingParams], histories: Sequence[TokenHistory | None],
              eos_token_ids: tuple[int, ...], never: tuple[int, ...] = ()) -> torch.Tensor:
    """(n, vocab) float32 logits -> the same, adjusted (a new tensor when any row asks, else `logits`);
    `histories`: each row's tokens (needed for the rows that ask); `never`: the ids the sampler never picks
    (left to it, but no token left beside them is no token left)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        history = histories[i]
        if history is None:
            raise ValueError(f"row {i} adjusts its logits and has no token history")
        _adjust(logits[i], params[i], history, eos_token_ids, never)
    return logits


def _adjust(row: torch.Tensor, p: SamplingParams, history: TokenHistory, eos_token_ids: tuple[int, ...],
            never: tuple[int, ...]) -> None:
    """Adjust one (vocab,) row in place.

    NOTE: which tokens and by how much is worked out on the host (numpy over the token lists) and sent in
    non-blocking copies: on an accelerator, `unique`, `bincount` and indexing with a Python list each
    wait for the device.
    """
    vocab, device = row.shape[0], row.device
    if p.allowed_token_ids is not None:
        allowed = _allowed_on(p.allowed_token_ids, vocab, device)  # (a,)
        allowed_logits = row.index_select(0, allowed)  # (a,)
        row.fill_(float("-inf")).index_copy_(0, allowed, allowed_logits)
    bias = [(token, value) for token, value in p.logit_bias if 0 <= token < vocab]
    if bias:
        row.index_add_(0, ints_to_device([t for t, _ in bias], device), floats_to_device([v for _, v in bias], device))
    if p.repetition_penalty != 1.0:
        seen = history.seen()  # (u,)
        index = to_device(seen[(seen >= 0) & (seen < vocab)], device)
        values = row[index]
        row.index_copy_(0, index, torch.where(values > 0, values / p.repetition_penalty,
                                              values * p.repetition_penalty))
    if (p.frequency_penalty or p.presence_penalty) and history.num_output:
        ids, counts = history.output_counts()  # (u,) each
        kept = (ids >= 0) & (ids < vocab)
        # NOTE: float32, as the whole-row form computed it: frequency times count, plus presence once
        cost = np.float32(p.frequency_penalty) * counts[kept].astype(np.float32) + np.float32(p.presence_penalty)
        row.index_add_(0, to_device(ids[kept], device), to_device(-cost, device).to(row.dtype))
    banned = [word[-1] for word in p.bad_words_token_ids if _completes(history, word) and 0 <= word[-1] < vocab]
    if banned:
        row.index_fill_(0, ints_to_device(banned, device), float("-inf"))
    if history.num_output < p.min_tokens:
        ends = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
        row.index_fill_(0, ints_to_device(ends, device), float("-inf"))
    if p.allowed_token_ids is not None and eos_token_ids:
        # NOTE: allowed ids that the output has since made bad words leave no token: the sequence ends (its
        # end's logits 0) rather than sample from nothing, which no row of a batch may do; no device read
        ends_t = ints_to_device([t for t in eos_token_ids if 0 <= t < vocab], device)
        # NOTE: only allowed ids can still be finite: those left but the never-sampled ones decide
        left = _allowed_on(p.allowed_token_ids, vocab, device, never)  # (l,)
        nothing = row.index_select(0, left).amax() == float("-inf") if left.numel() \
            else torch.tensor(True, device=device)  # () bool
        row.index_copy_(0, ends_t, torch.where(nothing, 0.0, row.index_select(0, ends_t)))


def _completes(history: TokenHistory, word: tuple[int, ...]) -> bool:
    """Whether the next token could complete `word`: the output ends with all of it but its last token."""
    return tuple(history.output_tail(len(word) - 1)) == word[:-1]


def check_allowed(p: SamplingParams, never: tuple[int, ...], eos_token_ids: tuple[int, ...]) -> None:
    """Refuse `allowed_token_ids` that leave a step no token: all of them never sampled, one-token bad words,
    or (under `min_tokens`) ends."""
    if p.allowed_token_ids is None:
        return
    banned = {*never, *(w[0] for w in p.bad_words_token_ids if len(w) == 1)}
    if p.min_tokens:
        banned |= {*eos_token_ids, *p.stop_token_ids}
    if set(p.allowed_token_ids) <= banned:
        raise InvalidSamplingError("allowed_token_ids: every id it allows is one the output may not hold (never "
                                   "sampled by this model, a bad word, or an end before min_tokens)",
                                   param="allowed_token_ids")


# (id(allowed ids), id(ids left out)) -> (the allowed ids, those left out, the rest as a tensor)
_ALLOWED: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]] = {}
_ALLOWED_KEPT = 128  # tensors kept, two per request (its allowed ids; those less the never-sampled)
_ALLOWED_KEPT_IDS = 1 << 21  # ids kept in all (the oldest requests' go first; a request's own may pass it alone)
_ALLOWED_LOCK = threading.Lock()  # NOTE: one process may step several decoders (the in-process Engine's tests)


def _allowed_on(ids: tuple[int, ...], vocab: int, device: torch.device, without: tuple[int, ...] = ()) -> torch.Tensor:
    """(a,) the in-vocabulary `ids` but those `without` on `device`, made once per request's tuple (a long list
    costs per step: 262k ids took ~25 ms a row to rebuild)."""
    with _ALLOWED_LOCK:
        key = (id(ids), id(without))
        kept = _ALLOWED.get(key)
        if kept is not None and kept[0] is ids and kept[1] is without and kept[2].device == device:
            return kept[2]
        skip = set(without)
        tensor = ints_to_device([t for t in ids if 0 <= t < vocab and t not in skip], device)
        while _ALLOWED and (len(_ALLOWED) >= _ALLOWED_KEPT or
                            sum(len(kept[0]) for kept in _ALLOWED.values()) + len(ids) > _ALLOWED_KEPT_IDS):
            _ALLOWED.pop(next(iter(_ALLOWED)))
        _ALLOWED[key] = (ids, without, tensor)
        return tensor
