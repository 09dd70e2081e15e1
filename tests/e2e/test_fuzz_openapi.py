"""The served API fuzzed from its own OpenAPI document with schemathesis: valid bodies (positive cases)
and bodies that break the schema (negative cases) for every operation; none may get a 5xx, and the
server serves normally afterwards.

NOTE: the cases are drawn with hypothesis from each operation's strategy here rather than with
schemathesis' pytest plugin, whose lazy (fixture-loaded) schemas do not run under pytest 9.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.e2e.e2e_support import Server, data_url, encode_image, http_post_json, make_image

EXAMPLES = 150  # per operation and mode; derandomized, so CI runs the same cases every time
MAX_TOKENS = 8  # NOTE: generation length says nothing about input handling; it only costs CI time
OPERATIONS = [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/models/{model}"),
              ("GET", "/health"), ("GET", "/metrics")]


@pytest.fixture(scope="module")
def api_schema(e2e_server: Server) -> Any:
    return schemathesis.openapi.from_url(f"{e2e_server.base_url}/openapi.json")


def test_the_document_lists_every_operation_and_the_chat_body(api_schema: Any) -> None:
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)
    chat = api_schema["/v1/chat/completions"]["POST"]
    assert chat.body, "the chat body is described, so the fuzzer generates bodies, not nothing"


def _short(body: Any) -> None:
    """Bound the output length of a valid-looking body (in place)."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS


# NOTE: only the chat operation takes a body; the others' negative cases cannot exist (no parameters, or a
# model id, any string of which is valid)
RUNS = [("POST", "/v1/chat/completions", GenerationMode.NEGATIVE)] + [
    (method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS]


@pytest.mark.parametrize("method, path, mode", RUNS, ids=lambda v: getattr(v, "value", v))
def test_no_generated_request_gets_a_server_error(api_schema: Any, e2e_server: Server, method: str, path: str,
                                                  mode: GenerationMode) -> None:
    statuses: list[int] = []

    @given(case=api_schema[path][method].as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        _short(case.body)
        response = case.call(base_url=e2e_server.base_url, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:400])
        if response.status_code >= 400 and path == "/v1/chat/completions":  # OpenAI-shaped, says what was wrong
            error = response.json()["error"]
            assert error["type"] and error["message"], response.text[:400]

    check()
    assert statuses, "no case was generated"
    print(method, path, mode.value, {code: statuses.count(code) for code in sorted(set(statuses))})


def test_after_the_fuzz_the_server_serves_normally(e2e_server: Server) -> None:
    """Runs after the fuzz cases above (file order): a plain image request still gets its answer."""
    content = [{"type": "image_url", "image_url": {"url": data_url(encode_image(make_image(seed=3)))}},
               {"type": "text", "text": "What is this?"}]
    status, raw = http_post_json(f"{e2e_server.base_url}/v1/chat/completions", {
        "model": e2e_server.model_name, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": content}]}, timeout=120)
    assert status == 200, raw[:400]
    answer = json.loads(raw)
    assert answer["choices"][0]["finish_reason"] in ("stop", "length") and answer["usage"]["completion_tokens"] >= 1
