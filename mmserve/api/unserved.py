"""Chat request fields mmserve does not serve: known ones refused unless at their default, unknown ones logged.

Owns: the table of OpenAI's and vLLM's request fields that would change the answer and that mmserve does not
implement (tools, beam search, prompt log-probs, echo, a request's own chat template, ...), the check that each
one a request sets is at its default (else a 400 naming it: answering without it would answer another
question than the one asked), and one warning per field name that no table knows (vLLM logs them too; a
client's typo or a newer API's field is then visible to the operator). Does not own the fields mmserve
serves (`protocol.py`, `structured.py`) nor the error bodies (`errors.py`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mmserve.api.errors import UnsupportedParameterError, with_param

log = logging.getLogger(__name__)


def _off(value: Any) -> bool:
    return not value


def _is(*defaults: Any) -> Callable[[Any], bool]:
    """A check that the value is None (unset) or equal to one of `defaults` (1 and 1.0 alike)."""
    return lambda value: value is None or value in defaults


# field -> (is the value one mmserve serves, why not). NOTE: only fields whose other values change the
# answer; hints that change nothing here (`user`, `store`, `prediction`, `priority` 0, ...) are left to
# the unknown-field log.
UNSERVED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # OpenAI's
    "tools": (_off, "tool calling is not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tool calling is not supported"),
    "functions": (_off, "function calling is not supported"),
    "function_call": (lambda v: v in (None, "none"), "function calling is not supported"),
    "modalities": (lambda v: v is None or set(v) <= {"text"}, "only the 'text' output modality is supported"),
    "audio": (_is(), "audio output is not supported"),
    "web_search_options": (_is(), "web search is not supported"),
    # vLLM's extensions
    "use_beam_search": (_off, "beam search is not supported"),
    "best_of": (_is(1), "best_of is not supported (n choices are served)"),
    "length_penalty": (_is(1.0), "length_penalty applies to beam search, which is not supported"),
    "truncate_prompt_tokens": (_is(), "prompt truncation is not supported"),
    "prompt_logprobs": (_is(), "prompt log-probabilities are not supported"),
    "echo": (_off, "echo is not supported"),
    "add_special_tokens": (_off, "the chat template's special tokens are the only ones added"),
    "chat_template": (_is(), "a request's own chat template is not supported"),
    "priority": (_is(0), "priority scheduling is not supported"),
    "logits_processors": (_off, "custom logits processors are not supported"),
    "return_tokens_as_token_ids": (_off, "return_tokens_as_token_ids is not supported"),
    "kv_transfer_params": (_off, "disaggregated serving (kv_transfer_params) is not supported"),
    "vllm_xargs": (_off, "vllm_xargs is not supported"),
    "structural_tag": (_off, "structural tags are not supported (response_format's json_schema is)"),
}

_LOGGED_AT_MOST = 256  # distinct unknown names warned about per process (NOTE: a client may send any names)
_NAME_KEPT = 64  # characters of an unknown name kept and logged
_logged: set[str] = set()
_lock = threading.Lock()


# field -> (the field that may make it moot, the value that does). NOTE: with `tool_choice: "none"` the model
# may call no tool, and OpenAI and vLLM answer in text: agent frameworks send their tool list anyway. The list
# is then not rendered (the chat templates served here have no tools).
MOOT_WHEN = {"tools": ("tool_choice", "none"), "functions": ("function_call", "none")}


def check_served(fields: Mapping[str, Any]) -> None:
    """Raise UnsupportedParameterError (a 400 naming the field) for the first unserved field not at its
    default; `fields` maps the request's top-level field names to their values."""
    for name, (ok, why) in UNSERVED.items():
        moot = MOOT_WHEN.get(name)
        if moot is not None and fields.get(moot[0]) == moot[1]:
            continue
        if name in fields and not ok(fields[name]):
            raise with_param(UnsupportedParameterError(f"{name}: {why}"), name)


def log_unknown(names: Iterable[str]) -> None:
    """Warn once per process about each field name that neither the request schema nor UNSERVED knows."""
    # NOTE: names cut short, kept and logged (as repr): a client's field name may be megabytes or hold line breaks
    new = sorted({n[:_NAME_KEPT] for n in set(names) - UNSERVED.keys()} - _logged)
    if not new:
        return
    with _lock:
        new = [n for n in new if n not in _logged][: max(0, _LOGGED_AT_MOST - len(_logged))]
        _logged.update(new)
    if new:
        log.warning("request fields ignored (not part of the API mmserve serves): %s", ", ".join(map(repr, new)))
