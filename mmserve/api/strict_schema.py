"""OpenAI's strict mode on a JSON schema: every object schema closed to the properties it lists, unless it is
made of parts.

Owns: which object schemas of a schema are whole (closed with `additionalProperties: false` unless they say
otherwise) and which are parts of a bigger object (left open): a combinator's branches that make an object up,
and what such a part `$ref`s, followed through chains of `$ref`s. Does not own compiling the schema (llguidance,
through mmserve/decoder/constraint.py) nor the request fields (structured.py).

Linear in the schema's size (one walk to find the nodes and their `$ref`s, one pass over the parts, one walk
to close): a schema reaches the edge as up to 1 MiB of JSON, and a part found late must not cost a walk more.
"""

from __future__ import annotations

import json
from typing import Any

from mmserve.decoder.schema_walk import COMBINATORS, nodes, target

OPEN_ENDED = frozenset({"allOf", "anyOf", "oneOf", "$ref"})  # an object's properties may also come from these


def closed(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that does not say otherwise has `additionalProperties:
    false`: only the properties it lists (what OpenAI's strict mode asks for, vLLM's default backend assumes).

    NOTE: only schema positions are walked (properties' and definitions' values, items, combinators' branches),
    never values (`const`, `enum`, `default`). An object whose properties may come from elsewhere (a combinator
    or `$ref` beside them) is left open, as are the parts that make it up, all the way down: `allOf`'s branches
    (of two or more, or beside other keys), an object's `anyOf` / `oneOf` branches, any combinator's branches
    inside a part, and what a part `$ref`s (through chains of `$ref`s; local pointers only). Closing a part of a
    conjunction would refuse what the whole allows. A union's branches (`anyOf` / `oneOf` of a schema that is no
    object itself) are whole schemas, closed. Loops, not recursion: the schema may nest as deep as the JSON.
    """
    out = json.loads(json.dumps(schema))  # a copy
    every = nodes(out)
    parts = _parts(out, every)
    for node in every:
        if id(node) not in parts and _is_object(node) and "additionalProperties" not in node \
                and not OPEN_ENDED & node.keys():
            node["additionalProperties"] = False
    return out


def _is_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def _makes_up(node: dict[str, Any], key: str) -> bool:
    """Whether the branches under `node[key]` are parts of one object rather than whole alternatives (an `allOf`
    of one branch beside nothing else combines nothing: that branch is the whole)."""
    if key == "allOf":
        return len(node[key]) > 1 or _is_object(node) or bool((OPEN_ENDED - {"allOf"}) & node.keys())
    return _is_object(node) or bool((OPEN_ENDED - {key}) & node.keys())  # beside a $ref or another combinator


def _parts(root: Any, every: list[dict[str, Any]]) -> set[int]:
    """The ids of the nodes that are parts of an object: branches that make one up, what a part's `$ref` points
    at (or one beside an object's own properties or a combinator), and, from each part, its combinators'
    branches and its `$ref`'s target."""
    parts: set[int] = set()
    work: list[dict[str, Any]] = []

    def mark(node: Any) -> None:
        if isinstance(node, dict) and id(node) not in parts:
            parts.add(id(node))
            work.append(node)

    targets: dict[str, Any] = {}
    for node in every:  # parts by their own structure
        for key in COMBINATORS:
            if isinstance(node.get(key), list) and _makes_up(node, key):
                for branch in node[key]:
                    mark(branch)
        if isinstance(node.get("$ref"), str) and (_is_object(node) or set(COMBINATORS) & node.keys()):
            mark(target(root, node["$ref"], targets))  # beside the object's own properties, or other parts
    while work:  # NOTE: each node marked once: linear however long the chains
        part = work.pop()
        for key in COMBINATORS:
            if isinstance(part.get(key), list):
                for branch in part[key]:
                    mark(branch)
        if isinstance(part.get("$ref"), str):
            mark(target(root, part["$ref"], targets))
    return parts
