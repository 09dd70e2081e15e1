"""The grammar plumbing: bitmasks from llguidance matchers and their application to a batch's logits."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from mmserve.decoder.constraint import InvalidGrammarError, check
from mmserve.decoder.grammar import Grammars, _forbidden_on, _without_bits, forbidden
from mmserve.decoder.grammar_step import GrammarStep
from mmserve.decoder.sampler import RowMasks, Sampler
from mmserve.messages import SamplingParams, StructuredOutput


def bits_allowing(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """(g, words) int32 bitmask with exactly `allowed[i]` set in row i."""
    mask = torch.zeros((len(allowed), (vocab + 31) // 32), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            mask[row, t // 32] |= 1 << (t % 32)
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)  # bit 31 is the sign bit


def test_forbidden_unpacks_each_row_to_exactly_its_disallowed_tokens() -> None:
    vocab = 70  # not a multiple of 32: the last word's spare bits must not matter
    allowed = [{0, 31, 32, 69}, {5}, set(range(vocab))]
    out = forbidden(bits_allowing(allowed, vocab), vocab, torch.device("cpu"))
    assert out.shape == (3, vocab) and out.dtype == torch.bool
    for row, tokens in enumerate(allowed):
        assert {t for t in range(vocab) if not out[row, t]} == tokens


def test_the_device_unpacking_agrees_with_the_hosts() -> None:
    vocab = 100
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32)
    on_host = forbidden(bitmask, vocab, torch.device("cpu"))
    assert torch.equal(_forbidden_on(torch.device("cpu"), bitmask, vocab), on_host)


def test_the_sampler_picks_only_allowed_tokens_greedy_or_sampled() -> None:
    vocab = 40
    logits = torch.randn(4, vocab)
    allowed = [{7, 9}, {39}, {2, 3}]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    generators = [None, torch.Generator().manual_seed(1), None, None]
    masks = RowMasks((0, 1, 3), forbidden(bits_allowing([allowed[0], allowed[1], allowed[2]], vocab), vocab,
                                          torch.device("cpu")))
    for _ in range(20):
        tokens = Sampler().sample(logits, params, generators, forbidden=masks)
        assert tokens[0].item() == max((7, 9), key=lambda t: logits[0, t].item())
        assert tokens[1].item() == 39 and tokens[2].item() == logits[2].argmax().item()
        assert tokens[3].item() == max((2, 3), key=lambda t: logits[3, t].item())
    assert not torch.isinf(logits).any()  # the caller's logits are left as they were


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_whose_mask_leaves_nothing_gets_minus_one_and_its_neighbours_are_untouched(temperature: float) -> None:
    vocab = 40
    logits = torch.randn(3, vocab)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=temperature, seed=2),
              SamplingParams(temperature=0.0)]
    generators = [None, torch.Generator().manual_seed(2), None]
    masks = RowMasks((1, 2), forbidden(bits_allowing([set(), {11}], vocab), vocab, torch.device("cpu")))
    tokens = Sampler().sample(logits, params, generators, forbidden=masks).tolist()
    assert tokens == [logits[0].argmax().item(), -1, 11]


@pytest.fixture(scope="module")
def grammars(tiny_ckpt_224) -> tuple[Grammars, object]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt_224)
    return Grammars(tokenizer, vocab_size=len(tokenizer) + 50, eos_token_ids=(tokenizer.eos_token_id,)), tokenizer


def test_a_matcher_allows_exactly_the_tokens_that_keep_the_output_in_its_language(grammars) -> None:
    book, tokenizer = grammars
    matcher = book.matcher(StructuredOutput("choice", json.dumps(["yes", "no"])))
    mask = book.bitmask([matcher])
    vocab = len(tokenizer)
    allowed = {t for t in range(book.words * 32) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
    texts = {t: tokenizer.decode([t]) for t in range(vocab)}
    expected = {t for t, text in texts.items() if text and ("yes".startswith(text) or "no".startswith(text))}
    assert allowed == expected and len(expected) >= 4  # "y", "n" and their byte-fallback twins at least
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.consume_token(t)
    assert matcher.is_stopped()  # nothing may follow a complete choice


def test_a_finished_json_allows_only_the_end_of_sequence(grammars) -> None:
    book, tokenizer = grammars
    matcher = book.matcher(StructuredOutput("json", '{"type": "object", "additionalProperties": false}'))
    for t in tokenizer.encode("{}", add_special_tokens=False):
        assert matcher.consume_token(t)
    mask = book.bitmask([matcher])
    allowed = {t for t in range(book.words * 32) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
    assert allowed == {tokenizer.eos_token_id}


def test_the_masks_forbid_the_tokens_the_model_never_samples_even_where_the_grammar_allows_them(
        grammars) -> None:
    book, tokenizer = grammars
    matcher = book.matcher(StructuredOutput("regex", "[0-9]+"))
    allowed = ~book.forbidden([matcher], torch.device("cpu")).forbid[0]  # (vocab,)
    digit = int(allowed.nonzero()[0, 0])
    never = Grammars(tokenizer, vocab_size=len(tokenizer) + 50, eos_token_ids=(tokenizer.eos_token_id,),
                     never=(digit,))
    masks = never.forbidden([None, never.matcher(StructuredOutput("regex", "[0-9]+"))], torch.device("cpu"))
    expected = ~allowed
    expected[digit] = True
    assert masks is not None and masks.rows == (1,) and torch.equal(masks.forbid[0], expected)


def test_the_never_sampled_tokens_are_cleared_bit_by_bit_in_the_mask_words() -> None:
    vocab = 70  # NOTE: not a multiple of 32: the last word is partial
    banned = (0, 31, 32, 63, 64, vocab - 1)  # the words' first and sign bits, either side of a boundary, the last
    words = torch.from_numpy(np.full((2, 3), -1, dtype=np.int32) & _without_bits(banned, vocab))  # (2, words)
    expected = torch.zeros(2, vocab, dtype=torch.bool)
    expected[:, list(banned)] = True
    assert torch.equal(forbidden(words, vocab, torch.device("cpu")), expected)
    assert torch.equal(_forbidden_on(torch.device("cpu"), words, vocab), expected)
    for outside in (-1, vocab):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            _without_bits((outside,), vocab)


def test_a_grammar_row_never_gets_a_never_sampled_token_and_is_left_none_if_only_those_are_allowed(
        grammars) -> None:
    plain, tokenizer = grammars
    vocab = len(tokenizer) + 50  # the fixture's
    digits = StructuredOutput("regex", "[0-9]+")
    only = plain.forbidden([plain.matcher(digits)], torch.device("cpu"))
    assert only is not None
    allowed = (~only.forbid[0]).nonzero()[:, 0].tolist()
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))  # (2, V)
    best, runner_up = sorted(allowed, key=lambda t: -logits[0, t].item())[:2]
    for never, expected in (((best,), runner_up), (tuple(allowed), -1)):
        book = Grammars(tokenizer, vocab_size=vocab, eos_token_ids=(tokenizer.eos_token_id,), never=never)
        masks = book.forbidden([book.matcher(digits), None], torch.device("cpu"))
        tokens = Sampler(never).sample(logits, [SamplingParams(temperature=0.0)] * 2, [None] * 2, forbidden=masks)
        assert tokens.tolist() == [expected, logits[1].argmax().item()]


@pytest.mark.parametrize(("structured", "words"), [
    (StructuredOutput("json", '{"type": "nope"}'), "invalid JSON schema"),
    (StructuredOutput("json", "[1, 2"), "invalid JSON schema"),
    (StructuredOutput("regex", "a{2,1}"), "invalid regex"),
    (StructuredOutput("lark", "start: ("), "invalid Lark grammar"),
    # llguidance's options in the client's schema are not taken: `lenient` would drop the keyword, not refuse it
    (StructuredOutput("json", '{"type": "array", "uniqueItems": true, "x-guidance": {"lenient": true}}'),
     "uniqueItems"),
    (StructuredOutput("json", "[" * 100_000), "nested too deeply"),  # past what json's parser recurses into
])
def test_check_names_what_does_not_compile(structured: StructuredOutput, words: str) -> None:
    with pytest.raises(InvalidGrammarError, match=words):
        check(structured)


def test_a_matcher_made_without_the_edges_check_still_refuses_with_a_client_error(grammars) -> None:
    book, _ = grammars
    for structured in (StructuredOutput("json", "[1, 2"), StructuredOutput("json", "true"),
                       StructuredOutput("regex", "(unclosed")):
        with pytest.raises(InvalidGrammarError):
            book.matcher(structured)


@pytest.mark.parametrize("beside", [True, False])
def test_a_steps_masks_are_the_same_beside_the_forward_or_before_it(grammars, beside: bool) -> None:
    book, _ = grammars
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    rows = [("a", book.matcher(choice)), ("b", None), ("c", book.matcher(StructuredOutput("regex", "[0-9]+")))]
    step = GrammarStep(book, torch.device("cpu"))
    expected = book.forbidden([m for _, m in rows], torch.device("cpu"))
    pending = step.start(rows, beside=beside)
    assert (step._thread is not None) == beside  # before the forward: no thread is started at all
    whole, some = GrammarStep.finish(pending, ["a", "b", "c"]), GrammarStep.finish(pending, ["c", "a"])
    assert expected is not None and expected.rows == (0, 2)  # "b" has no grammar
    assert whole is not None and whole.rows == (0, 2) and torch.equal(whole.forbid, expected.forbid)
    assert some is not None and some.rows == (1, 0) and torch.equal(some.forbid, expected.forbid)  # "b" failed
    one = GrammarStep.finish(pending, ["c"])  # "a" failed too: only "c"'s mask is left
    assert one is not None and one.rows == (0,) and torch.equal(one.forbid, expected.forbid[1:])
    assert GrammarStep.finish(pending, ["b"]) is None  # the grammar rows failed in the forward
    assert step.start([("b", None)], beside=beside) is None  # no grammar: no work


def spare_core(step: GrammarStep) -> GrammarStep:
    """`step` after a step whose forward left the host a core (masks beside it; the next ones made ahead)."""
    assert step.start([("free", None)], beside=True) is None
    return step


def test_on_full_cores_no_masks_are_made_ahead_and_the_next_step_makes_its_own_before_the_forward(grammars) -> None:
    book, _ = grammars
    a = book.matcher(StructuredOutput("regex", "[0-9]+"))
    step = GrammarStep(book, torch.device("cpu"))
    one = book._vocabulary().tokenize_str("1")[0]
    assert step.start([("a", a)], beside=False) is not None and step._thread is None
    assert step.advance(["a"], [one], [a]) == (set(), {}) and step._ahead is None  # nothing beside the next forward
    made = GrammarStep.finish(step.start([("a", a)], beside=False), ["a"])
    own = book.forbidden([a], torch.device("cpu"))
    assert made is not None and own is not None and step._thread is None and torch.equal(made.forbid, own.forbid)


def test_the_next_steps_masks_start_when_the_matchers_advance(grammars) -> None:
    book, _ = grammars
    digits = StructuredOutput("regex", "[0-9]+")
    a, c = book.matcher(digits), book.matcher(StructuredOutput("regex", "[0-9]+x"))
    step = spare_core(GrammarStep(book, torch.device("cpu")))
    one = book._vocabulary().tokenize_str("1")[0]
    assert step.advance(["a", "b", "c"], [one, 5, one], [a, None, c]) == (set(), {})
    ahead = step._ahead
    assert ahead is not None and ahead[0] == {"a": a, "c": c}  # started for the next step, the free row left out
    # the next step's rows in another order, a free row among them: the masks made ahead, mapped onto them
    rows = [("c", c), ("x", None), ("a", a)]
    ahead[1].exception()  # a matcher whose mask is being made cannot be read meanwhile
    expected = book.forbidden([m for _, m in rows], torch.device("cpu"))
    pending = step.start(rows, beside=False)
    assert pending is ahead[1] and step._ahead is None  # used once
    got = GrammarStep.finish(pending, [rid for rid, _ in rows])
    assert got is not None and expected is not None
    def by_row(m: RowMasks) -> list[tuple[int, list[bool]]]:
        return sorted(zip(m.rows, m.forbid.tolist(), strict=True))

    assert by_row(got) == by_row(expected)
    # a constrained row they do not cover (a request that just joined): the step's masks are made afresh
    spare_core(step).advance(["a"], [one], [a])
    ahead = step._ahead
    fresh = step.start([("a", a), ("n", book.matcher(digits))], beside=False)
    assert ahead is not None and fresh is not ahead[1]
    made = GrammarStep.finish(fresh, ["a", "n"])  # after the ahead masks let go of "a"'s matcher
    assert made is not None and made.rows == (0, 1) and not bool(made.forbid.all(dim=1).any())


def test_masks_made_ahead_are_waited_for_or_made_again_when_they_cannot_serve(grammars, monkeypatch) -> None:
    book, _ = grammars
    digits = StructuredOutput("regex", "[0-9]+")
    step = GrammarStep(book, torch.device("cpu"))
    one = book._vocabulary().tokenize_str("1")[0]
    own = book.forbidden

    def slow(matchers, device, *, background=False):  # the work ahead still running when the step starts
        if background:
            time.sleep(0.2)
        return own(matchers, device, background=background)

    monkeypatch.setattr(book, "forbidden", slow)
    a = book.matcher(digits)
    spare_core(step).advance(["a"], [one], [a])
    ahead = step._ahead
    assert ahead is not None and step.start([("x", None)], beside=False) is None  # no grammar row this step
    assert ahead[1].done()  # waited for: "a"'s matcher is free for the next step's own masks
    # the same request id, a new matcher (a request that ended and came again): not the masks made ahead
    spare_core(step).advance(["a"], [one], [a])
    ahead = step._ahead
    again = book.matcher(digits)
    assert ahead is not None and step.start([("a", again)], beside=False) is not ahead[1]

    def failing(matchers, device, *, background=False):
        if background:
            raise RuntimeError("ahead failed")
        return own(matchers, device)

    monkeypatch.setattr(book, "forbidden", failing)
    spare_core(step).advance(["a"], [one], [a])
    ahead = step._ahead
    assert ahead is not None and isinstance(ahead[1].exception(), RuntimeError)
    made = GrammarStep.finish(step.start([("a", a)], beside=False), ["a"])  # made again on the step's path
    assert made is not None and made.rows == (0,) and not bool(made.forbid.all(dim=1).any())


def test_background_masks_equal_the_matchers_own(grammars) -> None:
    book, _ = grammars
    matchers = [book.matcher(StructuredOutput("regex", "[0-9]+")),
                book.matcher(StructuredOutput("choice", json.dumps(["yes", "no"])))]
    assert torch.equal(book.bitmask(matchers, background=True), book.bitmask(matchers))


@pytest.mark.parametrize("beside", [True, False])
def test_a_mask_that_raises_surfaces_when_the_step_collects_it(grammars, beside: bool, monkeypatch) -> None:
    book, _ = grammars
    step = GrammarStep(book, torch.device("cpu"))

    def broken(*args, **kwargs):
        raise RuntimeError("mask failed")

    monkeypatch.setattr(book, "forbidden", broken)
    pending = step.start([("a", book.matcher(StructuredOutput("regex", "[0-9]+")))], beside=beside)
    with pytest.raises(RuntimeError, match="mask failed"):
        GrammarStep.finish(pending, ["a"])
