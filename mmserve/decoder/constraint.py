"""A request's constraint as an llguidance grammar, and whether it compiles.

Owns: turning a `StructuredOutput` into an llguidance grammar (its JSON text), the edge's check that it
compiles (for a 400 naming llguidance's reason), and telling a request's own failure inside llguidance
from a fault. Does not own: the vocabulary, matchers or masks (grammar.py). Imports neither torch nor a
tokenizer, so the HTTP edge can check constraints without loading either.

NOTE: JSON is compiled without free whitespace (llguidance's `whitespace_flexible: false`, vLLM's
`disable_any_whitespace`) and with `", "` / `": "` separators: a model cannot spend its tokens on runs of
blanks, and the output reads as `json.dumps` writes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import llguidance

from mmserve.decoder.big_stack import on_big_stack
from mmserve.decoder.schema_walk import depth, nodes
from mmserve.errors import InvalidRequestError
from mmserve.messages import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # NOTE: a typing-only name, not exported at run time

_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False,
}
# NOTE: llguidance follows $refs as it compiles, recursively: a schema nesting ~1,000 deep through them (a
# 60 KB chain of definitions) overflowed an 8 MiB thread stack and killed the process (thirty-fifth session).
# Compiles run on deep stacks (big_stack.py), which is the protection; this limit refuses the plain chains with a
# clear reason first (references it cannot follow, anchors or $id bases, it does not count). Schemas written by
# people or generated from types nest a few dozen deep.
MAX_SCHEMA_DEPTH = 128
# NOTE: llguidance checks every pair of patternProperties for overlap as it compiles, a cost that grows far faster
# than their number (100 took 0.04 s, 200 0.8 s, 400 15 s on our 2-vCPU VM), and a compile cannot be interrupted
MAX_PATTERN_PROPERTIES = 100
NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "lark": "Lark grammar"}


class InvalidGrammarError(InvalidRequestError):
    """The requested schema, regex, choice list or grammar does not compile."""


def grammar_of(structured: StructuredOutput) -> str:
    """The llguidance grammar (its JSON text) for a request's constraint."""
    if structured.kind == "json":
        schema = json.loads(structured.spec)
        if isinstance(schema, dict):  # NOTE: llguidance reads its options from the schema too: the server's only
            schema.pop("x-guidance", None)  # (a client's would turn `lenient` on: keywords dropped, not refused)
        if (patterns := sum(len(n["patternProperties"]) for n in nodes(schema)
                            if isinstance(n.get("patternProperties"), dict))) > MAX_PATTERN_PROPERTIES:
            raise InvalidGrammarError(f"invalid JSON schema: {patterns} patternProperties; the limit is "
                                      f"{MAX_PATTERN_PROPERTIES}")
        if (deep := depth(schema)) > MAX_SCHEMA_DEPTH:
            raise InvalidGrammarError(f"invalid JSON schema: it nests {deep} schemas deep through its $refs; "
                                      f"the limit is {MAX_SCHEMA_DEPTH}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if structured.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.spec)
    if structured.kind == "choice":
        choices = json.loads(structured.spec)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if structured.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(structured.spec)
    raise InvalidGrammarError(f"unknown kind of structured output {structured.kind!r}")


def check(structured: StructuredOutput) -> None:
    """Raise InvalidGrammarError with llguidance's reason when the constraint does not compile (the
    constraints that did are remembered, by digest: the same schema is sent again and again)."""
    key = digest(structured)
    with _CHECKED_LOCK:
        if key in _CHECKED:
            _CHECKED.move_to_end(key)
            return
    with compiling(structured):  # NOTE: on a deep stack: llguidance's compile recurses as deep as a schema nests
        failed, messages = on_big_stack(
            lambda: llguidance.LLMatcher.validate_grammar_with_warnings(grammar_of(structured)))
    if failed:
        reason = messages[0] if messages else "no reason given"
        raise InvalidGrammarError(f"invalid {NAMES[structured.kind]}: {reason}")
    with _CHECKED_LOCK:
        _CHECKED[key] = None
        while len(_CHECKED) > CHECKED_CACHED:
            _CHECKED.popitem(last=False)


def digest(structured: StructuredOutput) -> str:
    """What the caches of constraints are keyed by. NOTE: a digest, not the constraint: a spec may be up to
    `MAX_SPEC_CHARS` of text, and a cache of the texts themselves held all of them."""
    return hashlib.sha256(f"{structured.kind}\0{structured.spec}".encode()).hexdigest()


CHECKED_CACHED = 256  # digests of constraints that compiled, remembered at the edge (LRU)
_CHECKED: OrderedDict[str, None] = OrderedDict()
_CHECKED_LOCK = threading.Lock()


def contained(exc: BaseException) -> bool:
    """Whether a failure inside llguidance is its request's alone: an Exception, or a panic in its Rust code
    (pyo3's PanicException, a BaseException); not an interrupt or an exit."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


@contextlib.contextmanager
def compiling(structured: StructuredOutput) -> Iterator[None]:
    """Turn what compiling a constraint raises (not JSON where JSON is due, a panic) into InvalidGrammarError."""
    try:
        yield
    except InvalidGrammarError:
        raise
    except ValueError as exc:  # not JSON where JSON is due
        raise InvalidGrammarError(f"invalid {NAMES[structured.kind]}: {exc}") from None
    except RecursionError:  # NOTE: json's C code recurses per nesting level
        raise InvalidGrammarError(f"invalid {NAMES[structured.kind]}: nested too deeply") from None
    except BaseException as exc:
        if isinstance(exc, Exception) or not contained(exc):
            raise
        raise InvalidGrammarError(f"invalid {NAMES[structured.kind]}: {exc}") from None  # a panic
