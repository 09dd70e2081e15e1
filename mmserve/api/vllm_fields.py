"""vLLM's extension fields in a response: present where they apply, absent otherwise.

Owns: the base of the response models that carry such fields, which leaves them out of the JSON where they do
not apply, so that an answer to a request that used none is OpenAI's shape exactly: `return_token_ids`' fields
(`token_ids`, `prompt_token_ids`) when unset (not asked), and `stop_reason` where nothing set it (vLLM sends null
there: a client reads the same from a field it lacks). A model may name more fields of its own that go when None
(`DROPPED`: a chunk's `usage`, which OpenAI sends only where `stream_options` asked for it).
Does not own collecting the values (stream.py) nor the request fields (protocol.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer

DROPPED_WHEN_NONE = ("token_ids", "prompt_token_ids", "stop_reason")


class VllmFields(BaseModel):
    DROPPED: ClassVar[tuple[str, ...]] = DROPPED_WHEN_NONE  # the fields left out of the JSON when None

    @model_serializer(mode="wrap")
    def _drop_unapplied(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if k not in self.DROPPED or v is not None}
