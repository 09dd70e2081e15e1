"""openapi.py: a hand-parsed body described in the document, every $ref resolvable, the input untouched."""

from __future__ import annotations

import copy
from typing import Any

from mmserve.api.openapi import with_request_body
from mmserve.api.protocol import ChatCompletionRequest


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []


def test_the_chat_body_is_described_and_every_ref_resolves() -> None:
    document = {"openapi": "3.1.0", "paths": {"/v1/chat/completions": {"post": {"responses": {}}}}}
    before = copy.deepcopy(document)
    out = with_request_body(document, "/v1/chat/completions", "post", ChatCompletionRequest)
    assert document == before
    body = out["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    schemas = out["components"]["schemas"]
    assert {"ChatCompletionRequest", "Message", "ImagePart", "TextPart"} <= set(schemas)
    for ref in _refs(out):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
