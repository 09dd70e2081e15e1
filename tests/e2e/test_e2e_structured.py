"""Structured output over HTTP with the official `openai` client: its `parse` helper, json_schema streamed and
not, vLLM's guided_choice, and the 400 for a schema that does not compile."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.e2e.chat_client import client_for, user
from tests.e2e.e2e_support import Server, data_url, encode_image, make_image

pytestmark = pytest.mark.timeout(600)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["label", "count", "boxes"], "properties": {
    "label": {"enum": ["cat", "dog", "car"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 20},
    "boxes": {"type": "array", "maxItems": 2, "items": {"type": "array", "minItems": 4, "maxItems": 4,
                                                         "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}}


class Reading(BaseModel):
    kind: Literal["photo", "chart", "scan"]
    pages: int = Field(ge=1, le=9)
    legible: bool


@pytest.fixture(scope="module")
def client(e2e_server: Server) -> Iterator[OpenAI]:
    with client_for(e2e_server) as c:
        yield c


def test_the_clients_parse_helper_gets_its_pydantic_model(client, e2e_server):
    image = data_url(encode_image(make_image(5, (320, 240))))
    for seed in range(3):
        done = client.chat.completions.parse(model=e2e_server.model_name, response_format=Reading, max_tokens=64,
                                             messages=typing.cast(Any, user("Read this page.", image)),
                                             temperature=1.0, seed=seed)
        assert done.choices[0].finish_reason == "stop"
        assert isinstance(done.choices[0].message.parsed, Reading)


def test_json_schema_streamed_and_not_validates_and_agrees(client, e2e_server):
    kwargs: dict[str, Any] = {
        "model": e2e_server.model_name, "messages": user("What is in the picture?"), "max_tokens": 96,
        "temperature": 0, "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "detections", "schema": SCHEMA, "strict": True}}}
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == text


def test_vllms_guided_choice(client, e2e_server):
    done = client.chat.completions.create(model=e2e_server.model_name, messages=typing.cast(Any, user("Pick one.")),
                                          temperature=1.0, seed=3, max_tokens=16,
                                          extra_body={"guided_choice": ["left", "right", "straight on"]})
    assert done.choices[0].message.content in ("left", "right", "straight on")


def test_a_schema_that_does_not_compile_is_a_400_naming_it(client, e2e_server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=e2e_server.model_name, messages=typing.cast(Any, user("hi")),
                                       response_format=typing.cast(Any, {"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "properties": {
                                               "a": {"$ref": "#/$defs/missing"}}}}}))
    error = typing.cast(dict[str, Any], info.value.body)
    assert error["param"] == "response_format" and "invalid JSON schema" in error["message"]
