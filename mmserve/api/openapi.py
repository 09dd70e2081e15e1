"""The OpenAPI document of the HTTP API, with the request bodies we parse ourselves described.

Owns: adding a pydantic model's JSON schema as an operation's request body (its nested models under
`components/schemas`). Does not own: the routes (deployments/ingress.py) nor the models (`protocol.py`).

NOTE: `/v1/chat/completions` reads its body by hand (a byte cap and a deadline come before parsing), so
FastAPI sees no body parameter and would publish none: clients' generators and schemathesis need it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def with_request_body(document: dict[str, Any], path: str, method: str, model: type[BaseModel]) -> dict[str, Any]:
    """`document` with `model` as the JSON body of `method path` (a new dict; `document` is not changed)."""
    schema = model.model_json_schema(ref_template=_REF)
    nested = schema.pop("$defs", {})
    out = {**document, "paths": {**document["paths"]}}
    operation = {**out["paths"][path][method]}
    operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
        "$ref": _REF.format(model=model.__name__)}}}}
    out["paths"][path] = {**out["paths"][path], method: operation}
    components = {**out.get("components", {})}
    components["schemas"] = {**components.get("schemas", {}), **nested, model.__name__: schema}
    out["components"] = components
    return out
