"""The real server (`serve run`, see conftest.py) driven by the official `openai` client.

One server for the session; tests that read counters compare deltas, since others share it.
"""

from __future__ import annotations

import json
import os
import threading
import time
import typing
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.engine import Engine
from mmserve.messages import ChatRequest, SamplingParams, TemplateOptions
from tests.e2e.chat_client import (
    METRICS_SETTLE_S,
    METRICS_TIMEOUT_S,
    answer,
    client_for,
    complete,
    delta,
    png_url,
    settled,
    stream,
    user,
)
from tests.e2e.e2e_support import (
    MAX_MODEL_LEN,
    ImageHost,
    Server,
    data_url,
    encode_image,
    http_get,
    http_post_json,
    make_image,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engine(e2e_server: Server) -> Iterator[Engine]:
    """The in-process engine on the same checkpoint and context length as the server."""
    eng = Engine.from_model_dir(str(e2e_server.model_dir), max_model_len=MAX_MODEL_LEN)
    yield eng
    eng.shutdown()


def engine_run(engine: Engine, messages: list[dict[str, Any]], max_tokens: int = 12) -> Any:
    request = ChatRequest(f"e2e-{uuid.uuid4().hex}", messages, SamplingParams(max_tokens=max_tokens, temperature=0))
    [out] = engine.generate([request])
    return out


# --- 1. streaming vs not vs the in-process engine ------------------------------------------------------


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_stream_and_non_stream_match_engine(client, e2e_server, engine, with_image):
    image_seed = 101
    messages = user("Describe the picture in detail.", png_url(image_seed)) if with_image \
        else user("Tell me a story about a dragon.")
    ref = engine_run(engine, messages, max_tokens=12)
    pre = engine.preprocess(ChatRequest("count", messages, SamplingParams(max_tokens=12, temperature=0)))

    full = complete(client, e2e_server, messages, max_tokens=12)
    text, finish, prompt_tokens, completion_tokens = answer(full)
    assert full.model == e2e_server.model_name
    assert full.choices[0].message.role == "assistant"
    assert text == ref.text
    assert text, "a 12-token greedy answer of the tiny model is not empty"
    assert finish == ref.finish_reason
    assert completion_tokens == len(ref.token_ids)
    assert prompt_tokens == ref.num_prompt_tokens == len(pre.prompt_token_ids)
    assert full.usage.total_tokens == prompt_tokens + completion_tokens
    if with_image:
        # the image's placeholders are counted: 16 soft tokens (tiny 224 px checkpoint) plus the markers
        assert pre.prompt_token_ids.count(engine.spec.image_token_id) == engine.spec.mm_tokens_per_image == 16
        text_only = engine.preprocess(ChatRequest("count", user("Describe the picture in detail."),
                                                  SamplingParams(max_tokens=12, temperature=0)))
        assert prompt_tokens >= len(text_only.prompt_token_ids) + 16

    streamed = stream(client, e2e_server, messages, max_tokens=12)
    assert streamed["text"] == text
    assert streamed["finish_reason"] == finish
    usage = streamed["usage"]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def test_a_final_assistant_message_is_continued_as_vllm_does(client, e2e_server, engine):
    """vLLM's `continue_final_message` (with `add_generation_prompt: false`) through HTTP: the prompt ends inside
    the final message, as the in-process engine renders it; `chat_template_kwargs` the template does not read
    change nothing."""
    messages = [*user("Name a colour."), {"role": "assistant", "content": "My favourite colour is"}]
    template = TemplateOptions(add_generation_prompt=False, continue_final_message=True)
    request = ChatRequest("e2e-continue", messages, SamplingParams(max_tokens=12, temperature=0), template=template)
    [ref] = engine.generate([request])
    pre = engine.preprocess(request)
    assert engine.preprocess(replace(request, template=TemplateOptions())).prompt_token_ids != pre.prompt_token_ids

    full = complete(client, e2e_server, messages, extra_body={
        "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    text, finish, prompt_tokens, _ = answer(full)
    assert (text, finish, prompt_tokens) == (ref.text, ref.finish_reason, len(pre.prompt_token_ids))
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, e2e_server, messages, extra_body={"continue_final_message": True})
    assert typing.cast(dict[str, Any], info.value.body)["param"] == "continue_final_message"


def test_return_token_ids_gives_the_engines_prompt_and_output_ids(client, e2e_server, engine):
    """vLLM's `return_token_ids` through HTTP, streamed and not: the prompt's ids (the image expanded) and the
    output's, as the in-process engine makes them."""
    messages = user("Describe the picture.", png_url(103))
    request = ChatRequest("e2e-ids", messages, SamplingParams(max_tokens=12, temperature=0))
    [ref] = engine.generate([request])
    prompt = engine.preprocess(request).prompt_token_ids
    full = complete(client, e2e_server, messages, extra_body={"return_token_ids": True})
    extra = typing.cast(dict[str, Any], full.model_extra)
    ended = {} if ref.stop_reason is None else {"stop_reason": ref.stop_reason}  # vLLM's, where a stop id ended it
    assert extra["prompt_token_ids"] == prompt and full.choices[0].model_extra == {"token_ids": ref.token_ids, **ended}
    with client.chat.completions.create(model=e2e_server.model_name, messages=typing.cast(Any, messages),
                                        max_tokens=12, temperature=0, stream=True,
                                        extra_body={"return_token_ids": True}) as chunks:
        got = list(chunks)
    assert typing.cast(dict[str, Any], got[0].model_extra)["prompt_token_ids"] == prompt
    assert [t for c in got for t in typing.cast(dict[str, Any], c.choices[0].model_extra)["token_ids"]] == \
        ref.token_ids


def test_streams_are_not_buffered_by_proxies(client, e2e_server):
    with client.chat.completions.with_streaming_response.create(
            model=e2e_server.model_name, messages=typing.cast(Any, user("Hi.")), max_tokens=2, stream=True) as streamed:
        assert (streamed.headers["cache-control"], streamed.headers["x-accel-buffering"]) == ("no-cache", "no")
        assert "[DONE]" in streamed.text()
    # NOTE: Serve's proxy names every answer's request (x-request-id, its logs' id; the official client reads it)
    raw = client.chat.completions.with_raw_response.create(
        model=e2e_server.model_name, messages=typing.cast(Any, user("Hi.")), max_tokens=2)
    assert raw.request_id and "," not in raw.request_id


# --- 2. concurrency ---------------------------------------------------------------------------------


def test_concurrent_clients_match_sequential(e2e_server):
    requests = [
        (user("What do you see?", png_url(201)), 20),
        (user("Compare these two pictures.", png_url(202), png_url(203)), 16),
    ]
    # NOTE: concurrent first, with images no request has sent yet, so both are preprocessed and encoded
    # side by side (cache misses) too, not only decoded together; the sequential reruns then hit the caches.
    results: list[Any] = [None, None]
    spans: list[tuple[float, float]] = [(0.0, 0.0), (0.0, 0.0)]
    barrier = threading.Barrier(2, timeout=30)

    def run(i: int) -> None:
        messages, max_tokens = requests[i]
        try:
            with client_for(e2e_server) as c:  # one client (and connection pool) per thread
                barrier.wait()
                started = time.monotonic()
                if i == 0:
                    results[i] = answer(complete(c, e2e_server, messages, max_tokens=max_tokens))
                else:  # one of the two streams, so both response paths run side by side
                    s = stream(c, e2e_server, messages, max_tokens=max_tokens)
                    u = s["usage"]
                    results[i] = (s["text"], s["finish_reason"], u.prompt_tokens, u.completion_tokens)
                spans[i] = (started, time.monotonic())
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a client hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    (s0, e0), (s1, e1) = spans
    assert s0 < e1 and s1 < e0, "the two requests were in flight together"

    with client_for(e2e_server) as c:
        sequential = [answer(complete(c, e2e_server, m, max_tokens=n)) for m, n in requests]
    assert results == sequential
    assert sequential[0][0] != sequential[1][0]  # different requests, different answers: the check can fail


# --- 3. image encodings and URLs ------------------------------------------------------------------


def test_image_formats_and_urls(client, e2e_server, image_host: ImageHost):
    picture = make_image(301)
    png = encode_image(picture, "PNG")
    webp = encode_image(picture, "WEBP", lossless=True)
    jpeg = encode_image(picture, "JPEG", quality=90)
    question = "What is in this image?"

    by_png = answer(complete(client, e2e_server, user(question, data_url(png))))
    by_webp = answer(complete(client, e2e_server, user(question, data_url(webp, "image/webp"))))
    by_jpeg = answer(complete(client, e2e_server, user(question, data_url(jpeg, "image/jpeg"))))
    assert by_webp == by_png  # lossless: the same pixels
    assert by_jpeg[0] and by_jpeg[2] == by_png[2]  # decoded and expanded like the PNG
    other = answer(complete(client, e2e_server, user(question, png_url(302))))
    assert other[0] != by_png[0], "another picture changes the answer, so the comparisons above can fail"

    path = f"/img-{uuid.uuid4().hex[:8]}.png"
    url = image_host.add(path, png)
    by_http = answer(complete(client, e2e_server, user(question, url)))
    assert image_host.hits(path) == 1, "the server fetched the image from the local host"
    assert by_http == by_png


def test_url_outside_allowlist_is_refused(client, e2e_server):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, e2e_server, user("Describe.", "http://example.invalid/x.png"))
    err = info.value
    assert err.status_code == 400
    assert err.code == "unsupported_url"
    body = typing.cast(dict[str, Any], err.body)
    assert "example.invalid" in body["message"] and "allowed" in body["message"]


# --- 4. caches, as /metrics sees them ----------------------------------------------------------------

CACHE_COUNTERS = (
    "mmserve_processor_cache_queries_total",
    "mmserve_processor_cache_hits_total",
    "mmserve_image_processor_calls_total",
    "mmserve_encoder_cache_queries_total",
    "mmserve_encoder_cache_hits_total",
    "mmserve_encoder_forward_passes_total",
    "mmserve_decoder_embedding_cache_queries_total",
    "mmserve_decoder_embedding_cache_hits_total",
)


def test_same_image_twice_hits_the_caches(client, e2e_server, engine):
    image = png_url(int.from_bytes(os.urandom(4), "little") + 10_000)  # unique to this test and this run
    before = settled(e2e_server, CACHE_COUNTERS)
    first = complete(client, e2e_server, user("Describe this.", image), max_tokens=4)
    after_first = settled(e2e_server, CACHE_COUNTERS, before)
    again = user("And what about colours?", image)
    second = complete(client, e2e_server, again, max_tokens=4)
    after_second = settled(e2e_server, CACHE_COUNTERS, after_first)

    assert answer(first)[3] >= 1 and answer(second)[3] >= 1
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    placeholder = engine.preprocess(ChatRequest("probe", again, SamplingParams())).features[0].placeholder
    assert cached > placeholder.offset  # the template and at least part of the image came from the KV cache
    d1, d2 = delta(before, after_first), delta(after_first, after_second)
    assert d1 == {
        "mmserve_processor_cache_queries_total": 1, "mmserve_processor_cache_hits_total": 0,
        "mmserve_image_processor_calls_total": 1,
        "mmserve_encoder_cache_queries_total": 1, "mmserve_encoder_cache_hits_total": 0,
        "mmserve_encoder_forward_passes_total": 1,
        "mmserve_decoder_embedding_cache_queries_total": 1, "mmserve_decoder_embedding_cache_hits_total": 0,
    }, d1
    # an image wholly inside the cached prefix needs no embeddings at all; else the decoder kept them
    asked = 0 if placeholder.offset + placeholder.length <= cached else 1
    assert d2 == {
        "mmserve_processor_cache_queries_total": 1, "mmserve_processor_cache_hits_total": 1,
        "mmserve_image_processor_calls_total": 0,
        "mmserve_encoder_cache_queries_total": 0, "mmserve_encoder_cache_hits_total": 0,
        "mmserve_encoder_forward_passes_total": 0,
        "mmserve_decoder_embedding_cache_queries_total": asked, "mmserve_decoder_embedding_cache_hits_total": asked,
    }, (d2, cached, placeholder)


def test_a_repeated_chat_turn_reports_its_cached_tokens(client, e2e_server):
    image = png_url(int.from_bytes(os.urandom(4), "little") + 20_000)
    turn1 = user("What is in this picture?", image)
    first = complete(client, e2e_server, turn1, max_tokens=6)
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content},
             *user("And the colours?")]
    again = complete(client, e2e_server, turn2, max_tokens=6)
    streamed = stream(client, e2e_server, turn2, max_tokens=6)
    bs = 16  # the server's decoder.block_size (the default)
    for usage in (again.usage, streamed["usage"]):
        assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - bs, usage
    salted = complete(client, e2e_server, turn2, max_tokens=6, extra_body={"cache_salt": "another-tenant"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].message.content == again.choices[0].message.content  # the same answer


# --- 5. models, health, metrics -------------------------------------------------------------------------

REQUIRED_FAMILIES = {
    "mmserve_processor_cache_queries": "counter",
    "mmserve_processor_cache_hits": "counter",
    "mmserve_encoder_cache_queries": "counter",
    "mmserve_encoder_cache_hits": "counter",
    "mmserve_decoder_embedding_cache_hits": "counter",
    "mmserve_time_to_first_token_seconds": "histogram",
    "mmserve_request_time_per_output_token_seconds": "histogram",
    "mmserve_encoder_batch_size": "histogram",
    "mmserve_decoder_running_requests": "gauge",
    "mmserve_decoder_waiting_requests": "gauge",
}


def test_models_health_and_metrics(client, e2e_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [e2e_server.model_name]
    assert models.data[0].object == "model"
    assert models.data[0].model_extra.get("max_model_len") == MAX_MODEL_LEN  # the served context, not null
    assert client.models.retrieve(e2e_server.model_name).id == e2e_server.model_name
    with pytest.raises(openai.NotFoundError) as unserved:
        client.models.retrieve("org/another-model")
    assert unserved.value.code == "model_not_found"

    status, _, body = http_get(e2e_server.base_url + "/health")
    assert status == 200 and body == b'{"status":"ok"}'
    for path in ("/health", "/v1/models", f"/v1/models/{e2e_server.model_name}"):  # an uptime monitor's HEAD
        status, headers, _ = http_get(e2e_server.base_url + path, method="HEAD")
        assert status == 200 and headers["content-type"] == "application/json", (path, status)
    # the framework's own answers are OpenAI-shaped too: a path not served, a method the path does not take
    status, body = http_post_json(e2e_server.base_url + "/v1/completions", {"prompt": "hi"}, timeout=10)
    assert status == 404 and json.loads(body)["error"] == {
        "message": "Not Found (POST /v1/completions)", "type": "invalid_request_error", "code": "not_found",
        "param": None}
    status, _, body = http_get(e2e_server.base_url + "/v1/chat/completions")
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"
    status, headers, _ = http_get(e2e_server.base_url + "/v1/models", method="DELETE")
    assert status == 405 and headers["allow"] == "GET, HEAD"  # every method the path takes (RFC 9110)
    status, headers, _ = http_get(e2e_server.base_url + "/metrics", method="DELETE")
    assert status == 405 and headers["allow"] == "GET"  # a path that takes no HEAD lists none
    status, _, body = http_get(e2e_server.base_url + "/v1/models/")  # the list's path with a slash: the list
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [e2e_server.model_name]
    # no redirect for a trailing slash (its Location names the scheme it was reached by: http behind a balancer)
    status, _ = http_post_json(e2e_server.base_url + "/v1/chat/completions/", {"messages": []}, timeout=10)
    assert status == 404
    # a body a web page may send without a CORS preflight (text/plain) is not read as JSON: 415, nothing runs
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    plain = urllib.request.Request(e2e_server.base_url + "/v1/chat/completions", data=chat, method="POST",
                                   headers={"Content-Type": "text/plain"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(plain, timeout=10)
    assert refused.value.code == 415
    assert json.loads(refused.value.read())["error"]["code"] == "unsupported_media_type"

    # every stage has served at least one request (the warm-up image, and this one)
    complete(client, e2e_server, user("Describe.", png_url(601)), max_tokens=4, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        status, headers, body = http_get(e2e_server.base_url + "/metrics")
        assert status == 200
        assert headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}  # parses, or raises
        missing = {n for n in REQUIRED_FAMILIES if n not in families}
        # NOTE: and the Encoder's batches pushed: run alone, this test's image is the first the Encoder counts
        if not missing and _unlabelled(families, "mmserve_encoder_batch_size").get("mmserve_encoder_batch_size_count"):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(METRICS_SETTLE_S)
    assert not missing, f"missing from /metrics: {sorted(missing)}"
    for name, kind in REQUIRED_FAMILIES.items():
        assert families[name].type == kind, (name, families[name].type)
    ttft = {s.name: s.value for s in families["mmserve_time_to_first_token_seconds"].samples if not s.labels
            or s.labels.get("le") == "+Inf"}
    assert ttft["mmserve_time_to_first_token_seconds_count"] >= 1
    assert ttft["mmserve_time_to_first_token_seconds_bucket"] == ttft["mmserve_time_to_first_token_seconds_count"]
    # NOTE: the request above had tokens after its first: the ingress timed them
    tpot = _unlabelled(families, "mmserve_request_time_per_output_token_seconds")
    assert tpot["mmserve_request_time_per_output_token_seconds_count"] >= 1
    batches = _unlabelled(families, "mmserve_encoder_batch_size")
    assert batches["mmserve_encoder_batch_size_count"] >= 1 and batches["mmserve_encoder_batch_size_sum"] >= 1
    text = body.decode()
    assert "# TYPE mmserve_processor_cache_queries_total counter" in text or \
        "# TYPE mmserve_processor_cache_queries counter" in text
    assert "\nmmserve_processor_cache_queries_total " in text and "\nmmserve_encoder_cache_hits_total " in text


def _unlabelled(families: dict[str, Any], name: str) -> dict[str, float]:
    """The samples of metric family `name` without labels, by sample name (none if the family is absent)."""
    return {s.name: s.value for s in families[name].samples if not s.labels} if name in families else {}


def test_logprobs_streamed_and_not_agree(client, e2e_server):
    kwargs = {"model": e2e_server.model_name, "messages": typing.cast(Any, user("Tell me about cats.")),
              "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for token in content:
        best = [alt.logprob for alt in token.top_logprobs]
        assert len(best) == 3 and best == sorted(best, reverse=True)
        # greedy: the sampled token is the most likely one, with its log-probability
        assert token.token == token.top_logprobs[0].token and token.logprob == pytest.approx(best[0], abs=1e-6)
        assert token.logprob <= 0
    streamed = [t for chunk in client.chat.completions.create(**kwargs, stream=True) for choice in chunk.choices
                if choice.logprobs is not None for t in choice.logprobs.content]
    # NOTE: the second request reuses the first's prefix blocks, so its prefill runs fewer rows, which may take
    # another matmul form: logprobs agree to float32 rounding, not bit for bit (rounding to 4 places flaked).
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-3)
