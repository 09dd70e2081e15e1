"""Bad and hostile requests against the real server: OpenAI-shaped 4xx errors naming the problem, counted as
the client's, logged as nobody's failure, and the server serving on after them."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.chat_client import complete, png_url, user
from tests.e2e.e2e_support import (
    E2E_MAX_BODY_BYTES,
    MAX_IMAGES,
    MAX_MODEL_LEN,
    ImageHost,
    Server,
    data_url,
    encode_image,
    http_get,
    make_image,
)

pytestmark = pytest.mark.timeout(600)


def expect_error(fn, status: int, code: str, *words: str) -> None:
    exc_type = openai.NotFoundError if status == 404 else openai.BadRequestError
    with pytest.raises(exc_type) as info:
        fn()
    err = info.value
    assert err.status_code == status
    raw = err.response.json()
    assert set(raw) == {"error"} and {"message", "type", "code"} <= set(raw["error"]), raw
    assert raw["error"]["type"] == "invalid_request_error", raw
    assert raw["error"]["code"] == code, raw
    assert err.code == code and err.body == raw["error"]
    message = raw["error"]["message"]
    assert "Traceback" not in message and "RayTaskError" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def request_outcomes(server: Server) -> dict[str, float]:
    """mmserve_requests_total by status; the ingress pushes its own counts right before answering."""
    _, _, body = http_get(server.base_url + "/metrics")
    return {sample.labels["status"]: sample.value
            for family in text_string_to_metric_families(body.decode()) if family.name == "mmserve_requests"
            for sample in family.samples if sample.name == "mmserve_requests_total"}


def test_bad_requests_get_openai_errors(client, e2e_server, image_host: ImageHost):
    s = e2e_server
    outcomes_before = request_outcomes(s)
    log_start = s.log_path.stat().st_size

    def ask(messages, **kwargs):
        kwargs.setdefault("max_tokens", 4)
        kwargs.setdefault("temperature", 0)
        return lambda: client.chat.completions.create(model=kwargs.pop("model", s.model_name),
                                                      messages=messages, **kwargs)

    random_bytes = os.urandom(2048)
    expect_error(ask(user("Describe.", data_url(random_bytes))), 400, "invalid_image", "image 1", "decodable")
    expect_error(ask(user("Describe.", data_url(b"hello, I am plain text", "text/plain"))), 400, "invalid_image",
                 "not an image")
    expect_error(ask(user("Describe.", data_url(b"hello, I am plain text", "image/png"))), 400, "invalid_image",
                 "decodable")
    expect_error(ask(user("Hi"), temperature=-1), 400, "invalid_sampling_params", "temperature")
    expect_error(ask(user("Hi"), top_p=0), 400, "invalid_sampling_params", "top_p")
    expect_error(ask(user("Hi"), max_tokens=0), 400, "invalid_sampling_params", "max_tokens")

    # too many images: refused before any is fetched
    paths = [f"/many-{uuid.uuid4().hex[:8]}-{i}.png" for i in range(MAX_IMAGES + 1)]
    urls = [image_host.add(p, encode_image(make_image(400 + i))) for i, p in enumerate(paths)]
    expect_error(ask(user("Compare.", *urls)), 400, "too_many_images", str(MAX_IMAGES))
    assert all(image_host.hits(p) == 0 for p in paths), "images were fetched before the count was checked"

    expect_error(ask(user("word " * 600)), 400, "context_length_exceeded", str(MAX_MODEL_LEN))
    expect_error(ask(user("Describe.", "ftp://127.0.0.1/x.png")), 400, "unsupported_url", "ftp")
    expect_error(ask(user("Hi"), model="no-such-model"), 404, "model_not_found", "no-such-model")

    # the server is still fine
    marker = f"e2e-after-bad-{uuid.uuid4().hex[:8]}"
    ok = complete(client, s, user("Describe.", png_url(501)), max_tokens=4, extra_headers={"x-request-id": marker})
    assert ok.choices[0].finish_reason in ("stop", "length") and ok.usage.completion_tokens >= 1

    outcomes = request_outcomes(s)
    assert {k: outcomes[k] - outcomes_before[k] for k in outcomes} == \
        {"ok": 1, "client_error": 10, "overloaded": 0, "server_error": 0, "aborted": 0}

    # the client's faults are not logged as the stages' failures (an ERROR line with a traceback each)
    log = _serve_log_until(s, log_start, f"{marker} -- CALL generate OK")
    failed = [line for line in log.splitlines() if "Request failed" in line or "Traceback" in line]
    assert not failed, failed[:3]


def _post_raw(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_hostile_bodies_get_4xx_naming_the_problem(client, e2e_server):
    s = e2e_server
    url = s.base_url + "/v1/chat/completions"
    outcomes_before = request_outcomes(s)
    good = {"model": s.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    cases = [
        (b'{"model": "x", "messages": [', 400, "not valid JSON"),
        (b"\xff\xfe not utf-8", 400, "not UTF-8"),
        (b"", 400, "empty"),
        (b"[" * 50_000, 400, "nested too deeply"),
        (b"[1, 2]", 400, "valid dictionary"),
        (json.dumps({**good, "pad": "x" * (E2E_MAX_BODY_BYTES + 1)}).encode(), 413, "limit"),
        (json.dumps({**good, "stop": [f"s{i}" for i in range(17)]}).encode(), 400, "16"),
        (json.dumps({**good, "stop": ["y" * 300]}).encode(), 400, "256"),
        # JSON's escape of a lone surrogate: valid JSON, not valid Unicode (the tokenizer took it for a 500)
        (json.dumps({**good, "messages": [{"role": "user", "content": "hi \ud800"}]}).encode(), 400, "Unicode"),
        (json.dumps({**good, "logit_bias": {"99999": 5}}).encode(), 400, "vocabulary"),
        (json.dumps({**good, "stop_token_ids": [-3]}).encode(), 400, "vocabulary"),
    ]
    for data, status, says in cases:
        got, body = _post_raw(url, data)
        assert got == status and says in body["error"]["message"], (data[:40], got, body)
        assert body["error"]["type"] == "invalid_request_error", body
        if b"stop" in data or b"logit_bias" in data or b"\\ud800" in data:
            assert body["error"]["param"] in ("stop", "logit_bias", "stop_token_ids", "messages[0].content"), body
    ok = complete(client, s, user("Hi"), max_tokens=2)  # and the server still serves
    assert ok.usage.completion_tokens >= 1
    outcomes = request_outcomes(s)
    assert {k: outcomes[k] - outcomes_before[k] for k in outcomes} == \
        {"ok": 1, "client_error": len(cases), "overloaded": 0, "server_error": 0, "aborted": 0}


def _serve_log_until(s: Server, start: int, line: str, timeout_s: float = 30.0) -> str:
    """The server's log from byte `start` once `line` is in it: Ray ships each replica's lines in order,
    so the lines a replica logged before it are there too."""
    deadline = time.monotonic() + timeout_s
    while True:
        with s.log_path.open("rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        if line in text:
            return text
        assert time.monotonic() < deadline, f"{line!r} not in the server log after {timeout_s:.0f} s"
        time.sleep(0.5)
