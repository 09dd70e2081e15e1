"""vLLM's `return_token_ids` fields in a response: present where the request asked for them, absent otherwise.

Owns: the base of the response models that carry such fields (`token_ids`, `prompt_token_ids`), which leaves
them out of the JSON when unset, so that an answer to a request that did not ask is OpenAI's shape exactly.
Does not own collecting the ids (stream.py) nor the request field (protocol.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer

TOKEN_ID_FIELDS = ("token_ids", "prompt_token_ids")


class TokenIdsOnlyAsked(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if k not in TOKEN_ID_FIELDS or v is not None}
