"""The official `openai` client and the server's `/metrics` as the e2e tests drive them.

Owns: a client with no retries, the chat messages and calls the tests send (plain and streamed, with the
stream's invariants checked), and reading counters from `/metrics` once they settle. Does not own the server
(conftest.py, serve_process.py) nor any test.
"""

from __future__ import annotations

import time
import typing
from typing import Any

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.e2e_support import Server, data_url, encode_image, http_get, make_image

# NOTE: > a replica's push period: its 1 s interval plus the push itself (a snapshot and a round trip to the
# hub), which takes seconds on a busy CI machine; two scrapes closer than that can agree before a push
METRICS_SETTLE_S = 3.0
METRICS_TIMEOUT_S = 30.0


def client_for(server: Server, **kwargs: Any) -> OpenAI:
    # NOTE: no retries: a retried request would hide a flaky server and double counters.
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120.0, **kwargs)


def user(text: str, *image_urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def complete(client: OpenAI, server: Server, messages: list[dict[str, Any]], max_tokens: int = 12,
             **kwargs: Any) -> Any:
    return client.chat.completions.create(model=server.model_name, messages=typing.cast(Any, messages),
                                          max_tokens=max_tokens, temperature=0, **kwargs)


def stream(client: OpenAI, server: Server, messages: list[dict[str, Any]], max_tokens: int = 12) -> dict[str, Any]:
    """Text, finish reason and usage assembled from a streamed completion (usage requested)."""
    text, finish, usage, roles, ids = [], [], [], [], set()
    with client.chat.completions.create(model=server.model_name, messages=typing.cast(Any, messages),
                                        max_tokens=max_tokens, temperature=0, stream=True,
                                        stream_options={"include_usage": True}) as chunks:
        for chunk in chunks:
            ids.add(chunk.id)
            if chunk.usage is not None:
                assert chunk.choices == [], "the usage chunk carries no choices"
                usage.append(chunk.usage)
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.append(choice.delta.role)
                if choice.delta.content:
                    text.append(choice.delta.content)
                if choice.finish_reason is not None:
                    finish.append(choice.finish_reason)
    assert len(ids) == 1, f"one completion id per stream, got {ids}"
    assert roles == ["assistant"], roles
    assert len(finish) == 1, f"exactly one finish_reason, got {finish}"
    assert len(usage) == 1, f"exactly one usage chunk, got {len(usage)}"
    return {"text": "".join(text), "finish_reason": finish[0], "usage": usage[0]}


def answer(response: Any) -> tuple[str, str, int, int]:
    choice = response.choices[0]
    return choice.message.content, choice.finish_reason, response.usage.prompt_tokens, response.usage.completion_tokens


def png_url(seed: int) -> str:
    return data_url(encode_image(make_image(seed)))


def scrape(server: Server) -> dict[str, float]:
    """Unlabelled sample name -> value (histogram samples keep their _bucket/_sum/_count names)."""
    status, _, body = http_get(server.base_url + "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = sample.value
    return out


def settled(server: Server, names: tuple[str, ...], after: dict[str, float] | None = None) -> dict[str, float]:
    """Counters once they stopped moving for a push interval (and, given `after`, moved past it)."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    previous = None
    while time.monotonic() < deadline:
        now = scrape(server)
        values = {n: now.get(n) for n in names}
        moved = after is None or any(values[n] != after[n] for n in names)
        if values == previous and moved and None not in values.values():
            return {n: v for n, v in values.items() if v is not None}
        previous = values
        time.sleep(METRICS_SETTLE_S)
    pytest.fail(f"metrics did not settle within {METRICS_TIMEOUT_S:.0f} s: {previous}")


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {n: b[n] - a[n] for n in a}
