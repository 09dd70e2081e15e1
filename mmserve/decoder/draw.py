"""The sampled (non-greedy) rows of a step: temperature, min-p, top-k and top-p, then one draw per row.

Owns: filtering each drawn row's temperature-scaled logits (vLLM's order: min-p, then top-k, then top-p
within them) and the inverse-CDF draw with one uniform number from the row's own generator, so a seeded row
gets the same token batched or alone, on any device. Does not own greedy picks, grammar masks or the
never-sampled tokens' fix of greedy rows (sampler.py), nor penalties (penalties.py).
"""

from __future__ import annotations

import torch

from mmserve.messages import SamplingParams
from mmserve.runtime.host_copy import floats_to_device, ints_to_device, to_device

CANDIDATES = 1024  # tokens a top-p-only row is first truncated to; a full sort only if its nucleus is wider
TIE_SLACK = 16  # candidates past the largest top_k, to see whether the k-th best's ties go on (tokens)


def draw_rows(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], params: list[SamplingParams],
              generators: list[torch.Generator | None], never: torch.Tensor) -> None:
    """Draw the tokens of the sampled `rows` of the (n, V) `logits` into `tokens` (n,), never one of the (k,)
    never-sampled ids `never`."""
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
            apply_min_p([params[rows[j]].min_p for j in group], scaled)
            drawn = draw(scaled, [params[rows[j]] for j in group], to_device(u[group], device))  # (g,)
            tokens.index_copy_(0, index, drawn)


def truncated_probs(scaled: torch.Tensor, params: list[SamplingParams],
                    candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, V) temperature-scaled logits -> ((g, K) probabilities after top-k then top-p, (g, K) ids).

    The probabilities are renormalised over the kept tokens.

    Both are in decreasing-logit order over the K most likely tokens, tied logits in token-id order, so every
    kept set is a prefix of its row and the first token is always kept. Top-k keeps every token tied with the
    k-th best too (vLLM's rule), and top-p applies to the distribution renormalised after top-k.
    NOTE: a row's kept tokens and their order depend on its logits only, never on K, which its batch mates set
    (ties are common in logits cast up from bf16): a seeded row draws the same token batched or alone.
    NOTE: a full sort is far slower than `topk` on CPU, so K is the largest top_k (plus TIE_SLACK, to see past a
    k-th best's ties) when every row has one (top-p never goes past a row's k best: Gemma's own top_k 64, top_p
    0.95), else that or CANDIDATES, widened when ties or a nucleus reach past them.
    """
    vocab, device = scaled.shape[-1], scaled.device
    ks = [_top_k(p, vocab) for p in params]  # 0 where a row has no top_k
    widens = not all(ks)  # NOTE: a row without a top_k may have a nucleus wider than the candidates
    if candidates is None:  # NOTE: off the CPU a full sort is cheap, and a widening check would read back
        candidates = (CANDIDATES if widens else 0) if device.type == "cpu" else vocab
    top_k = ints_to_device([k or vocab for k in ks], device)  # (g,)
    top_p = floats_to_device([p.top_p for p in params], device)  # (g,)
    k = min(vocab, max(candidates, max(ks) + TIE_SLACK))
    values, order = _best(scaled, k)  # (g, K) each
    kth = values.gather(-1, (top_k - 1).clamp(max=k - 1)[:, None])  # (g, 1): each row's k-th best logit
    in_k = values >= kth  # (g, K); a row without a top_k keeps all
    # NOTE: a k-th best of -inf (fewer tokens left than k: a grammar's mask, min-p) keeps every finite one,
    # whatever K: no widening for it
    beyond = in_k[:, -1] & (top_k < vocab) & torch.isfinite(kth[:, 0])  # (g,): ties that may go past K
    if k < vocab and bool(beyond.any()):
        return truncated_probs(scaled, params, candidates=2 * k)
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
    if widens and k < vocab and bool(_ties_past(values, drop, top_k == vocab).any()):
        return truncated_probs(scaled, params, candidates=2 * k)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


def _ties_past(values: torch.Tensor, drop: torch.Tensor, top_p_only: torch.Tensor) -> torch.Tensor:
    """(g,) whether a top-p-only row's nucleus ends on a logit that the last candidate ties: the ties may go on
    past the K candidates, where `topk` kept an arbitrary few of them, so which of them are kept (by id) would
    change with K, i.e. with the batch mates."""
    last_kept = values.gather(-1, ((~drop).sum(dim=-1, keepdim=True) - 1))  # (g, 1)
    return top_p_only & (last_kept[:, 0] == values[:, -1]) & torch.isfinite(values[:, -1])


def _best(scaled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, V) -> ((g, k) the k largest values in decreasing order, tied ones in token-id order; (g, k) their ids).

    NOTE: `topk` orders tied values as its algorithm meets them, which changes with k: re-sorted by id, then
    stably by value (on k entries, cheap).
    """
    if k >= scaled.shape[-1]:
        return scaled.sort(dim=-1, descending=True, stable=True)  # NOTE: stable: ties stay in id order
    values, order = scaled.topk(k, dim=-1)
    order, by_id = order.sort(dim=-1)
    values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, order.gather(-1, by_value)


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
    # NOTE: clamped: a row of NaN (a broken checkpoint's logits) finds no position, and its draw must still be
    # a token, or the batch's gather fails with it
    return torch.minimum(pos, last).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def apply_min_p(min_ps: list[float], scaled: torch.Tensor) -> None:
    """Set to -inf, in place, each (g, V) row's scaled logits whose probability is below its min_p times its
    likeliest token's (vLLM's min-p, applied as vLLM does: after temperature, before top-k and top-p).

    NOTE: p / p_max >= min_p is s - s_max >= log(min_p) on the scaled logits: no softmax is needed, and a row
    at 0 compares against -inf, so it keeps every token. The likeliest token always stays.
    """
    if not any(min_ps):
        return
    floor = scaled.amax(dim=-1, keepdim=True) + floats_to_device(min_ps, scaled.device).log()[:, None]  # (g, 1)
    scaled.masked_fill_(scaled < floor, float("-inf"))


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
