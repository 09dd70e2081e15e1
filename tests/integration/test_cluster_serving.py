"""Requests over HTTP through the ingress of the multi-node app answer exactly what the in-process
engine answers on the same checkpoint (greedy): same text, same token counts, same finish reason."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mmserve.api.protocol import ChatCompletionRequest
from mmserve.engine import Completion, Engine
from tests.integration.conftest import AppInfo
from tests.integration.helpers import SSEStream, chat_body, data_url, encoder_forward_passes, get_text, post_json


def engine_answer(engine: Engine, body: dict[str, Any]) -> Completion:
    """What the in-process engine makes of the same HTTP body (mapped by the same protocol code)."""
    request = ChatCompletionRequest.model_validate(body).to_chat_request(
        f"ref-{uuid.uuid4().hex}", engine.spec.max_model_len, engine.spec.sampling_defaults)
    return engine.generate([request])[0]


def assert_same(answer: dict[str, Any], expected: Completion) -> None:
    choice = answer["choices"][0]
    assert choice["message"]["content"] == expected.text
    assert choice["finish_reason"] == expected.finish_reason
    assert answer["usage"]["completion_tokens"] == len(expected.token_ids)
    assert answer["usage"]["prompt_tokens"] == expected.num_prompt_tokens


def test_image_request_matches_in_process_engine(mm_app: AppInfo, reference_engine: Engine):
    body = chat_body(data_url(seed=101), text="Describe the picture.", max_tokens=12, ignore_eos=True)
    status, answer = post_json(mm_app.base_url, "/v1/chat/completions", body)
    assert status == 200, answer
    expected = engine_answer(reference_engine, body)
    assert len(expected.token_ids) == 12 and expected.text  # something to compare
    assert_same(answer, expected)


def test_token_ids_through_the_stage_handles_match_engine(mm_app: AppInfo, reference_engine: Engine):
    """The same pipeline driven stage by stage through handles, where token ids are visible."""
    body = chat_body(data_url(seed=107), text="Name three things.", max_tokens=12, ignore_eos=True)
    request = ChatCompletionRequest.model_validate(body).to_chat_request(
        f"it-{uuid.uuid4().hex}", reference_engine.spec.max_model_len, reference_engine.spec.sampling_defaults)
    pre = mm_app.handle("Preprocess").process.remote(request).result(timeout_s=120)
    tokens: list[int] = []
    for out in mm_app.handle("Decoder").options(stream=True).generate.remote(pre):
        tokens += out.new_token_ids
    expected = engine_answer(reference_engine, body)
    assert pre.prompt_token_ids == reference_engine.preprocess(request).prompt_token_ids
    assert tokens == expected.token_ids and len(tokens) == 12


def test_concurrent_requests_each_match_the_engine(mm_app: AppInfo, reference_engine: Engine):
    """Batched in the decoder and spread over both encoder and preprocess replicas, every answer
    still equals its own single-request reference; text-only and two-image requests included."""
    bodies = [
        chat_body(data_url(seed=102), text="What colour dominates?", max_tokens=10, ignore_eos=True),
        chat_body(data_url(seed=103, width=200, height=400), text="Is it tall?", max_tokens=6),
        chat_body(data_url(seed=104), data_url(seed=105), text="Compare them.", max_tokens=9, ignore_eos=True),
        {"messages": [{"role": "user", "content": "Tell me a short story."}], "temperature": 0, "max_tokens": 7},
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post_json(mm_app.base_url, "/v1/chat/completions", b), bodies))
    for body, (status, answer) in zip(bodies, answers, strict=True):
        assert status == 200, answer
        assert_same(answer, engine_answer(reference_engine, body))


def test_streamed_answer_matches_engine(mm_app: AppInfo, reference_engine: Engine):
    body = chat_body(data_url(seed=106), max_tokens=10, ignore_eos=True, stream=True,
                     stream_options={"include_usage": True})
    stream = SSEStream(mm_app.cluster.http_port, "/v1/chat/completions", body)
    try:
        events = list(stream.events())
    finally:
        stream.close()
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    expected = engine_answer(reference_engine, {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    assert text == expected.text
    assert reasons == [expected.finish_reason]
    assert usage["completion_tokens"] == len(expected.token_ids) == 10


def test_metrics_endpoint_sums_every_stage(mm_app: AppInfo):
    status, text = get_text(mm_app.base_url, "/metrics")
    assert status == 200
    for name in ("mmserve_image_processor_calls_total", "mmserve_encoder_forward_passes_total",
                 "mmserve_decoder_kv_blocks", "mmserve_processor_cache_queries_total"):
        assert name in text, name
    # A new image's forward reaches /metrics as the Encoder replicas count it. NOTE: in increments: the counts of
    # replicas killed by earlier tests stay in the sum (they count what was done), the live replicas' push every
    # 5 s; so the sum less the live replicas' own counts is constant once settled, and stays so after the forward.
    def gap() -> tuple[float, int]:  # (/metrics' sum less the live replicas' count, that count)
        live = encoder_forward_passes(mm_app)
        _, text = get_text(mm_app.base_url, "/metrics")
        served = next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                      if s.name == "mmserve_encoder_forward_passes_total")
        return served - live, live

    settled = [gap()]
    while len(settled) < 12 and (len(settled) < 2 or settled[-1] != settled[-2]):
        time.sleep(6.0)  # longer than a push interval
        settled.append(gap())
    assert settled[-1] == settled[-2], f"the counts kept moving with nothing sent: {settled}"
    offset, live_before = settled[-1]
    status, _ = post_json(mm_app.base_url, "/v1/chat/completions", chat_body(data_url(seed=9091), max_tokens=2))
    assert status == 200
    deadline, now = time.monotonic() + 60, gap()
    while time.monotonic() < deadline and not (now[1] > live_before and now[0] == offset):
        time.sleep(0.5)
        now = gap()
    assert now[1] > live_before and now[0] == offset, f"/metrics moved apart from the replicas: {settled}, {now}"
