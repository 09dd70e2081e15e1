"""Walking a JSON schema's structure: its schema positions, its local `$ref`s, and how deep it nests through them.

Owns: which keys hold schemas (never values such as `const`, `enum` or `default`), resolving a local `$ref`
(RFC 6901 pointers), and a schema's depth counted through `$ref`s. Does not own what is done with them (strict
mode: mmserve/api/strict_schema.py; the compile guard: constraint.py). Loops, not recursion: a schema may nest
as deep as the JSON that carries it.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

COMBINATORS = ("allOf", "anyOf", "oneOf")
# JSON Schema's applicators: the keys whose values are schemas (one, a map of them, a list of them)
_ONE = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("items", "prefixItems", *COMBINATORS)


def children(node: dict[str, Any]) -> list[Any]:
    """The schemas right inside `node` (schema positions only: never values such as `const`)."""
    out: list[Any] = []
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out += node[key].values()
    out += [node[key] for key in _ONE if isinstance(node.get(key), dict)]
    for key in _LIST:
        if isinstance(node.get(key), list):
            out += node[key]
    return out


def nodes(root: Any) -> list[dict[str, Any]]:
    """Every object-valued schema node of `root` (schema positions only), each once."""
    out, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and id(node) not in seen:
            seen.add(id(node))
            out.append(node)
            stack.extend(children(node))
    return out


def target(root: Any, ref: str, known: dict[str, Any]) -> Any:
    """The node a local `$ref` ("#" or "#/a/b": a URI fragment, percent-decoded first, then an RFC 6901 pointer)
    points at; None for any other (`known`: the refs resolved so far, reused)."""
    if ref not in known:
        node: Any = None
        pointer = urllib.parse.unquote(ref)
        if pointer == "#" or pointer.startswith("#/"):
            node = root
            for token in pointer[2:].split("/") if pointer != "#" else ():
                token = token.replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict):
                    node = node.get(token)
                elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                    node = node[int(token)]
                else:
                    node = None
                    break
        known[ref] = node
    return known[ref]


def depth(root: Any) -> int:
    """The most schemas on one path from `root` down, through its schema positions and `$ref`s, a cycle (a
    recursive schema) counted once: the depth a compiler that follows references meets.

    NOTE: the longest path once the cycles' back edges are dropped, by one depth-first walk (each node's depth
    is known when its walk ends): linear in the schema's size.
    """
    known: dict[str, Any] = {}
    done: dict[int, int] = {}  # node id -> its depth, once its walk has ended
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        if not isinstance(node, dict):
            continue
        key = id(node)
        if leaving:
            on_path.discard(key)
            done[key] = 1 + max((done.get(id(c), 0) for c in _edges(root, node, known) if isinstance(c, dict)),
                                default=0)
            continue
        if key in done or key in on_path:  # seen, or a cycle's back edge
            continue
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _edges(root, node, known))
    return done.get(id(root), 0)


def _edges(root: Any, node: dict[str, Any], known: dict[str, Any]) -> list[Any]:
    ref = node.get("$ref")
    return children(node) + ([target(root, ref, known)] if isinstance(ref, str) else [])
