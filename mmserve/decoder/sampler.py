"""Batched next-token sampling: greedy, temperature, top-k, top-p, with per-request seeded RNGs.

Owns: turning one step's last-position logits into token ids, and the per-request generator helper.
Does not own: computing the logits (the model runner), nor stop conditions (the scheduler).

Filtering is vectorised over the batch (one `topk`, masks built from per-row parameter tensors). The
draw is inverse-CDF sampling with one uniform number per row taken from that row's own CPU generator,
so a seeded row gets the same token whether it is batched with other rows or alone, on any device.
On a CPU the greedy picks and the grammar masks of float32 logits go through numpy (`argmax`,
`masked_on_cpu`): numpy's argmax is vectorised where torch's CPU kernel is not, and its calls cost a few
µs where torch's dispatch costs tens; `masked_by_torch` is the same on any other device. The model's
never-sampled tokens are kept out without a copy of the batch's logits: a greedy pick of one is replaced
by its row's best other token, a drawn row filters its own scaled copy, and a masked row's mask forbids
them (`RowMasks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.decoder.penalties import penalized
from mmserve.messages import SamplingParams
from mmserve.runtime.host_copy import floats_to_device, ints_to_device, to_device

CANDIDATES = 1024  # tokens a top-p-only row is first truncated to; a full sort only if its nucleus is wider


@dataclass(frozen=True)
class RowMasks:
    """The tokens that some rows of a batch may not sample (their grammars', `grammar.Grammars.forbidden`).

    NOTE: `forbid` must include the model's never-sampled tokens (`Sampler`'s `never`; `Grammars.forbidden`
    adds them): the sampler does not filter them out of a masked row again.
    """

    rows: tuple[int, ...]  # the masked rows' indices in the batch's logits (g of them)
    forbid: torch.Tensor  # (g, vocab) bool: True where row rows[j] may not sample the token


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator for one request's whole life; None (global RNG) when the request has no seed."""
    if seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed(seed)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """(n, vocab) logits -> (n, vocab) float32 log-probabilities."""
    return torch.log_softmax(logits.float(), dim=-1)


