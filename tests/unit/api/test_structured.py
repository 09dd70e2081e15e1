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
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredOutput("json", json.dumps(SCHEMA))),
    # strict: only the properties listed, as OpenAI's strict mode asks and vLLM's default backend assumes
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json", json.dumps({**SCHEMA, "additionalProperties": False}))),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     StructuredOutput("json", json.dumps({**SCHEMA, "additionalProperties": False}))),
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
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "invalid Lark grammar"),  # GBNF that does not convert
    # GBNF past what is converted (a Python converter holding the GIL): refused, not converted for seconds
    ({"guided_grammar": 'root ::= "a"' + " | \"a\"" * 20_000}, "guided_grammar", "invalid Lark grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    # vLLM refuses it too: an empty constraint is no request for free text
    ({"structured_outputs": {}}, "structured_outputs", "set one of"),
    ({"structured_outputs": {"disable_additional_properties": True}}, "structured_outputs", "set one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "at most one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag is not served"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "not served"),
    # compiled at the edge, at a cost growing faster than the text: bounded
    # llguidance's parser holds 2,000 items in a row: more compiled, then failed at their first token
    ({"guided_choice": [f"c{i}" for i in range(2_011)]}, "guided_choice", "2011 choices; the limit is 1900"),
    ({"guided_json": {"type": "object", "patternProperties": {f"^p{i}$": {} for i in range(101)}}},
     "guided_json", "101 patternProperties; the limit is 100"),
    ({"guided_regex": "a" * (1 << 20) + "b"}, "guided_regex", "characters; the limit is 1048576"),
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


def test_strict_closes_every_object_that_does_not_say_otherwise_and_the_matcher_enforces_it() -> None:
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "c": {"type": "object", "additionalProperties": True}},
              "$defs": {"d": {"properties": {"e": {"type": "integer"}}}}}
    got = structured(response_format={"type": "json_schema", "json_schema": {"schema": nested, "strict": True}})
    assert got is not None
    closed = json.loads(got.spec)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True  # said otherwise: kept
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in nested  # the request's own schema is left as it came


