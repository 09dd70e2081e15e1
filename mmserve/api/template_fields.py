"""The request fields that choose how the chat template renders the messages (vLLM's extensions).

Owns: `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` at the HTTP edge and their
engine form (`TemplateOptions`). Does not own what they do to the prompt nor their checks against the messages
and the template (`mmserve.preprocess.chat_template`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from mmserve.messages import TemplateOptions


class TemplateFields(BaseModel):
    """The request fields this module reads (a mixin of `ChatCompletionRequest`)."""

    model_config = ConfigDict(extra="ignore")

    add_generation_prompt: bool = True  # extension (vLLM's): end the prompt with the model turn's header (flag)
    continue_final_message: bool = False  # extension (vLLM's): end it inside the final message, to go on (flag)
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM's): variable name -> JSON value

    def template_options(self) -> TemplateOptions:
        return TemplateOptions(self.add_generation_prompt, self.continue_final_message,
                               dict(self.chat_template_kwargs or {}))
