"""penalties.py against hand-computed references on a 4-token vocabulary."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from mmserve.decoder import penalties
from mmserve.decoder.penalties import check_allowed, penalized
from mmserve.decoder.sampler import Sampler
from mmserve.decoder.token_history import TokenHistory
from mmserve.errors import InvalidSamplingError
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
    # a seen token's bias goes first: (3 + 1) / 2, not 3 / 2 + 1
    (SamplingParams(repetition_penalty=2.0, logit_bias=((3, 1.0),)), [1.0, -1.0, 0.25, 2.0]),
    (SamplingParams(logit_bias=((1, 5.0), (3, -100.0), (99, 1.0))), [2.0, 4.0, 0.5, -97.0]),  # 99: no such id
    (SamplingParams(min_tokens=5, stop_token_ids=(0,)), [INF, -1.0, 0.5, INF]),  # eos (3) and stop id masked
    (SamplingParams(min_tokens=3), ROW),  # three tokens out already
    (SamplingParams(allowed_token_ids=(1, 2)), [INF, -1.0, 0.5, INF]),  # only those two may come
    # bad words (output 3 3 2): a one-token word always (1); a longer one where the output ends with its head
    # (3 2 -> 0 masked), not elsewhere (2 2 -> 3, 7 -> 9)
    (SamplingParams(bad_words_token_ids=((1,), (3, 2, 0), (2, 2, 3), (7, 9))), [INF, INF, 0.5, 3.0]),
    (SamplingParams(allowed_token_ids=(0, 2), logit_bias=((0, 1.0), (1, 9.0))), [3.0, INF, 0.5, INF]),  # then biased
    (SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
     [1.0, -1.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25]),  # repetition first, then the OpenAI penalties
])
def test_each_adjustment_as_defined(params: SamplingParams, expected: list[float]) -> None:
    out = penalized(torch.tensor([ROW]), [params], [TokenHistory.of(PROMPT, OUTPUT)], eos_token_ids=(3,))
    assert out[0].tolist() == pytest.approx(expected)


def test_the_repetition_penalty_pushes_a_seen_negative_logit_further_down() -> None:
    """A seen token's logit < 0 is multiplied (-1 -> -2), so a repeat gets less likely, never more."""
    out = penalized(torch.tensor([ROW]), [SamplingParams(repetition_penalty=2.0)], [TokenHistory.of([1], OUTPUT)],
                    eos_token_ids=(3,))
    assert out[0].tolist() == pytest.approx([2.0, -2.0, 0.25, 1.5])


def test_rows_that_ask_nothing_are_untouched_and_nothing_is_copied_when_none_asks() -> None:
    logits = torch.tensor([ROW, ROW])
    out = penalized(logits, [SamplingParams(), SamplingParams(presence_penalty=1.0)],
                    [TokenHistory.of(PROMPT, OUTPUT)] * 2, ())
    assert out[0].tolist() == ROW and out[1].tolist() != ROW and logits[1].tolist() == ROW
    plain = [SamplingParams()] * 2
    assert penalized(logits, plain, [TokenHistory.of(PROMPT, OUTPUT)] * 2, ()) is logits


def test_the_sampler_samples_from_the_adjusted_logits() -> None:
    sampler = Sampler(eos_token_ids=(3,))
    greedy = SamplingParams(temperature=0.0)
    assert sampler.sample(torch.tensor([ROW]), [greedy], [None]).tolist() == [3]
    biased = SamplingParams(temperature=0.0, logit_bias=((1, 10.0),))
    assert sampler.sample(torch.tensor([ROW]), [biased], [None], [TokenHistory.of(PROMPT, OUTPUT)]).tolist() == [1]
    held = SamplingParams(temperature=0.0, min_tokens=4)
    assert sampler.sample(torch.tensor([ROW]), [held], [None], [TokenHistory.of(PROMPT, OUTPUT)]).tolist() == [0]


@pytest.mark.parametrize(("params", "never"), [
    (SamplingParams(allowed_token_ids=(7,)), (7,)),  # only a token the model never samples
    (SamplingParams(allowed_token_ids=(3, 0), min_tokens=2, stop_token_ids=(0,)), ()),  # only ends, held back
    (SamplingParams(allowed_token_ids=(2,), bad_words_token_ids=((2,),)), ()),  # only a one-token bad word
])
def test_allowed_ids_that_leave_no_token_are_refused(params: SamplingParams, never: tuple[int, ...]) -> None:
    with pytest.raises(InvalidSamplingError, match="allowed_token_ids") as info:
        check_allowed(params, never, eos_token_ids=(3,))
    assert info.value.param == "allowed_token_ids"
    check_allowed(replace(params, allowed_token_ids=(*(params.allowed_token_ids or ()), 1)), never, eos_token_ids=(3,))


def test_a_row_its_bad_words_leave_without_an_allowed_token_ends_instead_of_sampling_from_nothing() -> None:
    # allowed 2 only, and "3 2" a bad word: an output ending with 3 bans 2 too
    params = SamplingParams(allowed_token_ids=(2,), bad_words_token_ids=((3, 2),))
    out = penalized(torch.tensor([ROW]), [params], [TokenHistory.of(PROMPT, [2, 3])], eos_token_ids=(3,))
    assert out[0].tolist() == [INF, INF, INF, 0.0]  # the end (3) alone, at 0
    out = penalized(torch.tensor([ROW]), [params], [TokenHistory.of(PROMPT, [2])], (3,))
    assert out[0].tolist() == [INF, INF, 0.5, INF]


def test_a_row_whose_only_allowed_tokens_left_are_never_sampled_ends_too() -> None:
    """Allowed 1 and 2, "3 2" a bad word, and 1 a token the sampler never picks: nothing is left but the end."""
    params = SamplingParams(allowed_token_ids=(1, 2), bad_words_token_ids=((3, 2),))
    out = penalized(torch.tensor([ROW]), [params], [TokenHistory.of(PROMPT, [2, 3])], (3,), never=(1,))
    assert out[0].tolist() == [INF, -1.0, INF, 0.0]  # the end at 0: the sampler's pick, greedy or drawn
    for temperature in (0.0, 1.0):
        picked = Sampler(never=(1,), eos_token_ids=(3,)).sample(
            torch.tensor([ROW]), [replace(params, temperature=temperature)], [None],
            histories=[TokenHistory.of(PROMPT, [2, 3])])
        assert int(picked[0]) == 3, temperature


def test_the_allowed_ids_kept_as_tensors_are_bounded_in_ids_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recent requests' allowed lists are kept (a step would rebuild them): not without bound in their length."""
    monkeypatch.setattr(penalties, "_ALLOWED", {})
    monkeypatch.setattr(penalties, "_ALLOWED_KEPT_IDS", 1000)
    lists = [tuple(range(300)) for _ in range(10)]  # held alive, as live requests hold theirs
    for ids in lists:
        assert penalties._allowed_on(ids, 512, torch.device("cpu")).tolist() == list(ids)
    assert sum(len(kept[0]) for kept in penalties._ALLOWED.values()) <= 1000
    assert penalties._allowed_on(lists[-1], 512, torch.device("cpu")) is penalties._ALLOWED[id(lists[-1]), id(())][2]
    # the ids a step checks for "nothing left" (the allowed less the never-sampled): made once as well
    never = (5, 7)
    left = penalties._allowed_on(lists[-1], 512, torch.device("cpu"), never)
    assert 5 not in left.tolist() and len(left) == 298
    assert penalties._allowed_on(lists[-1], 512, torch.device("cpu"), never) is left
