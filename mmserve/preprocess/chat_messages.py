"""The OpenAI chat messages a request carries, checked and reshaped for the chat template.

Owns: the message shape (roles, content parts, text and image_url parts), the refusal of reserved
image-token strings in user text, the same messages with neutral text (`with_neutral_text`, for the
preprocessor's check of the rendered prompt), and collecting the image URLs in prompt order. Nothing is fetched
or tokenized here (preprocessor.py does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "developer")  # NOTE: "developer" (OpenAI's newer name) is served as "system"


@dataclass(frozen=True)
class ParsedMessages:
    template_messages: list[dict[str, Any]]  # what the chat template reads; images as {"type": "image"}
    image_urls: list[str]  # in prompt order


def parse_messages(messages: Any, *, reserved: tuple[str, ...], max_parts: int | None = None) -> ParsedMessages:
    """Check the OpenAI message shape and collect image URLs; nothing is fetched here. More than `max_parts`
    messages and content parts together is a 400."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    parts = len(messages) + sum(len(m["content"]) for m in messages
                                if isinstance(m, dict) and isinstance(m.get("content"), list))
    if max_parts is not None and parts > max_parts:
        raise InvalidRequestError(f"messages: {parts} messages and content parts; the limit is {max_parts} "
                                  "(limits.max_message_parts)", param="messages")
    out: list[dict[str, Any]] = []
    urls: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        content = _parse_content(message.get("content"), where, reserved, urls)
        role = "system" if role == "developer" else role
        if role == "system":
            content = _system_text(content, where)
        out.append({"role": role, "content": content})
    return ParsedMessages(out, urls)


def _parse_content(content: Any, where: str, reserved: tuple[str, ...],
                   urls: list[str]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        _check_text(content, f"{where}.content", reserved)
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{at}.text must be a string")
            _check_text(text, f"{at}.text", reserved)
            parts.append({"type": "text", "text": text})
        elif kind == "image_url":
            urls.append(_image_url(part.get("image_url"), at))
            parts.append({"type": "image"})
        else:
            raise InvalidRequestError(f"{at} has unsupported part type {kind!r}; "
                                      "supported: 'text', 'image_url'")
    return parts


def _image_url(value: Any, at: str) -> str:
    url = value.get("url") if isinstance(value, dict) else value  # NOTE: a bare string is accepted
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{at}.image_url.url must be a non-empty string")
    return url


def _check_text(text: str, at: str, reserved: tuple[str, ...]) -> None:
    for token in reserved:
        if token in text:
            raise InvalidRequestError(f"{at} contains {token!r}, a control token of the model's prompt format "
                                      "(it would fake a turn or an image); send it some other way")


def with_neutral_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same template messages with every text a neutral letter: what a chat template renders around them
    is then all its own (no reserved string begins or ends with a letter)."""
    def neutral(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(content, str):
            return NEUTRAL_TEXT
        return [{**part, "text": NEUTRAL_TEXT} if part["type"] == "text" else part for part in content]

    return [{**message, "content": neutral(message["content"])} for message in messages]


NEUTRAL_TEXT = "x"


def _system_text(content: str | list[dict[str, Any]], where: str) -> str:
    """NOTE: the text parts joined by newlines, as vLLM renders list content for a template that takes a string
    (Gemma's reads only a system message's first part: the others would be dropped)."""
    if isinstance(content, str):
        return content
    if any(p["type"] != "text" for p in content):
        raise InvalidRequestError(f"{where}: a system message may contain text only")
    return "\n".join(p["text"] for p in content)
