"""The structured-output fields of a chat request: OpenAI's `response_format` and vLLM's equivalents.

Owns: their pydantic shapes, reading them into one `StructuredOutput`, and the 400 when more than one is
set or the constraint does not compile (naming the field). Does not own: compiling and enforcing the
grammar (`mmserve.decoder.grammar`).

vLLM's spellings served: `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and the
older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; a `grammar` is llguidance's Lark.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from llguidance import gbnf_to_lark
from pydantic import BaseModel, ConfigDict, Field

from mmserve.api import strict_schema
from mmserve.api.errors import UnsupportedParameterError, with_param
from mmserve.decoder.constraint import InvalidGrammarError, check
from mmserve.errors import InvalidRequestError
from mmserve.messages import StructuredOutput

_ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object, as OpenAI defines that mode
# NOTE: a constraint is compiled at the edge, on its event loop, and its cost grows faster than its text:
# these bound it (the figures: docs/reliability.md)
MAX_SPEC_CHARS = 1 << 20  # characters of one schema, regex, grammar or choice list's JSON
MAX_GBNF_CHARS = 1 << 16  # characters of a GBNF grammar converted to Lark (a longer one is refused as Lark)
# NOTE: llguidance's parser holds at most 2,000 items in a row: a list of more compiled, then failed at its first
# token in the decoder
MAX_CHOICES = 1_900  # strings of one choice list


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Lenient):
    name: str | None = None  # OpenAI requires it; it names the schema and changes nothing here
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON value
    # True: an object has only the properties its schema lists (OpenAI's strict mode asks every object for
    # `additionalProperties: false`; vLLM's default backend assumes it); the schema is enforced either way
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Lenient):
    """vLLM's `structured_outputs` object: one of its fields set."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    disable_additional_properties: bool | None = None  # as `strict` above, for `json`
    structural_tag: Any = None  # not served: a 400 (it would change the output)
    whitespace_pattern: str | None = None  # not served: a 400 (JSON is written without free whitespace)


