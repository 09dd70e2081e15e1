"""The drawn rows' min-p filter (vLLM's): its definition on probabilities, its place after temperature and
before top-p, and draws that stay inside it."""

from __future__ import annotations

import math

import torch

from mmserve.decoder.draw import apply_min_p
from mmserve.decoder.sampler import Sampler, make_generator
from mmserve.messages import SamplingParams


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_times_as_likely_as_the_likeliest() -> None:
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 3  # (6, 50)
    min_ps = [0.0, 0.05, 0.1, 0.3, 0.9, 1.0]
    probs = x.softmax(dim=-1)
    expected = probs >= torch.tensor(min_ps)[:, None] * probs.amax(dim=-1, keepdim=True)  # vLLM's definition
    got = x.clone()
    apply_min_p(min_ps, got)
    assert torch.equal(got > float("-inf"), expected)
    assert torch.equal(got[expected], x[expected]), "kept tokens keep their logits"
    assert bool(expected[0].all()) and int(expected[-1].sum()) == 1, "0 keeps every token, 1 only the likeliest"


def seen(x: torch.Tensor, params: SamplingParams, draws: int = 2000) -> torch.Tensor:
    """(V,) how often each token was drawn from the one row `x` (1, V) in `draws` seeded draws."""
    sampler, gen, counts = Sampler(), make_generator(0), torch.zeros(x.shape[-1])
    for _ in range(draws):
        counts[int(sampler.sample(x, [params], [gen])[0])] += 1
    return counts / draws


def test_min_p_applies_to_the_temperature_scaled_distribution() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # at temperature 1 the tokens' odds against the likeliest are e^-1 (0.37), e^-2 (0.14), e^-3: min_p 0.3 keeps two
    freq = seen(x, SamplingParams(temperature=1.0, min_p=0.3))
    p0 = 1 / (1 + math.exp(-1))
    assert freq[2:].sum() == 0
    # NOTE: seeded, so the same draws on any CPU; 0.04 is ~4 binomial standard deviations at 2000 draws
    assert abs(float(freq[0]) - p0) < 0.04
    # at temperature 2 the odds are e^-0.5, e^-1 (0.37), e^-1.5 (0.22): three kept
    freq = seen(x, SamplingParams(temperature=2.0, min_p=0.3))
    assert freq[3] == 0 and bool((freq[:3] > 0).all())


def test_min_p_comes_before_top_p_as_in_vllm() -> None:
    x = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # min_p 0.3 drops 0.1 (< 0.12); renormalised, the first two hold 0.78 >= top_p 0.75, so the third goes too.
    # (top-p first, as transformers orders them, would keep three: 0.4 + 0.3 < 0.75)
    assert torch.equal(seen(x, SamplingParams(min_p=0.3, top_p=0.75), 400) > 0,
                       torch.tensor([True, True, False, False]))
    assert torch.equal(seen(x, SamplingParams(top_p=0.75), 400) > 0, torch.tensor([True, True, True, False]))


def test_a_min_p_row_leaves_its_neighbours_draws_as_they_are_alone() -> None:
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 2  # (3, 40)
    plain = SamplingParams(temperature=1.0, seed=7)
    params = [plain, SamplingParams(temperature=1.0, min_p=0.5, top_k=10), SamplingParams(temperature=0.0, min_p=0.9)]
    for step in range(20):
        gens = [make_generator(7 + step), make_generator(8 + step), None]
        together = Sampler().sample(x, params, gens)
        alone = Sampler().sample(x[:1], [plain], [make_generator(7 + step)])
        assert int(together[0]) == int(alone[0])
        assert int(together[2]) == int(x[2].argmax()), "greedy ignores min_p"
        probs = x[1].softmax(dim=-1)
        assert float(probs[int(together[1])]) >= 0.5 * float(probs.max())
