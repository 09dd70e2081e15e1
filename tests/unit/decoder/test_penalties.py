"""penalties.py against hand-computed references on a 4-token vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from mmserve.decoder.penalties import penalized
from mmserve.decoder.sampler import Sampler
from mmserve.messages import SamplingParams

ROW = [2.0, -1.0, 0.5, 3.0]
OUTPUT, PROMPT = [3, 3, 2], [0]  # token 3 twice and token 2 once in the output; token 0 in the prompt
INF = -math.inf


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(frequency_penalty=0.5), [2.0, -1.0, 0.0, 2.0]),  # minus 0.5 per occurrence
    (SamplingParams(presence_penalty=0.5), [2.0, -1.0, 0.0, 2.5]),  # minus 0.5 once per token present
    (SamplingParams(frequency_penalty=-1.0), [2.0, -1.0, 1.5, 5.0]),  # negative: encourages repeats
    (SamplingParams(repetition_penalty=2.0), [1.0, -1.0, 0.25, 1.5]),  # prompt and output tokens; > 0 halved
    (SamplingParams(repetition_penalty=2.0, logit_bias=((1, 3.0),)), [1.0, 2.0, 0.25, 1.5]),  # 1 is not seen
    (SamplingParams(logit_bias=((1, 5.0), (3, -100.0), (99, 1.0))), [2.0, 4.0, 0.5, -97.0]),  # 99: no such id
    (SamplingParams(min_tokens=5, stop_token_ids=(0,)), [INF, -1.0, 0.5, INF]),  # eos (3) and stop id masked
    (SamplingParams(min_tokens=3), ROW),  # three tokens out already
    (SamplingParams(allowed_token_ids=(1, 2)), [INF, -1.0, 0.5, INF]),  # only those two may come
    (SamplingParams(allowed_token_ids=(0, 2), logit_bias=((0, 1.0), (1, 9.0))), [3.0, INF, 0.5, INF]),  # then biased
    (SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
     [1.0, -1.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25]),  # repetition first, then the OpenAI penalties
])
def test_each_adjustment_as_defined(params: SamplingParams, expected: list[float]) -> None:
    out = penalized(torch.tensor([ROW]), [params], [OUTPUT], [PROMPT], eos_token_ids=(3,))
    assert out[0].tolist() == pytest.approx(expected)


def test_rows_that_ask_nothing_are_untouched_and_nothing_is_copied_when_none_asks() -> None:
    logits = torch.tensor([ROW, ROW])
    out = penalized(logits, [SamplingParams(), SamplingParams(presence_penalty=1.0)], [OUTPUT] * 2, [PROMPT] * 2, ())
    assert out[0].tolist() == ROW and out[1].tolist() != ROW and logits[1].tolist() == ROW
    plain = [SamplingParams()] * 2
    assert penalized(logits, plain, [OUTPUT] * 2, [PROMPT] * 2, ()) is logits


def test_the_sampler_samples_from_the_adjusted_logits() -> None:
    sampler = Sampler(eos_token_ids=(3,))
    greedy = SamplingParams(temperature=0.0)
    assert sampler.sample(torch.tensor([ROW]), [greedy], [None]).tolist() == [3]
    biased = SamplingParams(temperature=0.0, logit_bias=((1, 10.0),))
    assert sampler.sample(torch.tensor([ROW]), [biased], [None], [OUTPUT], [PROMPT]).tolist() == [1]
    held = SamplingParams(temperature=0.0, min_tokens=4)
    assert sampler.sample(torch.tensor([ROW]), [held], [None], [OUTPUT], [PROMPT]).tolist() == [0]
