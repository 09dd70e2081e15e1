"""The structured-output fields at the HTTP edge: each spelling read into one StructuredOutput, and the 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from mmserve.api.errors import error_body, validation_error_body
from mmserve.api.protocol import ChatCompletionRequest
from mmserve.errors import InvalidRequestError
from mmserve.messages import StructuredOutput

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def structured(**fields: Any) -> StructuredOutput | None:
    request = ChatCompletionRequest.model_validate({"messages": USER, **fields})
    return request.to_chat_request("r", 8).sampling.structured


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json", '{"type": "object"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, StructuredOutput("json", "{}")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutput("lark", 'start: "a"+')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json", '{"type": "object"}')),
    ({"guided_json": SCHEMA}, StructuredOutput("json", json.dumps(SCHEMA))),
    ({"guided_regex": "\\d{3}"}, StructuredOutput("regex", "\\d{3}")),
    ({"guided_choice": ["a b", 'c"d']}, StructuredOutput("choice", '["a b", "c\\"d"]')),
    ({"guided_grammar": 'start: "x" | "y"'}, StructuredOutput("lark", 'start: "x" | "y"')),
])
def test_each_spelling_reads_into_one_constraint(fields: dict[str, Any], expected: StructuredOutput | None) -> None:
    assert structured(**fields) == expected


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}},
     "response_format", "invalid JSON schema: Invalid type: frobnicate"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema"),
    ({"guided_json": "{not json"}, "guided_json", "invalid JSON schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "invalid Lark grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "at most one"),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(fields: dict[str, Any], param: str,
                                                                       words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        structured(**fields)
    status, body = error_body(info.value)
    assert status == 400 and body["error"]["param"] == param
    assert words in body["error"]["message"]


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "xml"}},
    {"response_format": "json"},
    {"guided_choice": []},
])
def test_malformed_fields_fail_validation(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": USER, **fields})
    status, body = validation_error_body(info.value.errors())
    assert status == 400 and body["error"]["param"].split(".")[0] == next(iter(fields))
