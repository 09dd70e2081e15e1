"""The model's chat template, rendered with a request's template options.

Owns: turning checked messages into the prompt text with transformers' `apply_chat_template` (the model's own
template, so the prompt is the oracle's); vLLM's template options: `add_generation_prompt`,
`continue_final_message` (the prompt ends inside the final message, as transformers cuts it) and
`chat_template_kwargs` (only variables the template reads, never one that names a render argument or a special
token); and the refusal of a prompt whose texts, joined by the template, spell a control token. Does not own the
message shape (chat_messages.py), the placeholders' expansion (the model's `PromptRule`) nor tokenizing.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from typing import Any

import jinja2
import jinja2.meta

from mmserve.errors import InvalidRequestError
from mmserve.messages import TemplateOptions
from mmserve.preprocess.chat_messages import NEUTRAL_TEXT, ParsedMessages, with_neutral_text

log = logging.getLogger(__name__)

# Names a template reads that are the render's own (transformers' globals and template inputs), never a request's;
# `apply_chat_template`'s own parameters (chat_template, tokenize, ...) are added from its signature
RENDER_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                          "raise_exception", "strftime_now"})
MAX_KWARGS_DEPTH = 16  # nesting of a chat_template_kwargs value (levels); NOTE: the walks below recurse


class ChatTemplate:
    """Renders messages with the processor's chat template; thread-safe (the processor's render is)."""

    def __init__(self, processor: Any, reserved: tuple[str, ...]) -> None:
        self._processor = processor
        self._reserved = reserved  # the model's control-token strings, which no client text may spell
        # the characters that begin or end one, in either case
        self._edges = frozenset(c for token in reserved for c in (token[0], token[-1], token[0].swapcase(),
                                                                  token[-1].swapcase()))
        special = set(processor.tokenizer.special_tokens_map)
        own = set(inspect.signature(processor.apply_chat_template).parameters)
        # NOTE: a special token's name (bos_token, image_token, ...) passed as a variable would replace it in
        # the render, and `chat_template` would replace the template: a client could write control tokens.
        # Names the template sets itself before reading them (Gemma's `loop_messages`) are listed by jinja too;
        # its own `set` wins over a client's value.
        self.variables = _variables(processor.chat_template) - RENDER_NAMES - special - own

    def render(self, parsed: ParsedMessages, options: TemplateOptions) -> str:
        """The prompt text; raises InvalidRequestError (naming the field) for options the messages cannot take."""
        _check_options(parsed, options)
        kwargs = self._kwargs(options.kwargs)
        text = self._apply(parsed.template_messages, options, kwargs)
        self._check_joined_text(text, parsed, options, kwargs)
        return text

    def _kwargs(self, asked: dict[str, Any]) -> dict[str, Any]:
        """The variables of `chat_template_kwargs` the template reads; the rest are dropped, as vLLM does (a
        client may send one set, e.g. `enable_thinking`, to every model)."""
        if not isinstance(asked, dict):
            raise InvalidRequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        kept = {name: value for name, value in asked.items() if name in self.variables}
        if len(kept) < len(asked):
            log.debug("chat_template_kwargs not read by the template, dropped: %s", sorted(set(asked) - set(kept)))
        for text in _strings(kept, MAX_KWARGS_DEPTH):
            for token in self._reserved:
                if token in text:
                    raise InvalidRequestError(f"chat_template_kwargs contains {token!r}, a control token of the "
                                              "model's prompt format", param="chat_template_kwargs")
        return kept

    def _apply(self, messages: list[dict[str, Any]], options: TemplateOptions, kwargs: dict[str, Any]) -> str:
        try:
            return str(self._processor.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **kwargs))
        except jinja2.TemplateError as err:
            raise InvalidRequestError(f"messages rejected by the chat template: {err}") from err
        except (TypeError, ValueError) as err:
            if options.continue_final_message and isinstance(err, ValueError):
                # NOTE: transformers' refusal when the template drops or rewrites the final message's text
                raise InvalidRequestError("continue_final_message: the chat template does not end the prompt "
                                          "with the final message's text", param="continue_final_message") from err
            if kwargs:  # e.g. a number where the template adds a string
                raise InvalidRequestError(f"chat_template_kwargs rejected by the chat template: {err}",
                                          param="chat_template_kwargs") from err
            raise

    def _check_joined_text(self, text: str, parsed: ParsedMessages, options: TemplateOptions,
                           kwargs: dict[str, Any]) -> None:
        """Refuse a prompt that holds more of a reserved string than the template writes by itself.

        NOTE: each text is checked alone (chat_messages, `_kwargs`), but a template joins texts (Gemma's trims a
        message's text parts and concatenates them; another may join two variables, or change a string's case),
        so harmless parts ("<end_of_", "turn>") can meet as a control token that forges a turn or breaks an
        image's placeholders. The same messages and variables with every text neutral show what the template
        itself writes (one more render, tens of µs).
        """
        neutral = with_neutral_text(parsed.template_messages)
        try:
            own = self._apply(neutral, options, _neutral(kwargs))
        except InvalidRequestError:
            if not kwargs:
                raise
            # NOTE: the template refused a neutral value (it checks one: `reasoning_effort in [...]`): the strings
            # that hold no character a reserved token begins or ends with stay as sent (such a token made of
            # joined texts needs both from them)
            own = self._apply(neutral, options, _neutral(kwargs, self._edges))
        where = "messages and chat_template_kwargs" if kwargs else "messages"
        for token in self._reserved:
            if text.count(token) > own.count(token):
                raise InvalidRequestError(f"{where}: texts that the chat template joins together contain {token!r}, "
                                          "a control token of the model's prompt format (it would fake a turn or "
                                          "an image); send it some other way", param=None if kwargs else "messages")


def _check_options(parsed: ParsedMessages, options: TemplateOptions) -> None:
    if not options.continue_final_message:
        return
    if options.add_generation_prompt:  # NOTE: vLLM's and transformers' rule; the client sets both explicitly
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: set "
                                  "add_generation_prompt to false to continue the final message",
                                  param="continue_final_message")
    content = parsed.template_messages[-1]["content"]
    texts = [content] if isinstance(content, str) else [part["text"] for part in content if part["type"] == "text"]
    # NOTE: blank text too: the template trims it, and the cut after it would take the turn header's newline with
    # it (transformers refuses an empty string, and with blank text ends the prompt inside the header as well)
    if not any(text.strip() for text in texts):
        raise InvalidRequestError("continue_final_message needs text in the final message to continue",
                                  param="continue_final_message")
    kinds = [] if isinstance(content, str) else [part["type"] for part in content]
    if "image" in kinds and kinds[::-1].index("image") < kinds[::-1].index("text"):
        # NOTE: transformers cuts the prompt after the final message's last text, and an image after it with it
        raise InvalidRequestError("continue_final_message continues the final message's last text, so no image "
                                  "may follow it in that message; put the image before the text",
                                  param="continue_final_message")


def _variables(template: str | dict[str, str]) -> frozenset[str]:
    """The names a template reads without setting them (its inputs); none if it cannot be parsed here."""
    sources = list(template.values()) if isinstance(template, dict) else [template]
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])  # NOTE: parsed, never rendered here
    names: set[str] = set()
    for source in sources:
        try:
            names |= jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError as err:  # e.g. a tag of transformers' own environment
            log.warning("the chat template's variables could not be read (%s): chat_template_kwargs are dropped", err)
            return frozenset()
    return frozenset(names)


def _strings(value: Any, depth: int) -> Iterator[str]:
    """Every string in a JSON value, keys included; refused past `depth` levels of nesting."""
    if depth < 0:
        raise InvalidRequestError(f"chat_template_kwargs nest deeper than {MAX_KWARGS_DEPTH} levels",
                                  param="chat_template_kwargs")
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, depth - 1)
            yield from _strings(item, depth - 1)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item, depth - 1)


def _neutral(value: Any, edges: frozenset[str] | None = None) -> Any:
    """The same JSON value with every string value a neutral letter (keys kept: a template looks them up), or,
    given `edges`, only those that hold one of those characters."""
    if isinstance(value, str):
        return NEUTRAL_TEXT if edges is None or edges.intersection(value) else value
    if isinstance(value, dict):
        return {key: _neutral(item, edges) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_neutral(item, edges) for item in value]
    return value
