"""`n` choices over HTTP with the official `openai` client: streamed and not, the same seeded choices, the
prompt counted once in usage."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.chat_client import client_for, user
from tests.e2e.e2e_support import Server

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def client(e2e_server: Server) -> Iterator[OpenAI]:
    with client_for(e2e_server) as c:
        yield c


def test_n_choices_streamed_and_not_agree(client, e2e_server):
    kwargs: dict[str, Any] = {"model": e2e_server.model_name, "messages": typing.cast(Any, user("Tell me a story.")),
                              "max_tokens": 10, "temperature": 1.0, "seed": 11, "n": 3}
    full = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.message.content for c in full.choices]
    assert len(set(texts)) == 3  # each choice its own seed stream
    one = client.chat.completions.create(**{**kwargs, "n": 1})
    assert one.choices[0].message.content == texts[0]  # choice 0 is the request alone
    assert full.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    lengths = [len(c.model_extra["token_ids"]) for c in full.choices]  # vLLM's return_token_ids
    assert full.usage.completion_tokens == sum(lengths) and all(1 <= n <= 10 for n in lengths)  # every choice's
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(3)] == texts and set(reasons) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    # the client's stream helper, which finds each choice by its position among those it has seen
    # (its final completion would raise for finish_reason "length": it is made for parsing)
    with client.chat.completions.stream(**kwargs) as events:
        for _ in events:
            pass
        helped = events.current_completion_snapshot
    assert [(c.index, c.message.content) for c in helped.choices] == list(enumerate(texts))