class Sampler:
    """`never` are token ids no row may get, greedy or sampled (their logits count as -inf); a masked row's
    `RowMasks` forbid them already."""

    def __init__(self, never: tuple[int, ...] = (), eos_token_ids: tuple[int, ...] = ()) -> None:
        self._never = torch.tensor(never, dtype=torch.int64)  # (k,) on the device of the last logits
        self._never_ids = frozenset(never)  # the same ids, for a membership test without a torch call
        self._eos = eos_token_ids  # what `min_tokens` holds back

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
               outputs: list[list[int]] | None = None, prompts: list[list[int]] | None = None,
               forbidden: RowMasks | None = None) -> torch.Tensor:
        """(n, vocab) logits, one params and generator per row (and, for penalties, each row's output and
        prompt token ids; for structured output, the tokens some rows' grammars forbid) -> (n,) int64 token
        ids; -1 for a row whose masks left it no token at all (possible only under a grammar)."""
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} rows, {len(params)} params, {len(generators)} generators")
        logits = logits.float()  # (n, V); NOTE: filter in float32 whatever the model dtype
        if any(p.adjusts_logits for p in params):
            if outputs is None or prompts is None:
                raise ValueError("penalties need each row's output and prompt token ids")
            logits = penalized(logits, params, outputs, prompts, self._eos)
        never = self._never_on(logits.device)  # (k,)
        on_host = _numpy_can(logits)
        # NOTE: off the host the never-sampled tokens are filtered out before the pick, in a (n, V) copy on the
        # device: fixing the picks after it (`_avoiding_never`) would read them back, a second host sync
        # (n,): each row's pick; the drawn and the masked rows below replace theirs
        tokens = argmax(logits if on_host or not len(never) else logits.index_fill(1, never, float("-inf")))
        dead = None
        if forbidden is not None:
            logits, dead = self._masked(logits, tokens, params, forbidden)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if on_host:
            tokens = self._avoiding_never(logits, tokens, never, (rows, forbidden.rows if forbidden else ()))
        if rows:
            self._draw(logits, tokens, rows, params, generators, never)
        return _dead_as_minus_one(tokens, dead)

    def _never_on(self, device: torch.device) -> torch.Tensor:
        """(k,) the never-sampled ids on `device`, moved there once."""
        if self._never.device != device:
            self._never = to_device(self._never, device)
        return self._never

    def _avoiding_never(self, logits: torch.Tensor, tokens: torch.Tensor, never: torch.Tensor,
                        skip: tuple[Sequence[int], ...]) -> torch.Tensor:
        """(n,) picks with each pick of a never-sampled (k,) `never` token, outside the rows in `skip` (drawn:
        drawn again after; masked: their masks forbid them), replaced by its row's best other token.

        NOTE: a model almost never prefers such a token (Gemma 3's image placeholder), so the rows are fixed
        after the pick rather than filtered before it: no (n, V) copy of the logits on the common path.
        On the host only: `tolist` would wait for an accelerator's picks.
        """
        if not self._never_ids:
            return tokens
        hit = [i for i, token in enumerate(tokens.tolist()) if token in self._never_ids]
        hit = [i for i in hit if not any(i in rows for rows in skip)]
        if not hit:
            return tokens
        index = torch.tensor(hit)  # (h,), on the host as the logits are
        return tokens.index_copy(0, index, argmax(logits[index].index_fill_(1, never, float("-inf"))))

    @staticmethod
    def _draw(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], params: list[SamplingParams],
              generators: list[torch.Generator | None], never: torch.Tensor) -> None:
        """Draw the tokens of the sampled `rows` into `tokens`, never a never-sampled one."""
        u = _uniforms([generators[i] for i in rows])  # (m,) on the host: one draw per sampled row
        vocab, device = logits.shape[-1], logits.device
        full = [j for j, i in enumerate(rows) if not _truncates(params[i], vocab)]
        cut = [j for j, i in enumerate(rows) if _truncates(params[i], vocab)]
        for group, draw in ((full, _draw_full), (cut, _draw_truncated)):
            if group:
                index = ints_to_device([rows[j] for j in group], device)  # (g,)
                temperatures = _temperatures([params[rows[j]] for j in group], device)  # (g, 1)
                # NOTE: all rows (`rows` ascend): one pass; else index_select (`logits[index]` is a slow gather)
                whole = len(group) == logits.shape[0]
                scaled = logits / temperatures if whole else logits.index_select(0, index).div_(temperatures)  # (g, V)
                if len(never):
                    scaled.index_fill_(1, never, float("-inf"))
                drawn = draw(scaled, [params[rows[j]] for j in group], to_device(u[group], device))  # (g,)
                tokens.index_copy_(0, index, drawn)

    @staticmethod
    def _masked(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams],
                masks: RowMasks) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply `masks` -> (logits for the draws, (n,) bool: the rows left no token, or None where the host
        knows there are none); `tokens` gets the masked rows' greedy picks.

        NOTE: only the masked rows are touched (a 262k vocabulary makes each pass over a row cost), and the
        logits are copied with them only when one of them draws: a greedy row needs only its masked max.
        """
        greedy = all(params[i].greedy for i in masks.rows)
        if _numpy_can(logits):
            return masked_on_cpu(logits, tokens, masks, greedy)
        return masked_by_torch(logits, tokens, masks, greedy)


def masked_by_torch(logits: torch.Tensor, tokens: torch.Tensor, masks: RowMasks,
                    greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Sampler._masked` in torch kernels, for logits on any device; nothing read back."""
    rows = ints_to_device(masks.rows, logits.device)  # (g,)
    sub = logits.index_select(0, rows).masked_fill_(masks.forbid, float("-inf"))  # (g, V)
    best, picks = sub.max(dim=-1)  # (g,) each: NOTE: the first of tied maxima, as argmax
    tokens.index_copy_(0, rows, picks)
    left_none = best == float("-inf")  # (g,)
    dead = torch.zeros_like(tokens, dtype=torch.bool).index_copy_(0, rows, left_none)  # (n,)
    if greedy:
        return logits, dead
    sub.masked_fill_(left_none[:, None], 0.0)  # NOTE: so that the draws stay defined
    return logits.index_copy(0, rows, sub), dead


