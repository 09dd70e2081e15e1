"""A step's reported log-probs: only the rows that asked and got a token, each with its own number of
alternatives, from the raw logits' log-softmax."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from mmserve.api.logprobs import FORBIDDEN_LOGPROB, choice_logprobs
from mmserve.decoder.sampler import RowMasks
from mmserve.decoder.step_logprobs import asked_logprobs, read_tokens, shaped_logprobs
from mmserve.messages import SamplingParams, TokenLogprob


def step_logprobs(logits: torch.Tensor, sampled: torch.Tensor, sampling: list[SamplingParams],
                  piece: Callable[[int], tuple[str, bytes]], masks: RowMasks | None = None) -> dict[int, TokenLogprob]:
    """What a decoder step does around its other work: compute on the device, read with the tokens, shape."""
    asked = asked_logprobs(logits, sampled, sampling, masks)
    tokens, table = read_tokens(sampled, asked)
    return shaped_logprobs(asked, table, tokens, sampling, piece)


def test_rows_that_asked_get_their_token_and_own_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # (3, 4)
    sampled = torch.tensor([2, 0, 1])
    sampling = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=0)]
    out = step_logprobs(logits, sampled, sampling, piece=lambda t: (f"<{t}>", f"<{t}>".encode()))
    assert sorted(out) == [0, 2]  # row 1 did not ask
    first = out[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert first.token_id == 2 and first.token == "<2>"
    assert math.isclose(first.logprob, float(expected[2]), rel_tol=1e-6)
    assert [(t, text) for t, text, _, _ in first.top] == [(3, "<3>"), (2, "<2>")]  # best first
    assert math.isclose(out[2].logprob, math.log(0.25), rel_tol=1e-6)
    assert out[2].top == ()


def test_a_row_left_without_a_token_reports_nothing():
    logits = torch.zeros(2, 5)
    sampled = torch.tensor([-1, 3])
    out = step_logprobs(logits, sampled, [SamplingParams(logprobs=1)] * 2, piece=lambda t: (str(t), b""))
    assert list(out) == [1]


def test_a_grammar_rows_log_probs_are_over_the_tokens_its_grammar_allows():
    """As vLLM, whose grammar bitmask is applied to the logits its sampler reads: a forbidden token is -inf
    (shown as -9999 at the edge), and the allowed ones share all the mass."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])  # (2, 4)
    sampled = torch.tensor([1, 3])
    masks = RowMasks((0,), torch.tensor([[True, False, True, True]]))  # row 0 may sample token 1 only
    sampling = [SamplingParams(logprobs=3), SamplingParams(logprobs=1)]
    out = step_logprobs(logits, sampled, sampling, piece=lambda t: (str(t), str(t).encode()),
                        masks=masks)
    assert out[0].logprob == 0.0 and out[0].top[0][:2] == (1, "1")  # the only token allowed: all the mass
    assert [lp for _, _, lp, _ in out[0].top[1:]] == [float("-inf")] * 2
    assert math.isclose(out[1].logprob, float(torch.log_softmax(logits[1], -1)[3]), rel_tol=1e-6)  # unmasked
    rendered = choice_logprobs([out[0]]).content[0]
    assert [t.logprob for t in rendered.top_logprobs] == [0.0, FORBIDDEN_LOGPROB, FORBIDDEN_LOGPROB]
    assert rendered.model_dump_json()  # JSON has no -inf


def test_a_nan_logprob_is_sent_as_the_floor_json_can_hold() -> None:
    """A broken checkpoint's NaN logits: JSON has no NaN, and a client's parser refuses one."""

    rendered = choice_logprobs([TokenLogprob(5, "x", math.nan, b"x", ((5, "x", math.nan, b"x"),))]).content[0]
    assert rendered.logprob == FORBIDDEN_LOGPROB and rendered.top_logprobs[0].logprob == FORBIDDEN_LOGPROB


def test_tokens_and_log_probs_come_back_in_one_copy_exactly() -> None:
    """The step reads its tokens and the asking rows' table at once: every id exact (the vocabulary's last
    too), -1 kept, a forbidden token's -inf kept."""
    vocab = 262_144
    logits = torch.full((3, vocab), -5.0)
    logits[0, vocab - 1], logits[2, 7] = 9.0, 4.0
    sampled = torch.tensor([vocab - 1, -1, 7])
    masks = RowMasks((2,), torch.ones(1, vocab, dtype=torch.bool).index_fill_(1, torch.tensor([7]), False))
    asked = asked_logprobs(logits, sampled, [SamplingParams(logprobs=2)] * 3, masks)
    assert asked is not None
    tokens, table = read_tokens(sampled, asked)
    assert tokens == [vocab - 1, -1, 7] and all(isinstance(t, int) for t in tokens)
    assert table[0][3] == vocab - 1 and table[2][:2] == [0.0, 0.0] and table[2][2] == float("-inf")
    assert read_tokens(sampled, None) == ([vocab - 1, -1, 7], [])
