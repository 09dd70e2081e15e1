"""Structured output on the tiny random-weight model: its free text is gibberish, so every valid output here is
the grammar's doing. Alone and batched with free requests, greedy and sampled, with an image in the prompt."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from mmserve.config import EngineConfig, MediaConfig
from mmserve.decoder.constraint import InvalidGrammarError
from mmserve.decoder.grammar import NoTokenAllowedError
from mmserve.engine import Engine
from mmserve.messages import ChatRequest, RequestOutput, SamplingParams, StructuredOutput
from tests.unit.test_engine import IMAGE

NAME = {"type": "string", "maxLength": 16}
CHOICES = ["cat", "dog", "a red car"]
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "additionalProperties": False, "required": ["invoice", "paid"], "properties": {
        "invoice": {"type": "object", "additionalProperties": False, "required": ["id", "total"], "properties": {
            "id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "total": {"type": "number", "minimum": 0, "maximum": 1e6}}},
        "paid": {"type": "boolean"}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"enum": ["A1", "B2", "C3"]}, "qty": {"type": "integer", "minimum": 1,
                                                                          "maximum": 99}}}}}},
    "enum": {"enum": ["red", "green", "blue"]},
    "optional": {"type": "object", "additionalProperties": False, "required": ["kind"], "properties": {
        "kind": {"const": "photo"}, "caption": NAME, "tags": {"type": "array", "maxItems": 2, "items": NAME}}},
}


def chat(request_id: str, text: str = "Describe it as JSON", image: bool = False, **sampling) -> ChatRequest:
    parts = [{"type": "image_url", "image_url": {"url": IMAGE}}] if image else []
    sampling.setdefault("max_tokens", 160)
    return ChatRequest(request_id, [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                       SamplingParams(**sampling))


def json_schema(name: str) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(SCHEMAS[name]))


@pytest.fixture(scope="module")
def engine(tiny_ckpt_224):
    eng = Engine(EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048, media=MediaConfig()))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_schema_alone_and_batched_with_free_requests(engine, temperature):
    constrained = [chat(f"{name}-{temperature}-{i}", image=i % 2 == 0, temperature=temperature, seed=i,
                        structured=json_schema(name)) for i, name in enumerate(SCHEMAS)]
    free = [chat(f"free-{temperature}-{i}", temperature=temperature, seed=100 + i, max_tokens=24) for i in range(3)]
    alone = [engine.generate([req])[0] for req in constrained]
    batched = engine.generate([*free, *constrained])
    for completions in (alone, batched[len(free):]):
        for name, done in zip(SCHEMAS, completions, strict=True):
            assert done.finish_reason == "stop", (name, done.text)
            jsonschema.validate(json.loads(done.text), SCHEMAS[name])
    assert [c.token_ids for c in alone] == [c.token_ids for c in batched[len(free):]]  # batching changes nothing
    [free_alone] = engine.generate([free[0]])
    assert free_alone.token_ids == batched[0].token_ids  # and free rows are not touched by their batch mates
    assert not all(_parses(c.text) for c in batched[:len(free)])  # the model alone does not write JSON


def test_json_object_outputs_parse(engine):
    # NOTE: a random model almost never ends an unbounded string or number (the closing token is one in
    # hundreds), so without help its output runs to max_tokens, as it would on any engine; a bias on the
    # closing tokens keeps values short, and whatever the model then picks, the grammar alone keeps it JSON.
    tokenizer = engine.preprocessor.tokenizer
    closing = tuple((tokenizer.encode(t, add_special_tokens=False)[0], 4.0) for t in ('"', "}", "]"))
    done = engine.generate([chat(f"o{i}-{temperature}", text=t, temperature=temperature, seed=i, logit_bias=closing,
                                 structured=StructuredOutput("json", '{"type": "object"}'))
                            for i, t in enumerate(["Describe it as JSON", "Say something", "What is this?"])
                            for temperature in (0.0, 1.0)])
    for completion in done:
        assert completion.finish_reason == "stop" and isinstance(json.loads(completion.text), dict), completion.text


def test_regex_choice_and_lark_outputs_match(engine):
    cases = [
        # NOTE: [0-9], not \d: llguidance's \d is every Unicode digit of a newer Unicode than Python 3.11's
        (StructuredOutput("regex", r"[A-Z]{2}-[0-9]{3}"), lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
        (StructuredOutput("choice", json.dumps(CHOICES)), lambda t: t in CHOICES),
        (StructuredOutput("lark", 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", t)),
    ]
    for seed in range(3):
        done = engine.generate([chat(f"k{seed}-{i}", temperature=1.0, seed=seed, structured=s)
                                for i, (s, _) in enumerate(cases)])
        for (structured, ok), completion in zip(cases, done, strict=True):
            assert completion.finish_reason == "stop" and ok(completion.text), (structured.kind, completion.text)


def test_a_complete_grammar_ends_the_request_at_once(engine):
    [done] = engine.generate([chat("c", temperature=0.0, structured=StructuredOutput("choice", '["yes"]'),
                                   ignore_eos=True)])
    assert done.text == "yes" and done.finish_reason == "stop"  # ends on the grammar, even with ignore_eos
    assert not engine.has_unfinished()


def test_an_uncompilable_grammar_is_refused_before_it_holds_anything(engine):
    before = engine.stats().decoder.free_blocks
    with pytest.raises(InvalidGrammarError, match="regex"):
        engine.generate([chat("bad", structured=StructuredOutput("regex", "(unclosed"))])
    assert engine.stats().decoder.free_blocks == before and not engine.has_unfinished()


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_a_grammar_that_ends_on_the_last_allowed_token_finishes_as_a_stop(engine):
    [done] = engine.generate([chat("one", temperature=1.0, seed=0, max_tokens=1,
                                   structured=StructuredOutput("choice", '["a", "b"]'))])
    assert done.text in ("a", "b") and done.finish_reason == "stop"  # complete, not cut by max_tokens


@pytest.mark.parametrize("structured, sampling", [
    (StructuredOutput("regex", ""), {"allowed_token_ids": (100,)}),  # only the end is allowed, and it is not
    (StructuredOutput("lark", "start: <image_soft_token>"), {}),  # only a token the model never samples
])
def test_a_grammar_that_leaves_no_token_fails_its_request_alone(engine, structured, sampling):
    async def run() -> list[object]:
        async def collect(request: ChatRequest) -> object:
            try:
                return [out async for out in engine.stream(request)][-1]
            except Exception as exc:
                return exc

        stuck = chat("stuck", temperature=0.0, structured=structured, **sampling)
        free = [chat(f"free{i}", temperature=0.0, max_tokens=8) for i in range(2)]
        return list(await asyncio.gather(*(collect(r) for r in (stuck, *free))))

    stuck, *free = asyncio.run(run())
    assert isinstance(stuck, NoTokenAllowedError) and "structured output cannot go on" in str(stuck)
    assert all(isinstance(out, RequestOutput) and out.finish_reason in ("stop", "length") for out in free)
    assert not engine.decoder.request_ids()
