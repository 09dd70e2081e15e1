"""Sampler: greedy, top-k, top-p, seeds, batch independence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmserve.decoder.sampler as sampler_module
from mmserve.decoder.draw import CANDIDATES, TIE_SLACK, truncated_probs
from mmserve.decoder.sampler import (
    RowMasks,
    Sampler,
    argmax,
    log_softmax,
    make_generator,
    masked_by_torch,
    masked_on_cpu,
)
from mmserve.decoder.token_history import TokenHistory
from mmserve.messages import SamplingParams
from tests.numerics import assert_close_ulps

VOCAB = 50


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # (n, V)


def draw(x: torch.Tensor, params: SamplingParams, seed: int | None, steps: int) -> list[int]:
    """`steps` draws for one (1, V) row with one generator, as a request's life would."""
    gen, sampler = make_generator(seed), Sampler()
    return [int(sampler.sample(x, [params], [gen])[0]) for _ in range(steps)]


def test_greedy_is_argmax() -> None:
    x = logits(6)
    params = [SamplingParams(temperature=0.0)] * 6
    assert torch.equal(Sampler().sample(x, params, [None] * 6), x.argmax(-1))


def test_top_k_1_at_temperature_1_equals_greedy() -> None:
    x = logits(6)
    params = [SamplingParams(temperature=1.0, top_k=1)] * 6
    gens = [make_generator(i) for i in range(6)]
    assert torch.equal(Sampler().sample(x, params, gens), x.argmax(-1))
    probs, order = truncated_probs(x, params)  # the filter alone also keeps only the argmax
    assert torch.equal(order[:, 0], x.argmax(-1)) and torch.all(probs[:, 0] == 1.0)


def test_tiny_top_p_keeps_only_the_argmax() -> None:
    x = logits(4, seed=3)
    params = [SamplingParams(temperature=1.5, top_p=1e-6)] * 4
    for seed in range(20):
        out = Sampler().sample(x, params, [make_generator(seed + i) for i in range(4)])
        assert torch.equal(out, x.argmax(-1))


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    probs, order = truncated_probs(x, [SamplingParams(top_p=0.45)])
    # NOTE: probabilities out of log(p) and back: a few roundings of values <= 1 against exact ones;
    # allclose's default (rtol 1e-5, ~80 float32 ulps) holds on any kernel; a wrong cut is off by >= 0.2.
    assert order[0, 0] == 0 and torch.allclose(probs[0], torch.tensor([1.0, 0.0, 0.0]))
    probs, _ = truncated_probs(x, [SamplingParams(top_p=0.6)])
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0.0]))
    probs, _ = truncated_probs(x, [SamplingParams(top_p=0.85)])
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.3, 0.2]))


@pytest.mark.parametrize("scale", [8.0, 0.01])  # peaked: nucleus in the candidates; flat: a full sort
def test_candidate_shortcut_equals_a_full_sort(scale: float) -> None:
    vocab = 3 * CANDIDATES
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)) * scale
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=1500, top_p=0.8), SamplingParams(top_k=7)]
    fast, fast_ids = truncated_probs(x, params)
    slow, slow_ids = truncated_probs(x, params, candidates=vocab)
    k = fast.shape[1]
    assert (k == vocab) == (scale < 1.0)
    # the same probabilities, the normaliser a logsumexp over 1024 or 3072 terms: ~log2(n) roundings
    # in a pairwise sum, so 16 ulps of the largest probability
    assert torch.equal(fast_ids, slow_ids[:, :k])
    assert_close_ulps(fast, slow[:, :k], ulps=16)
    assert torch.all(slow[:, k:] == 0)
    kept = (slow > 0).sum(-1)
    assert kept[2] == 7 and kept[1] <= 1500


@pytest.mark.parametrize("scale", [8.0, 0.01])
def test_rows_that_all_have_a_top_k_take_only_their_k_best_and_equal_a_full_sort(scale: float) -> None:
    """Gemma's own sampling (top_k 64, top_p 0.95): top-p applies within a row's k best, so they are all it needs,
    however flat the row (no widening, which off a CPU would read back)."""
    vocab = 3 * CANDIDATES
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(6)) * scale
    params = [SamplingParams(top_k=64, top_p=0.95), SamplingParams(top_k=20), SamplingParams(top_k=40, top_p=0.5)]
    fast, fast_ids = truncated_probs(x, params)
    slow, slow_ids = truncated_probs(x, params, candidates=vocab)
    k = 64 + TIE_SLACK  # the largest top_k, and past it enough to see whether its k-th best has ties
    assert fast.shape == (3, k)
    assert torch.equal(fast_ids, slow_ids[:, :k])
    assert_close_ulps(fast, slow[:, :k], ulps=16)  # the same k terms normalised, in 80 or 3,072 entries
    assert torch.all(slow[:, 64:] == 0) and torch.all(fast[:, 64:] == 0)
    assert [int(n) for n in (fast > 0).sum(-1)][1] == 20


