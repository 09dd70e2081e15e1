"""Batched next-token sampling: greedy picks, grammar masks, the drawn rows handed to draw.py.

Owns: turning one step's last-position logits into token ids, and the per-request generator helper.
Does not own: computing the logits (the model runner), the drawn rows' filters and draw (draw.py: min-p,
top-k, top-p, one seeded uniform per row), penalties (penalties.py), nor stop conditions (the scheduler).

On a CPU the greedy picks and the grammar masks of float32 logits go through numpy (`argmax`,
`masked_on_cpu`): numpy's argmax is vectorised where torch's CPU kernel is not, and its calls cost a few
µs where torch's dispatch costs tens; `masked_by_torch` is the same on any other device. The model's
never-sampled tokens are kept out without a copy of the batch's logits: a greedy pick of one is replaced
by its row's best other token, a drawn row filters its own scaled copy, and a masked row's mask forbids
them (`RowMasks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.decoder.draw import draw_rows
from mmserve.decoder.penalties import penalized
from mmserve.decoder.token_history import TokenHistory
from mmserve.messages import SamplingParams
from mmserve.runtime.host_copy import ints_to_device, to_device


@dataclass(frozen=True)
class RowMasks:
    """The tokens that some rows of a batch may not sample (their grammars', `grammar.Grammars.forbidden`).

    NOTE: `forbid` must include the model's never-sampled tokens (`Sampler`'s `never`; `Grammars.forbidden`
    adds them): the sampler does not filter them out of a masked row again. On a CPU, the numpy forms that
    `masked_on_cpu` reads are made here, on the thread that makes the masks (the grammar thread), not after
    the forward: every call after a forward pays for caches the forward has swept (docs/benchmarks.md). (A
    subset that `GrammarStep.finish` takes when the step's rows changed makes its own there: rare.)
    """

    rows: tuple[int, ...]  # the masked rows' indices in the batch's logits (g of them)
    forbid: torch.Tensor  # (g, vocab) bool: True where row rows[j] may not sample the token
    on_host: _HostForms | None = field(init=False, default=None, compare=False, repr=False)  # for a CPU's forbid

    def __post_init__(self) -> None:
        if self.forbid.device.type == "cpu":
            object.__setattr__(self, "on_host", _HostForms(np.asarray(self.rows, dtype=np.int64), self.forbid.numpy()))


@dataclass(frozen=True)
class _HostForms:
    """A CPU's `RowMasks` as numpy reads them."""

    rows: np.ndarray  # (g,) int64: RowMasks.rows
    forbid: np.ndarray  # (g, vocab) bool: RowMasks.forbid's own memory


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
        self._never_tuple = tuple(never)  # the same ids, as the penalties take them
        self._eos = eos_token_ids  # what `min_tokens` holds back

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
               histories: Sequence[TokenHistory | None] | None = None, forbidden: RowMasks | None = None
               ) -> torch.Tensor:
        """(n, vocab) logits, one params and generator per row (and, for penalties, each row's token history,
        None for a row that asks none; for structured output, the tokens some rows' grammars forbid) -> (n,) int64 token
        ids; -1 for a row whose masks left it no token at all (possible only under a grammar)."""
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} rows, {len(params)} params, {len(generators)} generators")
        logits = logits.float()  # (n, V); NOTE: filter in float32 whatever the model dtype
        if any(p.adjusts_logits for p in params):
            if histories is None:
                raise ValueError("penalties need each row's token history")
            logits = penalized(logits, params, histories, self._eos, self._never_tuple)
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
            draw_rows(logits, tokens, rows, params, generators, never)
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
    def _masked(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams],
                masks: RowMasks) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Apply `masks` -> (logits for the draws, (n,) bool: the rows left no token, or None where the host
        knows there are none); `tokens` gets the masked rows' greedy picks.

        NOTE: only the masked rows are touched (a 262k vocabulary makes each pass over a row cost), and the
        logits are copied with them only when one of them draws: a greedy row needs only its masked max.
        """
        greedy = all(params[i].greedy for i in masks.rows)
        if _numpy_can(logits) and masks.on_host is not None:
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
    dispatch takes tens (a step's sampler runs once per token). `tokens` must be writable in place.

    NOTE: as few calls as the results allow, on forms made with the masks (`RowMasks.on_host`): right after a
    forward each distinct call costs tens of µs on this path (docs/benchmarks.md).
    """
    forms = masks.on_host
    if forms is None:
        raise ValueError("masked_on_cpu needs masks on the CPU")
    rows, forbid = forms.rows, forms.forbid  # (g,), (g, V) bool
    values = logits.detach().numpy()  # (n, V) float32, the logits' own memory
    picked = tokens.numpy()  # (n,)
    if greedy and _picks_allowed(values, tokens.tolist(), masks.rows, forbid):
        # NOTE: each row's first maximum is allowed (and finite), so it is also the first maximum of its allowed
        # tokens: the usual case for a trained model following its grammar, and no (g, V) pass is needed
        return logits, None  # no row left without a token
    sub = np.where(forbid, np.float32(-np.inf), values[rows])  # (g, V) float32
    picks = sub.argmax(axis=-1)  # (g,): the first of tied maxima, as torch's
    picked[rows] = picks
    left_none = [j for j, pick in enumerate(picks.tolist()) if sub[j, pick] == -np.inf]  # NOTE: scalar reads
    dead = None  # NOTE: the usual case: no (n,) mask, and the caller then makes no call to apply one
    if left_none:
        dead = torch.zeros(len(values), dtype=torch.bool)  # (n,)
        dead.numpy()[rows[left_none]] = True
    if greedy:
        return logits, dead
    sub[left_none] = 0.0  # NOTE: so that the draws stay defined (no row: nothing)
    drawn = logits.detach().clone()  # (n, V): the caller's logits stay as they were
    drawn.numpy()[rows] = sub
    return drawn, dead


def _picks_allowed(values: np.ndarray, picks: list[int], rows: tuple[int, ...], forbid: np.ndarray) -> bool:
    """Whether every masked row's pick (`picks`, one per row of the (n, V) `values`) is allowed by its
    (g, V) `forbid` row and finite. NOTE: element by element in Python: after a forward each distinct numpy
    call costs µs of cold code, and g scalar reads are cheaper than the vector ops' gather (docs/benchmarks.md)."""
    for j, row in enumerate(rows):
        token = picks[row]
        if forbid[j, token] or not values[row, token] > -np.inf:  # NOTE: a NaN is not finite either
            return False
    return True


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


def _dead_as_minus_one(tokens: torch.Tensor, dead: torch.Tensor | None) -> torch.Tensor:
    """(n,) tokens with the rows where `dead` (n,) bool is True set to -1, in place."""
    return tokens if dead is None else tokens.masked_fill_(dead, -1)