class StructuredFields(_Lenient):
    """The request fields this module reads (a mixin of `ChatCompletionRequest`)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM's)
    guided_json: str | dict[str, Any] | None = None  # extension (vLLM's, older)
    guided_regex: str | None = None  # extension (vLLM's, older)
    guided_choice: list[str] | None = Field(None, min_length=1)  # extension (vLLM's, older)
    guided_grammar: str | None = None  # extension (vLLM's, older): a Lark grammar
    guided_whitespace_pattern: str | None = None  # extension (vLLM's, older): not served, a 400 (as below)

    @property
    def constrained(self) -> bool:
        """Whether the request sets a constraint (compiled at the edge: up to seconds of CPU)."""
        free = self.response_format is None or self.response_format.type == "text"
        return not free or any(v is not None for v in (self.structured_outputs, self.guided_json, self.guided_regex,
                                                        self.guided_choice, self.guided_grammar))

    def structured(self) -> StructuredOutput | None:
        """The one constraint the request sets, checked to compile; raises InvalidRequestError naming the field."""
        found = [(name, s) for name, s in self._candidates() if s is not None]
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise with_param(InvalidRequestError(f"set at most one structured output constraint, got {names}"),
                             found[1][0])
        if not found:
            return None
        name, structured = found[0]
        _check_size(structured, name)
        try:
            check(structured)
        except InvalidGrammarError as exc:
            raise with_param(exc, name) from None
        return structured

    def _candidates(self) -> list[tuple[str, StructuredOutput | None]]:
        so = self.structured_outputs or StructuredOutputs()
        for unserved in ("structural_tag", "whitespace_pattern"):
            if getattr(so, unserved) is not None:
                raise with_param(UnsupportedParameterError(f"structured_outputs.{unserved} is not served"),
                                 "structured_outputs")
        kinds = (so.json_, so.regex, so.choice, so.grammar, so.json_object)
        if self.structured_outputs is not None and all(kind is None for kind in kinds):  # NOTE: as vLLM: not free text
            raise with_param(InvalidRequestError("structured_outputs: set one of json, regex, choice, grammar, "
                                                 "json_object"), "structured_outputs")
        if self.guided_whitespace_pattern is not None:
            raise with_param(UnsupportedParameterError("guided_whitespace_pattern is not served (JSON is written "
                                                       "without free whitespace)"), "guided_whitespace_pattern")
        return [
            ("response_format", _from_response_format(self.response_format)),
            ("structured_outputs", _first(_json(so.json_, closed=bool(so.disable_additional_properties)),
                                          _regex(so.regex), _choice(so.choice), _lark(so.grammar),
                                          StructuredOutput("json", _ANY_OBJECT) if so.json_object else None)),
            ("guided_json", _json(self.guided_json)),
            ("guided_regex", _regex(self.guided_regex)),
            ("guided_choice", _choice(self.guided_choice)),
            ("guided_grammar", _lark(self.guided_grammar)),
        ]


def _from_response_format(fmt: ResponseFormat | None) -> StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json", _ANY_OBJECT)
    if fmt.json_schema is None:
        raise with_param(InvalidRequestError("response_format of type json_schema needs a json_schema"),
                         "response_format")
    return _json(fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {},
                 closed=bool(fmt.json_schema.strict))


def _first(*found: StructuredOutput | None) -> StructuredOutput | None:
    given = [s for s in found if s is not None]
    if len(given) > 1:
        raise with_param(InvalidRequestError("structured_outputs: set exactly one of json, regex, choice, grammar, "
                                             "json_object"), "structured_outputs")
    return given[0] if given else None


def _json(schema: str | dict[str, Any] | None, *, closed: bool = False) -> StructuredOutput | None:
    if schema is None:
        return None
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        if closed and len(text) <= MAX_SPEC_CHARS:  # NOTE: a bigger one is refused for its size, never walked
            with contextlib.suppress(ValueError):  # not JSON: left as it came, for `check` to refuse with its reason
                text = json.dumps(strict_schema.closed(json.loads(text)))
        return StructuredOutput("json", text)
    except RecursionError:  # NOTE: json's C code recurses per nesting level
        raise InvalidRequestError("the JSON schema is nested too deeply") from None


def _check_size(structured: StructuredOutput, name: str) -> None:
    """Refuse a constraint too large to compile at the edge: its cost grows faster than its text."""
    if len(structured.spec) > MAX_SPEC_CHARS:
        raise with_param(InvalidRequestError(f"{name}: the constraint is {len(structured.spec)} characters; the "
                                             f"limit is {MAX_SPEC_CHARS}"), name)
    if structured.kind == "choice" and len(choices := json.loads(structured.spec)) > MAX_CHOICES:
        raise with_param(InvalidRequestError(f"{name}: {len(choices)} choices; the limit is {MAX_CHOICES}"), name)


def _regex(pattern: str | None) -> StructuredOutput | None:
    return None if pattern is None else StructuredOutput("regex", pattern)


def _choice(choices: list[str] | None) -> StructuredOutput | None:
    return None if choices is None else StructuredOutput("choice", json.dumps(choices))


def _lark(grammar: str | None) -> StructuredOutput | None:
    """A grammar in Lark (llguidance's) or in GBNF (llama.cpp's, which vLLM's default backend takes), as Lark.

    NOTE: one that does not convert goes on as it came: `check` refuses it with the parser's reason. The
    converter is Python, holding the GIL for ~2 µs a character (off the ingress's event loop, which still waits
    for the GIL meanwhile): GBNF is converted up to MAX_GBNF_CHARS."""
    if grammar is None:
        return None
    if len(grammar) <= MAX_GBNF_CHARS and not gbnf_to_lark.is_lark_syntax(grammar):
        with contextlib.suppress(Exception):  # NOTE: any failure of the converter: refused by `check` below
            grammar = gbnf_to_lark.gbnf_to_lark(grammar)
    return StructuredOutput("lark", grammar)