def test_a_seeded_rows_draws_keep_to_its_logits_when_its_batch_mates_change_the_candidates() -> None:
    """Ties at a row's k-th best (common in logits cast up from bf16) are all kept, as vLLM keeps them, and
    the draw walks them in token-id order: a batch mate that widens the candidates changes nothing."""
    vocab = 3 * CANDIDATES
    row = torch.zeros(vocab)
    row[:40] = 1.0  # 40 tokens tied for best
    row[100:300] = torch.randn(200, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).float() - 2
    for top_k in (8, 40, 64):
        ours = SamplingParams(temperature=1.0, top_k=top_k, top_p=0.95, seed=1)
        kept, ids = truncated_probs(row[None], [SamplingParams(temperature=1.0, top_k=top_k)])
        assert {int(i) for i in ids[0][kept[0] > 0]} >= set(range(40))  # every tie of the k-th best
        for mate in (SamplingParams(temperature=1.0, top_k=500), SamplingParams(temperature=1.0, top_p=0.9)):
            for seed in range(20):
                alone = Sampler().sample(row[None], [ours], [make_generator(seed)])
                batched = Sampler().sample(torch.stack([row, row.flip(0)]), [ours, mate],
                                           [make_generator(seed), None])
                assert int(alone[0]) == int(batched[0]), (top_k, mate, seed)


def test_same_seed_same_tokens_different_seeds_differ() -> None:
    x = logits(1)
    params = SamplingParams(temperature=2.0)
    a, b = draw(x, params, 1234, 40), draw(x, params, 1234, 40)
    c = draw(x, params, 99, 40)
    assert a == b
    assert a != c
    assert len(set(a)) > 3, "a flat distribution draws many tokens"


def test_seeded_row_is_the_same_alone_or_batched() -> None:
    x = logits(5, seed=7)
    params = [SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=s) for s in range(5)]
    sampler = Sampler()
    gens = [make_generator(i) for i in range(5)]
    batched = [sampler.sample(x, params, gens) for _ in range(10)]  # (5,) per step
    for row in range(5):
        gen = make_generator(row)
        alone = [int(sampler.sample(x[row : row + 1], [params[row]], [gen])[0]) for _ in range(10)]
        assert alone == [int(b[row]) for b in batched]
    # a greedy neighbour and an unseeded neighbour do not disturb the seeded row either
    mixed = [SamplingParams(temperature=0.0), params[2], SamplingParams(temperature=1.0)]
    got = sampler.sample(x[[0, 2, 4]], mixed, [None, make_generator(2), None])
    assert int(got[1]) == int(sampler.sample(x[2:3], [params[2]], [make_generator(2)])[0])
    assert int(got[0]) == int(x[0].argmax())


def test_top_k_never_leaves_the_top_k() -> None:
    x = logits(8, seed=11)
    k = 5
    top = x.topk(k, dim=-1).indices  # (8, k)
    params = [SamplingParams(temperature=5.0, top_k=k)] * 8
    sampler, gens = Sampler(), [make_generator(i) for i in range(8)]
    seen: set[int] = set()
    for _ in range(200):
        out = sampler.sample(x, params, gens)
        assert bool((top == out[:, None]).any(-1).all())
        seen.add(int(out[0]))
    assert len(seen) == k, "every one of the top k is reachable at high temperature"


def test_sampling_follows_the_distribution() -> None:
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]]))
    gen = make_generator(0)
    counts = torch.zeros(4)
    for _ in range(2000):
        counts[int(Sampler().sample(x, [SamplingParams()], [gen])[0])] += 1
    # NOTE: seeded, so the same draws on any CPU; 0.04 is ~4 binomial standard deviations at 2000 draws
    assert torch.allclose(counts / 2000, torch.tensor([0.7, 0.2, 0.1, 0.0]), atol=0.04)


def test_helpers() -> None:
    assert make_generator(None) is None
    x = logits(2).to(torch.bfloat16)
    lp = log_softmax(x)
    # a 50-term sum of exps, each a few roundings from exact: far inside allclose's default rtol 1e-5
    assert lp.dtype == torch.float32 and torch.allclose(lp.exp().sum(-1), torch.ones(2))


def test_never_sampled_tokens_are_never_picked_and_the_logits_stay() -> None:
    x = logits(4, seed=5)
    banned = tuple(int(i) for i in x.argmax(-1))  # every row's favourite
    before = x.clone()
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=50.0)
    sampler = Sampler(banned)
    assert not set(sampler.sample(x, [greedy] * 4, [None] * 4).tolist()) & set(banned)
    for seed in range(30):  # at temperature 50 every other token is nearly as likely as the favourite
        out = sampler.sample(x, [hot] * 4, [make_generator(seed * 4 + i) for i in range(4)])
        assert not set(out.tolist()) & set(banned)
    assert torch.equal(x, before)  # the caller's logits are left as the model made them