def test_a_strict_schemas_matcher_refuses_a_key_the_schema_does_not_list() -> None:
    import llguidance.hf

    from mmserve.decoder.constraint import grammar_of
    from mmserve.models.tiny_checkpoint import build_tokenizer

    tokenizer = build_tokenizer(1024)
    vocabulary = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    text = tokenizer.encode('{"a": 1, "zzz": 2}', add_special_tokens=False)
    for strict in (False, True):
        got = structured(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": strict}})
        assert got is not None
        consumed = llguidance.LLMatcher(vocabulary, grammar_of(got)).try_consume_tokens(text)
        assert (consumed < len(text)) == strict, (strict, consumed)  # strict: stops at the unlisted key


def test_a_gbnf_grammar_as_vllms_default_backend_takes_it_is_served_with_its_meaning() -> None:
    import llguidance.hf

    from mmserve.decoder.constraint import grammar_of
    from mmserve.models.tiny_checkpoint import build_tokenizer

    got = structured(guided_grammar='root ::= answer\nanswer ::= "yes" | "no"')
    assert got is not None and got.kind == "lark"
    tokenizer = build_tokenizer(1024)
    vocabulary = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    for text, whole in (("yes", True), ("no", True), ("maybe", False)):
        ids = tokenizer.encode(text, add_special_tokens=False)
        matcher = llguidance.LLMatcher(vocabulary, grammar_of(got))
        assert (matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()) == whole, text


@pytest.mark.parametrize(("schema", "closed_at"), [
    ({"type": "object", "properties": {"a": {"const": {"type": "object"}, "default": {"properties": {}}}}},
     [[]]),  # values (const, default) are not schemas
    ({"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"b": {"type": "string"}}}]}, []),
    ({"type": "object", "properties": {"kind": {"type": "string"}},
      "oneOf": [{"properties": {"x": {"type": "integer"}}}]}, []),  # its properties also come from its oneOf
    ({"type": "object", "properties": {"properties": {"type": "object"}}}, [[], ["properties", "properties"]]),
    ({"anyOf": [{"type": "object"}, {"type": "string"}]}, [["anyOf", 0]]),
    ({"type": ["object", "null"]}, [[]]),
    # a definition that makes up an object through allOf stays open; one used whole is closed
    ({"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}},
                "Tag": {"type": "object", "properties": {"t": {"type": "string"}}}},
      "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"id": {}, "tag": {"$ref": "#/$defs/Tag"}}},
     [["$defs", "Tag"]]),
    # an object's anyOf adds properties to it: neither it nor its branches are closed ...
    ({"type": "object", "properties": {"name": {"type": "string"}},
      "anyOf": [{"properties": {"email": {"type": "string"}}}, {"properties": {"phone": {"type": "string"}}}]}, []),
    # ... while a union's branches are whole schemas, each closed
    ({"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]},
     [["anyOf", 0], ["anyOf", 1]]),
    # an allOf of one $ref beside nothing (pydantic v1's wrapper) combines nothing: its definition is whole
    ({"definitions": {"X": {"type": "object", "properties": {"a": {}}}},
      "properties": {"x": {"allOf": [{"$ref": "#/definitions/X"}], "description": "an x"}}},
     [[], ["definitions", "X"]]),
    # a property named like a keyword is a property; its object's $ref makes the definition a part
    ({"$defs": {"B": {"type": "object", "properties": {"b": {}}}},
      "properties": {"default": {"$ref": "#/$defs/B", "properties": {"c": {}}}}}, [[]]),
    # definitions inside definitions, and a chain of $refs from a part
    ({"$defs": {"Outer": {"$defs": {"In": {"type": "object", "properties": {"i": {}}}}},
                "A": {"$ref": "#/$defs/C"}, "C": {"type": "object", "properties": {"c": {}}}},
      "allOf": [{"$ref": "#/$defs/Outer/$defs/In"}, {"$ref": "#/$defs/A"}]}, []),
    # one allOf branch beside a $ref: both make the object up
    ({"$defs": {"A": {"type": "object", "properties": {"a": {}}}},
      "$ref": "#/$defs/A", "allOf": [{"type": "object", "properties": {"b": {}}}]}, []),
    # a part's $ref, RFC 6901 escaped
    ({"$defs": {"a/b": {"type": "object", "properties": {"x": {}}}},
      "properties": {"p": {"allOf": [{"$ref": "#/$defs/a~1b"}, {"properties": {"y": {}}}]}}}, [[]]),
])
def test_strict_closes_object_schemas_only_where_their_properties_are_all_listed(schema: dict[str, Any],
                                                                              closed_at: list[list[Any]]) -> None:
    got = structured(response_format={"type": "json_schema", "json_schema": {"schema": schema, "strict": True}})
    assert got is not None
    spec = json.loads(got.spec)
    found: list[list[Any]] = []

    def walk(node: Any, path: list[Any]) -> None:
        if isinstance(node, dict):
            if node.get("additionalProperties") is False and "additionalProperties" not in _at(schema, path):
                found.append(path)
            for key, value in node.items():
                walk(value, [*path, key])
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, [*path, i])

    walk(spec, [])
    assert sorted(map(str, found)) == sorted(map(str, closed_at))


def _at(node: Any, path: list[Any]) -> Any:
    for key in path:
        node = node[key]
    return node


def test_a_deep_strict_schema_is_a_400_not_a_500() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(400):  # 800 levels of JSON: what the body's parser still takes
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidRequestError):  # llguidance's own limit (the closing walk is a loop)
        structured(response_format={"type": "json_schema", "json_schema": {"schema": deep, "strict": True}})
    for _ in range(400):  # past what json's C code recurses into: built in process, never parsed from a body
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        structured(response_format={"type": "json_schema", "json_schema": {"schema": deep, "strict": True}})


def test_a_strict_schema_built_of_parts_accepts_what_the_whole_allows() -> None:
    import llguidance.hf

    from mmserve.decoder.constraint import grammar_of
    from mmserve.models.tiny_checkpoint import build_tokenizer

    tokenizer = build_tokenizer(1024)
    vocabulary = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    schema = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
              "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"id": {}, "name": {"type": "string"}},
              "required": ["id", "name"]}
    got = structured(response_format={"type": "json_schema", "json_schema": {"schema": schema, "strict": True}})
    assert got is not None
    text = tokenizer.encode('{"id": 1, "name": "b"}', add_special_tokens=False)
    matcher = llguidance.LLMatcher(vocabulary, grammar_of(got))
    assert not matcher.is_error(), matcher.get_error()
    assert matcher.try_consume_tokens(text) == len(text)


def test_a_union_inside_a_part_of_a_strict_object_is_left_open() -> None:
    import llguidance.hf

    from mmserve.decoder.constraint import grammar_of
    from mmserve.models.tiny_checkpoint import build_tokenizer

    tokenizer = build_tokenizer(1024)
    vocabulary = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    schema = {"allOf": [{"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]},
                        {"anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                   {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}]}
    got = structured(response_format={"type": "json_schema", "json_schema": {"schema": schema, "strict": True}})
    assert got is not None and "additionalProperties" not in got.spec
    text = tokenizer.encode('{"kind": "x", "a": 1}', add_special_tokens=False)
    matcher = llguidance.LLMatcher(vocabulary, grammar_of(got))
    assert not matcher.is_error(), matcher.get_error()
    assert matcher.try_consume_tokens(text) == len(text)


def test_closing_a_strict_schema_is_linear_in_its_size() -> None:
    """A chain of definitions each a part through the next took a walk per link (quadratic: ~1 s for 1,000, on
    the ingress's event loop). Work is counted, not timed: the lines run in the walk's modules, for a chain
    twice as long, at most about twice as many."""
    import sys

    from mmserve.api import strict_schema
    from mmserve.decoder import schema_walk

    walked = {strict_schema.__file__, schema_walk.__file__}

    def lines_run(links: int) -> int:
        defs: dict[str, Any] = {f"d{k}": {"$ref": f"#/$defs/d{k + 1}"} for k in range(links)}
        defs[f"d{links}"] = {"type": "object", "properties": {"z": {}}}
        schema = {"type": "object", "allOf": [{"$ref": "#/$defs/d0"}, {"properties": {"b": {}}}], "$defs": defs}
        count = 0

        def trace(frame: Any, event: str, arg: Any) -> Any:
            nonlocal count
            if frame.f_code.co_filename not in walked:
                return None
            count += event == "line"
            return trace

        sys.settrace(trace)
        try:
            out = strict_schema.closed(schema)
        finally:
            sys.settrace(None)
        assert "additionalProperties" not in out["$defs"][f"d{links}"]  # a part, through the whole chain
        return count

    short, long = lines_run(500), lines_run(1000)
    assert short > 500 and long <= 2.1 * short, (short, long)


@pytest.mark.parametrize("shape", ["alias", "nested", "items"])
def test_a_schema_nesting_past_the_limit_through_its_refs_is_a_400_not_a_crash(shape: str) -> None:
    """llguidance follows $refs recursively as it compiles: ~1,000 levels killed the process (a segfault)."""
    n = 5_000
    link = {"alias": lambda k: {"$ref": f"#/$defs/d{k + 1}"},
            "nested": lambda k: {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{k + 1}"}}},
            "items": lambda k: {"type": "array", "items": {"$ref": f"#/$defs/d{k + 1}"}}}[shape]
    defs: dict[str, Any] = {f"d{k}": link(k) for k in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    with pytest.raises(InvalidRequestError, match=r"nests \d+ schemas deep through its \$refs") as info:
        structured(guided_json={"$ref": "#/$defs/d0", "$defs": defs})
    assert error_body(info.value)[0] == 400


@pytest.mark.parametrize("shape", ["anchor", "id", "tree"])
def test_schemas_the_depth_guard_cannot_measure_compile_on_a_deep_stack_without_a_crash(shape: str) -> None:
    """llguidance follows anchors and $id bases, in its own order: chains of them (and a tree whose refs it walks
    in key order) nest ~1,500-2,000 deep for it while the guard counts a few levels; on an 8 MiB stack they
    killed the process (a segfault). Compiled on a deep stack they are served or refused, never a crash."""
    n = 1_500
    if shape == "anchor":
        defs: dict[str, Any] = {f"d{k}": {"$anchor": f"a{k}", "type": "object",
                                          "properties": {"x": {"$ref": f"#a{k + 1}"}}} for k in range(n)}
        defs[f"d{n}"] = {"$anchor": f"a{n}", "type": "integer"}
        schema: dict[str, Any] = {"$defs": defs, "$ref": "#a0"}
    elif shape == "id":
        defs = {f"d{k}": {"$id": f"http://x.test/d{k}", "type": "object",
                          "properties": {"x": {"$ref": f"http://x.test/d{k + 1}"}}} for k in range(n)}
        defs[f"d{n}"] = {"$id": f"http://x.test/d{n}", "type": "integer"}
        schema = {"$id": "http://x.test/root", "$defs": defs, "$ref": "http://x.test/d0"}
    else:  # each def's first property refers to the next def in post-order, its others to its children
        m = 2 ** 11 - 1
        order = _post_order(m)
        nxt = {order[k]: order[k + 1] for k in range(m - 1)}
        defs = {f"t{k}": {"type": "object", "properties": {
            **({"p": {"$ref": f"#/$defs/t{nxt[k]}"}} if k in nxt else {}),
            **({"l": {"$ref": f"#/$defs/t{2 * k + 1}"}, "r": {"$ref": f"#/$defs/t{2 * k + 2}"}}
               if 2 * k + 2 < m else {})}} for k in range(m)}
        schema = {"$defs": defs, "$ref": "#/$defs/t0"}
    try:
        got = structured(guided_json=schema)
    except InvalidRequestError as exc:
        assert error_body(exc)[0] == 400
    else:
        assert got is not None


def _post_order(m: int) -> list[int]:
    out, stack = [], [(0, False)]
    while stack:
        k, seen = stack.pop()
        if k >= m:
            continue
        if seen:
            out.append(k)
        else:
            stack += [(k, True), (2 * k + 2, False), (2 * k + 1, False)]
    return out


def test_a_percent_encoded_pointer_is_followed_as_llguidance_follows_it() -> None:
    inner = {f"b{k}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a%2Fb{k + 1}"}}} for k in range(300)}
    with pytest.raises(InvalidRequestError, match=r"nests \d+ schemas deep"):
        structured(guided_json={"$defs": {"a": inner}, "$ref": "#/$defs/a%2Fb0"})


def test_a_recursive_schema_is_no_deeper_than_its_cycle() -> None:
    kids = {"type": "array", "items": {"$ref": "#/$defs/T"}}
    tree = {"$defs": {"T": {"type": "object", "properties": {"name": {"type": "string"}, "kids": kids}}},
            "$ref": "#/$defs/T"}
    assert structured(guided_json=tree) is not None


@pytest.mark.parametrize(("fields", "constrained"), [
    ({}, False), ({"response_format": {"type": "text"}}, False), ({"response_format": {"type": "json_object"}}, True),
    ({"guided_regex": "a+"}, True), ({"guided_choice": ["a"]}, True), ({"structured_outputs": {"regex": "a"}}, True),
])
def test_a_request_says_whether_it_sets_a_constraint(fields: dict[str, Any], constrained: bool) -> None:
    """The ingress checks a constrained request off its event loop (a compile may take seconds)."""
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
    assert body.constrained is constrained