def masked_on_cpu(logits: torch.Tensor, tokens: torch.Tensor, masks: RowMasks,
                  greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Sampler._masked` for float32 CPU logits, in numpy: the same results in a few µs of calls where torch's
    dispatch takes tens (a step's sampler runs once per token). `tokens` must be writable in place."""
    rows = np.asarray(masks.rows, dtype=np.int64)  # (g,)
    forbid = masks.forbid.numpy()  # (g, V) bool
    values = logits.detach().numpy()  # (n, V) float32, the logits' own memory
    if greedy:
        picks = tokens.numpy()[rows]  # (g,) each row's first maximum
        if not forbid[np.arange(len(rows)), picks].any() and (values[rows, picks] > -np.inf).all():
            # NOTE: each row's first maximum is allowed (and finite), so it is also the first maximum of its allowed
            # tokens: the usual case for a trained model following its grammar, and no (g, V) pass is needed
            return logits, None  # no row left without a token
    sub = np.where(forbid, np.float32(-np.inf), values[rows])  # (g, V) float32
    picks = sub.argmax(axis=-1).astype(np.int64, copy=False)  # (g,): the first of tied maxima, as torch's
    tokens.numpy()[rows] = picks
    left_none = sub[np.arange(len(rows)), picks] == -np.inf  # (g,)
    dead = np.zeros(len(values), dtype=bool)  # (n,)
    dead[rows[left_none]] = True
    if greedy:
        return logits, torch.from_numpy(dead)
    sub[left_none] = 0.0  # NOTE: so that the draws stay defined
    drawn = logits.detach().clone()  # (n, V): the caller's logits stay as they were
    drawn.numpy()[rows] = sub
    return drawn, torch.from_numpy(dead)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """(n, V) -> (n,) int64: each row's first maximum. NOTE: on a CPU through numpy, whose vectorised argmax
    is many times faster than torch's CPU kernel over a large vocabulary (docs/benchmarks.md)."""
    if _numpy_can(logits):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def _numpy_can(logits: torch.Tensor) -> bool:
    """Whether numpy can read `logits` in place: float32 on the CPU (numpy has no bfloat16)."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """(n, vocab) raw logits, (n,) sampled ids -> ((n,) their log-probs, (n, top) best log-probs, (n, top) ids)."""
    logp = log_softmax(logits)  # (n, V) float32
    best, ids = logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())  # (n, top) each
    return logp.gather(1, tokens[:, None])[:, 0], best, ids


def truncated_probs(scaled: torch.Tensor, params: list[SamplingParams],
                    candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, V) temperature-scaled logits -> ((g, K) probabilities after top-k then top-p, (g, K) ids).

    The probabilities are renormalised over the kept tokens.

    Both are in decreasing-logit order over the K most likely tokens, so every kept set is a prefix of its row
    and the first token is always kept. Top-p applies to the distribution renormalised after top-k. NOTE: a
    full sort is ~30x slower than `topk` on CPU, so K is the largest top_k when every row has one (top-p never
    goes past a row's k best: Gemma's own top_k 64, top_p 0.95), else that or CANDIDATES, widened to the whole
    vocabulary only when some row's nucleus is wider than that.
    """
    vocab, device = scaled.shape[-1], scaled.device
    ks = [_top_k(p, vocab) for p in params]  # 0 where a row has no top_k
    widens = not all(ks)  # NOTE: a row without a top_k may have a nucleus wider than the candidates
    if candidates is None:  # NOTE: off the CPU a full sort is cheap, and the widening check would read back
        candidates = 0 if not widens else CANDIDATES if device.type == "cpu" else vocab
    top_k = ints_to_device([k or vocab for k in ks], device)  # (g,)
    top_p = floats_to_device([p.top_p for p in params], device)  # (g,)
    k = min(vocab, max(candidates, *ks))
    if k < vocab:
        values, order = scaled.topk(k, dim=-1)  # (g, K) each, sorted
    else:
        values, order = scaled.sort(dim=-1, descending=True)  # (g, V) each
    in_k = torch.arange(k, device=device)[None, :] < top_k[:, None]  # (g, K)
    lse = values.masked_fill(~in_k, float("-inf")).logsumexp(dim=-1)  # (g,): top-k rows' normaliser
    if widens:  # top-p-only rows normalise over the whole vocabulary
        lse = torch.where(top_k == vocab, scaled.logsumexp(dim=-1), lse)
    probs = (values - lse[:, None]).exp().masked_fill(~in_k, 0.0)  # (g, K)
    if widens and k < vocab and bool((probs.sum(dim=-1) < top_p).any()):
        return truncated_probs(scaled, params, candidates=vocab)
    mass_before = probs.cumsum(dim=-1) - probs  # (g, K): mass of the strictly more likely tokens
    # NOTE: the nucleus is the smallest prefix whose mass reaches top_p; rows at 1.0 skip the mask so
    # that float rounding of the cumsum never drops tail tokens.
    drop = (top_p[:, None] < 1.0) & (mass_before >= top_p[:, None])  # (g, K)
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


def _draw_full(scaled: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """(g, V) scaled logits, (g,) uniforms -> (g,) ids drawn from the whole softmax, no sort needed."""
    return _inverse_cdf(scaled.softmax(dim=-1), u)


def _draw_truncated(scaled: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    probs, order = truncated_probs(scaled, params)  # (g, K) each
    return order.gather(-1, _inverse_cdf(probs, u)[:, None]).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(g, K) unnormalised probs, (g,) uniforms in [0, 1) -> (g,) positions, never a zero-prob one.

    NOTE: a float32 cumsum is monotone over non-negative terms, and its rounding moves each token's
    probability by ~1e-7, far below sampling noise; float64 would triple the cost on a 262k vocabulary.
    """
    cdf = probs.cumsum(dim=-1)  # (g, K)
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]  # (g, 1)
    pos = torch.searchsorted(cdf, target, right=True)  # (g, 1): first position whose cdf exceeds target
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous())  # (g, 1): where the cdf first reaches its total
    return torch.minimum(pos, last).squeeze(-1)


def _dead_as_minus_one(tokens: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
    """(n,) tokens with the rows where `dead` (n,) bool is True set to -1, in place."""
    return tokens if dead is None else tokens.masked_fill_(dead, -1)


def _top_k(p: SamplingParams, vocab: int) -> int:
    """The row's effective top_k; 0 when off or not below the vocabulary size."""
    return p.top_k if 0 < p.top_k < vocab else 0


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return _top_k(p, vocab) > 0 or p.top_p < 1.0


def _temperatures(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """(g, 1) temperatures; NOTE: greedy rows never get here, the floor only guards tiny values."""
    return floats_to_device([max(p.temperature, 1e-5) for p in params], device)[:, None]


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One U[0, 1) number per row from that row's CPU generator (global RNG when None) -> (m,) float64."""
    if not generators:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