def test_a_greedy_row_whose_favourite_is_never_sampled_gets_its_best_other_token() -> None:
    x = logits(4, seed=6)
    favourite = x.argmax(-1)  # (4,)
    banned = (int(favourite[0]), int(favourite[2]))  # rows 1 and 3 may still prefer something else
    greedy = SamplingParams(temperature=0.0)
    out = Sampler(banned).sample(x, [greedy] * 4, [None] * 4)
    expected = x.index_fill(1, torch.tensor(banned), float("-inf")).argmax(-1)
    assert torch.equal(out, expected) and not set(out.tolist()) & set(banned)
    assert out[0] != favourite[0] and out[2] != favourite[2]


def tied(n: int) -> torch.Tensor:
    """(n, V) logits rounded to a few values, so that most rows tie for their maximum."""
    return logits(n, seed=3).round().clamp(-2, 2)


def test_argmax_takes_each_rows_first_maximum_as_torch_does() -> None:
    x = tied(16)
    assert torch.equal(argmax(x), x.argmax(-1)) and argmax(x).dtype == torch.int64
    half = x.bfloat16()  # numpy has no bfloat16: torch's kernel
    assert torch.equal(argmax(half), half.argmax(-1))


@pytest.mark.parametrize("greedy", [True, False])
def test_masks_in_numpy_give_what_torchs_kernels_give(greedy: bool) -> None:
    x = tied(6)
    forbid = torch.rand(4, VOCAB, generator=torch.Generator().manual_seed(1)) < 0.7  # (4, V)
    forbid[2] = True  # batch row 3: its grammar leaves it no token
    masks = RowMasks((0, 2, 3, 5), forbid)
    results = []
    for way in (masked_on_cpu, masked_by_torch):
        tokens = argmax(x)
        drawn, dead = way(x, tokens, masks, greedy)
        results.append((tokens, drawn, dead))
    (t_np, d_np, dead_np), (t_torch, d_torch, dead_torch) = results
    assert torch.equal(t_np, t_torch) and dead_rows(dead_np) == dead_rows(dead_torch) == [3]
    assert torch.equal(d_np, d_torch)
    allowed = ~forbid[[0, 1, 3]]
    assert all(bool(allowed[j, t_np[i]]) for j, i in enumerate((0, 2, 5)))  # picks obey their masks
    assert torch.equal(x, tied(6)) and (d_np is x) == greedy  # the caller's logits stay; copied only to draw


def test_greedy_rows_whose_favourites_their_masks_allow_keep_them_without_a_pass_over_the_masks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = tied(6)
    forbid = torch.rand(3, VOCAB, generator=torch.Generator().manual_seed(2)) < 0.7  # (3, V)
    favourites = argmax(x)[[0, 2, 5]]  # each row's first maximum: no tie before it
    for j, token in enumerate(favourites.tolist()):
        forbid[j, :token] = True
        forbid[j, token] = False
    masks = RowMasks((0, 2, 5), forbid)
    tokens = argmax(x)
    _, dead = masked_by_torch(x, tokens, masks, True)  # the masks applied
    assert tokens[[0, 2, 5]].tolist() == favourites.tolist() and dead_rows(dead) == []

    def no_pass(*args: object) -> None:
        raise AssertionError("a (g, V) pass over the masks")
    monkeypatch.setattr(np, "where", no_pass)
    fast = argmax(x)
    drawn, dead = masked_on_cpu(x, fast, masks, True)
    assert torch.equal(fast, tokens) and dead is None and drawn is x


def test_a_row_with_no_finite_logit_is_left_without_a_token_whatever_its_mask_allows() -> None:
    x = tied(2)
    x[1] = float("-inf")  # e.g. every token penalised away: its first maximum, token 0, is -inf
    masks = RowMasks((0, 1), torch.zeros(2, VOCAB, dtype=torch.bool))  # the grammars allow everything
    for way in (masked_on_cpu, masked_by_torch):
        _, dead = way(x, argmax(x), masks, True)
        assert dead_rows(dead) == [1]


def dead_rows(dead: torch.Tensor | None) -> list[int]:
    """The rows an (n,) bool `dead` marks (None: none)."""
    return [] if dead is None else dead.nonzero().flatten().tolist()


def test_the_accelerators_path_samples_what_the_hosts_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch-only path (any device but a CPU's float32) on the CPU: never-sampled tokens filtered before the
    pick, masks by torch kernels, dead rows as a mask, draws and penalties from host-built indices."""
    x = tied(8)
    banned = (int(x[0].argmax()), int(x[4].argmax()))  # row 0's and row 4's favourites
    forbid = torch.rand(3, VOCAB, generator=torch.Generator().manual_seed(4)) < 0.6  # (3, V)
    forbid[:, list(banned)] = True  # RowMasks forbid the never-sampled tokens themselves
    forbid[1] = True  # batch row 2: its grammar leaves it no token
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias=((7, 2.0),)),
              SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, min_tokens=4),
              SamplingParams(temperature=1.0, presence_penalty=1.0)]
    histories = [TokenHistory.of([3, 7], [1, 2, 2, 9])] * 8

    def sample() -> torch.Tensor:
        gens = [make_generator(100 + i) for i in range(8)]
        return Sampler(banned, eos_token_ids=(1,)).sample(x, params, gens, histories, RowMasks((1, 2, 5), forbid))

    on_host = sample()
    monkeypatch.setattr(sampler_module, "_numpy_can", lambda logits: False)
    off_host = sample()
    assert torch.equal(on_host, off_host), (on_host, off_host)
    assert on_host[2] == -1 and not set(on_host.tolist()) & set(banned)


def test_a_row_with_fewer_tokens_left_than_its_top_k_keeps_them_all_without_a_full_sort(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar's mask or min-p may leave a row fewer finite logits than its top_k: its k-th best is -inf, which
    is no tie to look past (each widening was another topk, up to a sort of the whole vocabulary)."""
    import mmserve.decoder.draw as draw

    widths: list[int] = []
    best = draw._best

    def counted(scaled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        widths.append(k)
        return best(scaled, k)

    monkeypatch.setattr(draw, "_best", counted)
    row = torch.full((3 * CANDIDATES,), float("-inf"))
    row[[3, 70, 900, 1500, 2000]] = torch.tensor([1.0, 0.5, 0.5, 0.25, 0.0])
    probs, ids = truncated_probs(row[None], [SamplingParams(temperature=1.0, top_k=64)])
    assert widths == [64 + TIE_SLACK]  # one look, no widening
    assert sorted(int(i) for i in ids[0][probs[0] > 0]) == [3, 70, 900, 1500, 2000]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.95),
                                    SamplingParams(temperature=1.0, top_k=8, top_p=0.95)])
def test_a_row_of_nan_logits_gets_a_token_and_its_batch_mates_theirs(params: SamplingParams) -> None:
    """A broken checkpoint's NaN row must not fail the step for everyone (an index past the candidates)."""
    x = logits(3)
    x[1] = float("nan")
    alone = [int(Sampler().sample(x[i:i + 1], [params], [make_generator(i)])[0]) for i in (0, 2)]
    got = Sampler().sample(x, [params] * 3, [make_generator(0), make_generator(1), make_generator(2)])
    assert 0 <= int(got[1]) < VOCAB and [int(got[0]), int(got[2])] == alone


def test_a_temperature_below_1e_5_is_greedy_as_in_vllm() -> None:
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy
    x = torch.tensor([[5.0, 5.0, 1.0]])  # tied best: a draw at a tiny temperature would pick either
    assert {int(Sampler().sample(x, [SamplingParams(temperature=1e-6)], [make_generator(s)])[0])
            for s in range(8)} == {0}


def test_a_top_p_rows_kept_ties_do_not_depend_on_how_many_candidates_topk_returned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`topk` keeps an arbitrary few of the ties at its last place; a nucleus ending on those ties is taken
    from a wider cut, so its kept ids are those of a full sort whatever K its batch mates set."""
    import mmserve.decoder.draw as draw_module

    real = draw_module._best

    def arbitrary(scaled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As `topk` may: of the ties at the cut, the highest ids (not the lowest)."""
        if k >= scaled.shape[-1]:
            return real(scaled, k)
        order = torch.argsort(scaled - torch.arange(scaled.shape[-1]) * 1e-6, dim=-1, descending=True)[:, :k]
        order = order.sort(dim=-1).values
        flipped = scaled.gather(-1, order)
        values, by_value = flipped.sort(dim=-1, descending=True, stable=True)
        return values, order.gather(-1, by_value)

    row = torch.ones(64)
    row[:4] = torch.tensor([5.0, 4.0, 3.0, 2.0])  # then 60 tokens tied at 1.0
    params = [SamplingParams(temperature=1.0, top_p=0.595)]  # the nucleus takes 2 of the ties
    full, full_ids = truncated_probs(row[None], params, candidates=64)
    monkeypatch.setattr(draw_module, "_best", arbitrary)
    cut, cut_ids = truncated_probs(row[None], params, candidates=8)
    assert {int(i) for i in full_ids[0][full[0] > 0]} == {0, 1, 2, 3, 4, 5}  # the lowest-id ties
    assert {int(i) for i in cut_ids[0][cut[0] > 0]} == {0, 1, 2, 3, 4, 5}
