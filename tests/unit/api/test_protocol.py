"""protocol.py / protocol_stream.py: the official `openai` client's requests parse, our responses and
stream chunks parse back in it, aliases and defaults, every validation error, error bodies."""

from __future__ import annotations

import importlib
import json
import logging
import pickle
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError

from mmserve.api import unserved
from mmserve.api.errors import (
    ModelNotFoundError,
    UnsupportedParameterError,
    error_body,
    route_error_body,
    validation_error_body,
)
from mmserve.api.protocol import ChatCompletionRequest, ModelCard, ModelList, check_model
from mmserve.api.stream import SSE_DONE, ChunkBuilder, CompletionBuilder, sse, sse_error
from mmserve.errors import InvalidRequestError, InvalidSamplingError, MediaError
from mmserve.messages import RequestFailed, RequestOutput, SamplingDefaults, TemplateOptions, TokenLogprob

openai = pytest.importorskip("openai")
# NOTE: the HTTP library the installed client is built on (httpx, or httpx2 in recent releases).
http = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])

USER = [{"role": "user", "content": "hi"}]


def outputs(texts: list[str], reason: str = "stop", prompt: int = 7) -> list[RequestOutput]:
    n = len(texts)
    return [RequestOutput("r", [i], t, i == n - 1, reason if i == n - 1 else None, prompt, i + 1)  # type: ignore[arg-type]
            for i, t in enumerate(texts)]


def fake_client(respond: Callable[[dict[str, Any]], Any], seen: dict[str, Any]) -> Any:
    """An `openai.OpenAI` whose HTTP calls go to `respond(request body)` in process."""

    def handler(request: Any) -> Any:
        seen["path"] = request.url.path
        seen["body"] = json.loads(request.content) if request.content else None
        return respond(seen["body"])

    client = http.Client(transport=http.MockTransport(handler))
    return openai.OpenAI(api_key="test", base_url="http://mmserve.test/v1", http_client=client)


def parse(body: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(body)


# --- the official client end to end -------------------------------------------------------------


def test_official_client_request_parses_and_response_is_accepted() -> None:
    seen: dict[str, Any] = {}

    def respond(body: dict[str, Any]) -> Any:
        req = parse(body).to_chat_request("req-1", default_max_tokens=16)
        builder = CompletionBuilder("chatcmpl-1", body["model"])
        for out in outputs(["Hel", "", "lo ", "wörld"]):
            builder.add(out)
        seen["request"] = req
        return http.Response(200, json=builder.build().model_dump())

    client = fake_client(respond, seen)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}
    resp = client.chat.completions.create(
        model="gemma-3", max_completion_tokens=5, temperature=0, top_p=0.9, seed=3, stop=["\n\n"], user="u1",
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}],
        extra_body={"top_k": 5, "mm_processor_kwargs": {"do_pan_and_scan": True}, "ignore_eos": True},
    )
    assert seen["path"] == "/v1/chat/completions"
    req = seen["request"]
    assert req.request_id == "req-1"
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]},
    ]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.ignore_eos) == (
        5, 0.0, 0.9, 5, 3, ("\n\n",), True)
    assert req.mm_processor_kwargs == {"do_pan_and_scan": True}
    assert resp.choices[0].message.content == "Hello wörld"
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.role == "assistant"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (7, 4, 11)
    assert resp.id == "chatcmpl-1" and resp.model == "gemma-3"


def test_official_client_streams_chunks_and_usage() -> None:
    seen: dict[str, Any] = {}

    def respond(body: dict[str, Any]) -> Any:
        req = parse(body)
        assert req.stream and req.include_usage
        builder = ChunkBuilder("chatcmpl-2", "gemma-3", include_usage=req.include_usage)
        events = [e for out in outputs(["A", "", "B", "C"], reason="length") for e in builder.events(out)]
        assert events[-1] == SSE_DONE
        return http.Response(200, headers={"content-type": "text/event-stream"}, content="".join(events).encode())

    client = fake_client(respond, seen)
    chunks = list(client.chat.completions.create(model="gemma-3", messages=USER, stream=True,
                                                 stream_options={"include_usage": True}))
    assert seen["body"]["stream"] is True
    assert [c.choices[0].delta.content for c in chunks[:-1]] == ["A", "B", "C"]  # the empty step sent nothing
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[1].choices[0].delta.role is None
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (7, 4)
    assert all(c.usage is None for c in chunks[:-1]) and {c.id for c in chunks} == {"chatcmpl-2"}


def test_official_client_raises_on_stream_error_event() -> None:
    def respond(body: dict[str, Any]) -> Any:
        builder = ChunkBuilder("c", "m")
        events = builder.events(outputs(["x", "y"])[0])
        try:
            builder.events(RequestFailed("r", MediaError("image could not be decoded")))
        except MediaError as exc:
            events.append(sse_error(exc))
        return http.Response(200, headers={"content-type": "text/event-stream"}, content="".join(events).encode())

    stream = fake_client(respond, {}).chat.completions.create(model="m", messages=USER, stream=True)
    with pytest.raises(openai.APIError, match="could not be decoded"):
        list(stream)


def test_official_client_lists_models_and_accepts_error_bodies() -> None:
    def respond(body: Any) -> Any:
        return http.Response(200, json=ModelList(data=[ModelCard(id="gemma-3", max_model_len=8192)]).model_dump())

    models = list(fake_client(respond, {}).models.list())
    assert [m.id for m in models] == ["gemma-3"] and models[0].owned_by == "mmserve"

    def reject(body: Any) -> Any:
        status, err = error_body(with_tools())
        return http.Response(status, json=err)

    with pytest.raises(openai.BadRequestError) as info:
        fake_client(reject, {}).chat.completions.create(model="m", messages=USER)
    assert info.value.code == "unsupported_parameter" and info.value.param == "tools"


def with_tools() -> Exception:
    try:
        parse({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}).to_chat_request("r", 16)
    except InvalidRequestError as exc:
        return exc
    raise AssertionError("tools were accepted")


def test_n_choices_within_bounds() -> None:
    assert parse({"messages": USER, "n": 4}).to_chat_request("r", 16).sampling.n == 4
    assert parse({"messages": USER}).to_chat_request("r", 16).sampling.n == 1
    for n in (0, -1, 17):
        with pytest.raises(InvalidSamplingError, match="n must be in") as info:
            parse({"messages": USER, "n": n}).to_chat_request("r", 16)
        assert error_body(info.value)[1]["error"]["param"] == "n"


# --- response models against the client's own types --------------------------------------------


def test_response_and_chunks_validate_as_openai_types() -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    builder = CompletionBuilder("id", "m", created=5)
    for out in outputs(["a", "b"], reason="length"):
        builder.add(out)
    full = ChatCompletion.model_validate(json.loads(builder.build().model_dump_json()))
    assert full.choices[0].message.content == "ab" and full.created == 5 and full.object == "chat.completion"

    stream = ChunkBuilder("id", "m", include_usage=True, created=5)
    raw = [c for out in outputs(["a", "b"]) for c in stream.chunks(out)]
    parsed = [ChatCompletionChunk.model_validate(json.loads(c.model_dump_json())) for c in raw]
    assert [p.object for p in parsed] == ["chat.completion.chunk"] * 3
    assert json.loads(raw[0].model_dump_json())["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert json.loads(raw[-1].model_dump_json())["choices"] == []


def test_a_chunk_carries_usage_only_where_it_was_asked_for() -> None:
    """OpenAI: `usage` is "only present when you set stream_options: {"include_usage": true}"; then it is null on
    every chunk but the last (test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk)."""
    plain = [json.loads(c.model_dump_json()) for out in outputs(["a", "b"]) for c in ChunkBuilder("i", "m").chunks(out)]
    assert plain and all("usage" not in c for c in plain)
    asked = ChunkBuilder("i", "m", include_usage=True, continuous_usage=True)
    assert all(json.loads(c.model_dump_json())["usage"]["prompt_tokens"] == 7
               for out in outputs(["a", "b"]) for c in asked.chunks(out))


@pytest.mark.parametrize("asked", [None, "", "gemma-3"])
def test_no_model_or_an_empty_one_is_the_served_one_as_vllm_takes_them(asked: str | None) -> None:
    check_model(asked, "gemma-3")
    with pytest.raises(ModelNotFoundError, match="'gemma-3 '"):
        check_model("gemma-3 ", "gemma-3")
    if asked == "":  # a lookup of no name (`GET /v1/models/`) finds none
        with pytest.raises(ModelNotFoundError):
            check_model(asked, "gemma-3", empty_is_any=False)


# --- request parsing: defaults, aliases, extensions --------------------------------------------


def test_defaults() -> None:
    req = parse({"messages": USER}).to_chat_request("r", default_max_tokens=64)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.ignore_eos) == (
        64, 1.0, 1.0, 0, None, (), False)
    assert req.mm_processor_kwargs == {} and req.messages == USER


@pytest.mark.parametrize(("stream", "final_only"), [(None, True), (False, True), (True, False)])
def test_only_a_non_streamed_request_reads_its_answer_whole(stream: bool | None, final_only: bool) -> None:
    fields = {} if stream is None else {"stream": stream}
    assert parse({"messages": USER, **fields}).to_chat_request("r", 16).sampling.final_only is final_only


@pytest.mark.parametrize(("fields", "expected"), [
    ({"max_tokens": 7}, 7),
    ({"max_completion_tokens": 9}, 9),
    ({"max_tokens": 7, "max_completion_tokens": 9}, 9),
])
def test_max_tokens_alias(fields: dict[str, int], expected: int) -> None:
    assert parse({"messages": USER, **fields}).to_chat_request("r", 16).sampling.max_tokens == expected


def test_stop_string_top_k_off_developer_role_and_bare_image_url() -> None:
    body = {"messages": [{"role": "developer", "content": "sys", "name": "dev"},
                         {"role": "user", "content": [{"type": "image_url", "image_url": "https://x/a.png"},
                                                      {"type": "image_url", "image_url": {"url": "https://x/b.png",
                                                                                          "detail": "original"}}]}],
            "stop": "END", "top_k": -1}
    req = parse(body).to_chat_request("r", 16)
    assert req.sampling.stop == ("END",) and req.sampling.top_k == 0
    assert req.messages == [{"role": "developer", "content": "sys"},  # served as "system" (chat_messages)
                            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}},
                                                         {"type": "image_url", "image_url": {"url": "https://x/b.png",
                                                                                             "detail": "original"}}]}]


def test_unknown_fields_and_default_valued_unsupported_fields_are_tolerated() -> None:
    body = {"messages": USER, "user": "u", "store": False, "metadata": {"a": "b"}, "n": 1, "logprobs": False,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "modalities": ["text"], "parallel_tool_calls": False,
            "some_future_field": {"x": 1}}
    assert parse(body).to_chat_request("r", 16).sampling.max_tokens == 16


def test_a_tool_list_with_tool_choice_none_is_served_as_text() -> None:
    """Agent frameworks send their tools whatever they ask: with "none" the model may call none (OpenAI and
    vLLM answer in text). Without it, OpenAI's default is "auto": refused."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert parse({"messages": USER, "tools": tools, "tool_choice": "none"}).to_chat_request("r", 16)
    assert parse({"messages": USER, "functions": [{"name": "f"}], "function_call": "none"}).to_chat_request("r", 16)
    with pytest.raises(UnsupportedParameterError, match="tools"):
        parse({"messages": USER, "tools": tools}).to_chat_request("r", 16)


def test_vllms_unserved_extensions_at_their_defaults_are_tolerated() -> None:
    body = {"messages": USER, "use_beam_search": False, "best_of": 1, "length_penalty": 1.0, "echo": False,
            "include_stop_str_in_output": False, "skip_special_tokens": True, "add_generation_prompt": True,
            "continue_final_message": False, "bad_words": [], "priority": 0, "prompt_logprobs": None,
            "chat_template": None, "logits_processors": None, "audio": None}
    assert parse(body).to_chat_request("r", 16).sampling.max_tokens == 16


def test_template_options_reach_the_engine_request() -> None:
    body = {"messages": USER, "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    assert parse(body).to_chat_request("r", 16).template == TemplateOptions(False, True, {"enable_thinking": False})
    assert parse({"messages": USER}).to_chat_request("r", 16).template == TemplateOptions()
    with pytest.raises(ValidationError, match="chat_template_kwargs"):
        parse({"messages": USER, "chat_template_kwargs": ["enable_thinking"]})


def test_allowed_token_ids_are_kept_once_each_in_the_order_given() -> None:
    chat = parse({"messages": USER, "allowed_token_ids": [5, 3, 5, 5, 3, 9]}).to_chat_request("r", 16)
    assert chat.sampling.allowed_token_ids == (5, 3, 9)


def test_unknown_fields_are_logged_once_per_name(caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unserved, "_logged", set())  # NOTE: the process's names so far: none, for this test
    body = {"messages": USER, "a_field_nobody_knows": 1, "another_unknown_one": "x", "use_beam_search": False,
            "line\nbreak" * 20: 0}
    with caplog.at_level(logging.WARNING, logger="mmserve.api.unserved"):
        parse(body).to_chat_request("r", 16)
        parse(body).to_chat_request("r", 16)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "'a_field_nobody_knows', 'another_unknown_one'" in logged[0]
    assert "\n" not in logged[0], "a client's name is logged as repr, cut short"
    assert "use_beam_search" not in logged[0], "a known field at its default is served as asked, not ignored"
    parse({"messages": USER, "x" * 1_000_000: 1}).to_chat_request("r", 16)
    assert max(map(len, unserved._logged)) == 64, "a long name is kept cut short, not whole"


@pytest.mark.parametrize(("field", "value"), [
    ("tool_choice", "auto"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("use_beam_search", True), ("best_of", 3), ("length_penalty", 0.8), ("truncate_prompt_tokens", 10),
    ("prompt_logprobs", 1),
    ("echo", True), ("add_special_tokens", True), ("chat_template", "{{ messages }}"),
    ("priority", 5), ("logits_processors", ["a.b"]), ("return_tokens_as_token_ids", True),
    ("kv_transfer_params", {"x": 1}), ("vllm_xargs", {"k": 1}),
    ("structural_tag", {"type": "structural_tag"}),
    ("web_search_options", {}),
    ("guided_whitespace_pattern", r"\s*"),
])
def test_unsupported_values_are_rejected_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(UnsupportedParameterError, match=field) as info:
        parse({"messages": USER, field: value}).to_chat_request("r", 16)
    status, body = error_body(info.value)
    assert status == 400
    assert body["error"]["param"] == field and body["error"]["code"] == "unsupported_parameter"
    assert body["error"]["type"] == "invalid_request_error"


def test_stream_options_need_stream() -> None:
    with pytest.raises(InvalidRequestError, match="stream_options") as info:
        parse({"messages": USER, "stream_options": {"include_usage": True}}).to_chat_request("r", 16)
    assert error_body(info.value)[1]["error"]["param"] == "stream_options"


def test_vllms_spellings_of_no_seed_and_no_top_logprobs_are_served_as_such() -> None:
    """seed -1 is vLLM's "no seed" (each request draws afresh), and top_logprobs 0 without logprobs asks
    nothing (some clients always send it): neither is a fixed seed nor a 400."""
    assert parse({"messages": USER, "seed": -1}).to_chat_request("r", 16).sampling.seed is None
    assert parse({"messages": USER, "seed": -2}).to_chat_request("r", 16).sampling.seed == -2
    assert parse({"messages": USER, "top_logprobs": 0}).to_chat_request("r", 16).sampling.logprobs is None
    with pytest.raises(InvalidRequestError, match="top_logprobs requires logprobs"):
        parse({"messages": USER, "top_logprobs": 2}).to_chat_request("r", 16)


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"seed": 2**64}, "seed"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    # digits str.isdigit takes and int() refuses (a 500 before), or reads as another id ("١٢" is 12)
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"), ({"logit_bias": {"--5": 1}}, "logit_bias"),
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"), ({"logit_bias": {"\u0661\u0662": 1}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"min_tokens": 5, "response_format": {"type": "json_object"}}, "min_tokens"),
    # read per token of every step: a list of millions slowed a replica's every step to seconds
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
])
def test_sampling_errors_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSamplingError) as info:
        parse({"messages": USER, **fields}).to_chat_request("r", 16)
    status, body = error_body(info.value)
    assert status == 400 and body["error"]["code"] == "invalid_sampling_params"
    assert body["error"]["param"] == param and param in body["error"]["message"]  # named as the request named it


@pytest.mark.parametrize(("body", "param", "says"), [
    ({}, "messages", "Field required"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "'system'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "Field required"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", "string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0]",
     "'text' or 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}]},
     "messages[0].content[0].image_url.url", "required"),
    ({"messages": USER, "stop": 3}, "stop", "string or a list of strings"),
    ({"messages": USER, "max_tokens": "many"}, "max_tokens", "valid integer"),
    ({"messages": USER, "stream": "sometimes"}, "stream", "valid boolean"),
    ({"messages": USER, "mm_processor_kwargs": [1]}, "mm_processor_kwargs", "valid dictionary"),
    # tools are not served: a history with calls is refused, not served without them
    ({"messages": [{"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "c1", "type": "function"}]},
                   *USER]}, "messages[0].tool_calls", "tool calls are not served"),
    ({"messages": [{"role": "assistant", "content": "Let me look.", "function_call": {"name": "f", "arguments": "{}"}},
                   *USER]}, "messages[0].function_call", "tool calls are not served"),
])
def test_validation_errors_are_readable_400s(body: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse(body)
    status, err = error_body(info.value)
    assert status == 400 and err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(f"{param}: ") and says in err["error"]["message"]


def test_invalid_json_and_several_errors() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json("{not json")
    status, err = error_body(info.value)
    assert status == 400 and "JSON" in err["error"]["message"]
    with pytest.raises(ValidationError) as info:
        parse({"messages": USER, "temperature": "hot", "top_p": "x"})
    assert "(and 1 more error)" in error_body(info.value)[1]["error"]["message"]


# --- error bodies ---------------------------------------------------------------------------------


def test_error_body_statuses_and_no_leak() -> None:
    assert error_body(MediaError("bad image"))[0] == 400
    assert error_body(MediaError("bad image"))[1] == {"error": {
        "message": "bad image", "type": "invalid_request_error", "code": "invalid_image", "param": None}}
    assert error_body(ModelNotFoundError("no model 'x'"))[0] == 404
    status, body = error_body(RuntimeError("CUDA OOM at /secret/path.py line 3"))
    assert status == 500 and "secret" not in json.dumps(body)
    assert body["error"]["type"] == "server_error"


def test_a_stage_errors_field_survives_the_trip_between_processes() -> None:
    """A stage names the offending field; the exception crosses processes pickled (Ray) and keeps it."""
    sent = InvalidSamplingError("stop_token_ids: token id 7 is out of range", param="stop_token_ids")
    received = pickle.loads(pickle.dumps(sent))
    assert type(received) is InvalidSamplingError and str(received) == str(sent)
    assert error_body(received)[1]["error"]["param"] == "stop_token_ids"


def test_the_frameworks_own_answers_take_openais_error_shape() -> None:
    assert route_error_body(405, "Method Not Allowed", "GET", "/v1/chat/completions") == {"error": {
        "message": "Method Not Allowed (GET /v1/chat/completions)", "type": "invalid_request_error",
        "code": "method_not_allowed", "param": None}}


def test_fastapi_style_locations() -> None:
    errors = [{"loc": ("body", "messages", 0, "role"), "msg": "Input should be 'user'", "type": "literal_error"}]
    status, body = validation_error_body(errors)
    assert status == 400 and body["error"]["param"] == "messages[0].role"
    assert body["error"]["message"] == "messages[0].role: Input should be 'user'"


# --- builders and framing -------------------------------------------------------------------------


def test_first_chunk_carries_role_even_without_text() -> None:
    builder = ChunkBuilder("c", "m")
    first = builder.chunks(RequestOutput("r", [1], "", False, None, 3, 1))
    assert json.loads(first[0].model_dump_json())["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert builder.chunks(RequestOutput("r", [2], "", False, None, 3, 2)) == []
    last = builder.chunks(RequestOutput("r", [3], "", True, "stop", 3, 3))
    assert json.loads(last[0].model_dump_json())["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop",
                                                                   "logprobs": None}  # as OpenAI sends it
    assert len(last) == 1  # no usage chunk unless asked
    assert builder.chunks(RequestOutput("r", [], "", True, "stop", 3, 3)) == []  # nothing after the end


def test_a_stop_reason_goes_on_the_finished_choice_only_as_vllm_sends_it() -> None:
    stream = ChunkBuilder("c", "m")
    stream.chunks(RequestOutput("r", [1], "a", False, None, 3, 1))
    [last] = stream.chunks(RequestOutput("r", [2], "", True, "stop", 3, 2, stop_reason="###"))
    assert json.loads(last.model_dump_json())["choices"][0]["stop_reason"] == "###"
    whole = CompletionBuilder("c", "m")
    whole.add(RequestOutput("r", [2], "a", True, "stop", 3, 1, stop_reason=7))
    assert json.loads(whole.build().model_dump_json())["choices"][0]["stop_reason"] == 7


def test_failures_are_reraised() -> None:
    with pytest.raises(MediaError):
        CompletionBuilder("c", "m").add(RequestFailed("r", MediaError("x")))
    with pytest.raises(RuntimeError, match="before its request finished"):
        builder = CompletionBuilder("c", "m")
        builder.add(outputs(["a", "b"])[0])
        builder.build()


def test_sse_framing() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    chunk = ChunkBuilder("c", "m").chunks(outputs(["line1\nline2"])[0])[0]
    event = sse(chunk)
    assert event.startswith("data: {") and event.endswith("}\n\n") and event.count("\n") == 2
    assert SSE_DONE == "data: [DONE]\n\n"


# --- logprobs ---------------------------------------------------------------------------------


def _with_logprobs(outs: list[RequestOutput]) -> list[RequestOutput]:
    """Each output's token with a log-prob and two alternatives, as the decoder makes them."""
    def one(i: int, token: int) -> TokenLogprob:
        return TokenLogprob(token, f"t{token}", -0.5 - i, f"t{token}".encode(),
                            ((token, f"t{token}", -0.5 - i, f"t{token}".encode()), (99, "ü", -3.0, "ü".encode())))
    return [replace(o, logprobs=[one(i, o.new_token_ids[0])]) for i, o in enumerate(outs)]


def test_logprobs_map_to_sampling_and_top_logprobs_needs_logprobs() -> None:
    def asked(**fields: Any) -> int | None:
        return parse({"messages": USER, **fields}).to_chat_request("r", 16).sampling.logprobs
    assert (asked(logprobs=True, top_logprobs=3), asked(logprobs=True), asked(logprobs=False)) == (3, 0, None)
    with pytest.raises(InvalidRequestError, match="requires logprobs") as info:
        parse({"messages": USER, "top_logprobs": 2}).to_chat_request("r", 16)
    assert error_body(info.value)[1]["error"]["param"] == "top_logprobs"


def test_official_client_reads_logprobs_in_a_response_and_in_chunks() -> None:
    outs = _with_logprobs(outputs(["A", "", "B"]))  # the second token's text is held back

    def complete(body: dict[str, Any]) -> Any:
        builder = CompletionBuilder("c", "gemma-3")
        for out in outs:
            builder.add(out)
        return http.Response(200, json=builder.build().model_dump())

    choice = fake_client(complete, {}).chat.completions.create(model="gemma-3", messages=USER, logprobs=True,
                                                                top_logprobs=2).choices[0]
    assert [t.token for t in choice.logprobs.content] == ["t0", "t1", "t2"]
    assert [t.logprob for t in choice.logprobs.content] == [-0.5, -1.5, -2.5]
    assert [a.token for a in choice.logprobs.content[0].top_logprobs] == ["t0", "ü"]
    assert choice.logprobs.content[0].top_logprobs[1].bytes == list("ü".encode())

    def stream(body: dict[str, Any]) -> Any:
        builder = ChunkBuilder("c", "gemma-3")
        events = "".join(e for out in outs for e in builder.events(out))
        return http.Response(200, headers={"content-type": "text/event-stream"}, content=events.encode())

    chunks = list(fake_client(stream, {}).chat.completions.create(model="gemma-3", messages=USER, stream=True,
                                                                   logprobs=True))
    # the held-back token's log-prob comes with the next chunk that is sent: none is lost, none doubled
    assert [[t.token for t in c.choices[0].logprobs.content] for c in chunks] == [["t0"], ["t1", "t2"]]
    outs = _with_logprobs(outputs(["", "AB"]))  # the first token's text held back: the role goes out alone
    chunks = list(fake_client(stream, {}).chat.completions.create(model="gemma-3", messages=USER, stream=True,
                                                                   logprobs=True))
    assert (chunks[0].choices[0].delta.content, chunks[0].choices[0].logprobs) == ("", None)
    assert [t.token for t in chunks[1].choices[0].logprobs.content] == ["t0", "t1"]


def test_without_logprobs_a_choice_says_null() -> None:
    builder = CompletionBuilder("c", "gemma-3")
    for out in outputs(["A"]):
        builder.add(out)
    assert builder.build().model_dump()["choices"][0]["logprobs"] is None


def test_penalties_and_biases_map_to_sampling() -> None:
    s = parse({"messages": USER, "presence_penalty": 0.5, "frequency_penalty": -0.25,
               "logit_bias": {"42": -100, "7": 3},
               "repetition_penalty": 1.1, "min_tokens": 2, "stop_token_ids": [9]}).to_chat_request("r", 16).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens) == (0.5, -0.25, 1.1, 2)
    assert s.logit_bias == ((42, -100.0), (7, 3.0)) and s.stop_token_ids == (9,) and s.adjusts_logits
    # one token's entries fold: ids named twice ("7" and "007") or repeated count once, up to the bound too
    folded = parse({"messages": USER, "logit_bias": {"7": 1, "007": 2, **{str(i): 0 for i in range(100, 1122)}},
                    "stop_token_ids": [5] * 2000 + [6]}).to_chat_request("r", 16).sampling
    assert folded.logit_bias[0] == (7, 2.0) and len(folded.logit_bias) == 1023 and folded.stop_token_ids == (5, 6)
    assert not parse({"messages": USER}).to_chat_request("r", 16).sampling.adjusts_logits


def test_a_stream_whose_later_choice_comes_first_still_opens_every_choice_in_order() -> None:
    """Choice 2's first output arrives before choice 0's and 1's (its encoder call finished first)."""
    outs = [replace(o, index=2) for o in outputs(["c"], reason="stop")] + \
        [replace(o, index=i) for i in (0, 1) for o in outputs(["a"], reason="stop")]
    chunks = ChunkBuilder("chatcmpl-n", "gemma-3", n=3)
    bodies = [json.loads(e[len("data: "):]) for out in outs for e in chunks.events(out) if e != SSE_DONE]
    seen = [b["choices"][0]["index"] for b in bodies]
    assert seen[:3] == [0, 1, 2] and all(b["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                                         for b in bodies[:3])
    assert [(b["choices"][0]["index"], b["choices"][0]["delta"].get("content")) for b in bodies[3:]] == \
        [(2, "c"), (0, "a"), (1, "a")]


def test_return_token_ids_gives_the_prompts_and_every_tokens_ids_only_when_asked() -> None:
    """vLLM's extension: the prompt's ids (on the first chunk) and each choice's; a held-back token's id goes
    with the next chunk sent, as its text does. A request that did not ask gets OpenAI's shape exactly."""
    assert parse({"messages": USER, "return_token_ids": True}).return_token_ids
    prompt = [2, 105, 7]
    outs = outputs(["A", "", "B"])  # token 1's text is held back
    whole = CompletionBuilder("c", "gemma-3", prompt_token_ids=prompt)
    for out in outs:
        whole.add(out)
    body = whole.build().model_dump()
    assert body["prompt_token_ids"] == prompt and body["choices"][0]["token_ids"] == [0, 1, 2]
    chunks = ChunkBuilder("c", "gemma-3", include_usage=True, prompt_token_ids=prompt)
    bodies = [json.loads(e[len("data: "):]) for out in outs for e in chunks.events(out) if e != SSE_DONE]
    assert [b.get("prompt_token_ids") for b in bodies] == [prompt, None, None]
    assert [b["choices"][0]["token_ids"] for b in bodies[:-1]] == [[0], [1, 2]] and bodies[-1]["choices"] == []
    late = ChunkBuilder("c", "gemma-3", prompt_token_ids=prompt)  # the first token's text held back
    bodies = [json.loads(e[len("data: "):]) for out in outputs(["", "AB"]) for e in late.events(out) if e != SSE_DONE]
    assert [(b["choices"][0]["delta"].get("content"), b["choices"][0].get("token_ids")) for b in bodies] == \
        [("", None), ("AB", [0, 1])] and bodies[0]["prompt_token_ids"] == prompt
    plain = CompletionBuilder("c", "gemma-3")
    for out in outs:
        plain.add(out)
    unasked = ChunkBuilder("c", "gemma-3")
    sent = [e for out in outs for e in unasked.events(out)]
    assert "token_ids" not in json.dumps(plain.build().model_dump()) and not any("token_ids" in e for e in sent)
    opening = ChunkBuilder("c", "gemma-3", n=2, prompt_token_ids=prompt)  # n > 1: each choice's role chunk first
    first = [json.loads(e[len("data: "):]) for e in opening.events(outs[0])]
    assert [b["choices"][0].get("token_ids") for b in first] == [None, None, [0]]
    assert [b.get("prompt_token_ids") for b in first] == [prompt, prompt, None]  # as vLLM: on each role chunk
    assert parse({"messages": USER, "return_token_ids": None}).return_token_ids is None  # vLLM's default


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk() -> None:
    """vLLM's stream option, with include_usage: each chunk carries the usage up to it; the usage chunk ends."""
    body = parse({"messages": USER, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert body.include_usage and body.continuous_usage
    assert not parse({"messages": USER, "stream": True, "stream_options": {"include_usage": True}}).continuous_usage
    chunks = ChunkBuilder("chatcmpl-u", "gemma-3", include_usage=True, continuous_usage=body.continuous_usage)
    bodies = [json.loads(e[len("data: "):]) for out in outputs(["a", "b", "c"]) for e in chunks.events(out)
              if e != SSE_DONE]
    assert [b["usage"]["completion_tokens"] for b in bodies] == [1, 2, 3, 3]
    assert all(b["usage"]["prompt_tokens"] == 7 for b in bodies) and bodies[-1]["choices"] == []
    plain = ChunkBuilder("chatcmpl-u", "gemma-3", include_usage=True)
    assert [json.loads(e[len("data: "):])["usage"] is None for out in outputs(["a", "b"])
            for e in plain.events(out) if e != SSE_DONE] == [True, True, False]


def test_n_choices_interleaved_build_one_response_and_one_stream() -> None:
    """Two choices' outputs arrive interleaved; usage counts the prompt once and every choice's tokens."""
    a = [replace(o, index=0) for o in outputs(["x", "y", "z"], reason="stop")]
    b = [replace(o, index=1, num_cached_tokens=4) for o in outputs(["p", "q"], reason="length")]
    mixed = [a[0], b[0], a[1], b[1], a[2]]
    builder = CompletionBuilder("chatcmpl-n", "gemma-3", n=2)
    for out in mixed:
        assert not builder.finished
        builder.add(out)
    assert builder.finished
    body = builder.build()
    assert [(c.index, c.message.content, c.finish_reason) for c in body.choices] == [(0, "xyz", "stop"),
                                                                                   (1, "pq", "length")]
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (7, 5, 12)
    # NOTE: the prompt's cached share is choice 0's (the later choices find its blocks, which is no cache hit)
    assert body.usage.prompt_tokens_details is not None and body.usage.prompt_tokens_details.cached_tokens == 0
    chunks = ChunkBuilder("chatcmpl-n", "gemma-3", n=2, include_usage=True)
    events = [e for out in mixed for e in chunks.events(out)]
    assert events.count(SSE_DONE) == 1 and events[-1] == SSE_DONE
    bodies = [json.loads(e[len("data: "):]) for e in events[:-1]]
    by_choice = {i: [b["choices"][0] for b in bodies if b["choices"] and b["choices"][0]["index"] == i] for i in (0, 1)}
    # NOTE: every choice's role first, in index order, before any content (vLLM's way; the openai client's
    # stream helper finds a choice by its position among those it has seen)
    assert [(b["choices"][0]["index"], b["choices"][0]["delta"]) for b in bodies[:2]] == \
        [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    assert all(c["delta"].get("role") is None for i in (0, 1) for c in by_choice[i][1:])
    assert "".join(c["delta"].get("content", "") for c in by_choice[0]) == "xyz"
    assert [c["finish_reason"] for c in by_choice[1]] == [None, None, "length"]
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 5  # after both finished
    assert bodies[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# --- the served model's sampling defaults -------------------------------------------------------

GEMMA = SamplingDefaults(top_k=64, top_p=0.95)  # gemma-3-4b-it's generation_config.json


def test_unset_sampling_fields_take_the_served_models_defaults() -> None:
    sampling = parse({"messages": USER}).to_chat_request("r", 16, GEMMA).sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty) == (1.0, 64, 0.95, 1.0)
    every = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1)
    sampling = parse({"messages": USER}).to_chat_request("r", 16, every).sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty) == (0.7, 20, 0.8, 1.1)


def test_a_requests_own_sampling_fields_win_over_the_defaults() -> None:
    body = {"messages": USER, "temperature": 0, "top_p": 1.0, "top_k": 5, "repetition_penalty": 1.0}
    sampling = parse(body).to_chat_request("r", 16, SamplingDefaults(0.7, 0.8, 20, 1.1)).sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty) == (0.0, 5, 1.0, 1.0)
    assert sampling.greedy


def test_allowed_token_ids_and_bad_words_travel_with_the_sampling() -> None:
    assert parse({"messages": USER}).to_chat_request("r", 16).sampling.allowed_token_ids is None
    assert parse({"messages": USER, "allowed_token_ids": [4, 2]}).to_chat_request("r", 16).sampling.allowed_token_ids \
        == (4, 2)
    assert parse({"messages": USER, "bad_words": ["no", "never"]}).to_chat_request("r", 16).sampling.bad_words == \
        ("no", "never")
    with pytest.raises(InvalidSamplingError, match="allowed_token_ids") as info:
        parse({"messages": USER, "allowed_token_ids": []}).to_chat_request("r", 16)
    assert error_body(info.value)[1]["error"]["param"] == "allowed_token_ids"


def test_vllms_text_options_travel_with_the_sampling() -> None:
    sampling = parse({"messages": USER}).to_chat_request("r", 16).sampling
    assert sampling.skip_special_tokens and not sampling.include_stop_str_in_output
    body = {"messages": USER, "skip_special_tokens": False, "include_stop_str_in_output": True}
    sampling = parse(body).to_chat_request("r", 16).sampling
    assert not sampling.skip_special_tokens and sampling.include_stop_str_in_output


def test_whether_the_client_set_max_tokens_travels_with_the_request() -> None:
    assert parse({"messages": USER}).to_chat_request("r", 16).max_tokens_asked is None
    assert parse({"messages": USER, "max_tokens": 4}).to_chat_request("r", 16).max_tokens_asked == "max_tokens"
    both = {"messages": USER, "max_tokens": 4, "max_completion_tokens": 5}  # the latter wins, as its value does
    assert parse(both).to_chat_request("r", 16).max_tokens_asked == "max_completion_tokens"


def test_min_p_from_the_request_else_the_defaults_else_off() -> None:
    def min_p(body: dict[str, Any], defaults: SamplingDefaults) -> float:
        return parse({"messages": USER, **body}).to_chat_request("r", 16, defaults).sampling.min_p

    assert min_p({"min_p": 0.1}, GEMMA) == 0.1
    assert min_p({}, SamplingDefaults(min_p=0.05)) == 0.05
    assert min_p({"min_p": 0}, SamplingDefaults(min_p=0.05)) == 0.0
    assert min_p({}, GEMMA) == 0.0


def test_top_k_minus_one_turns_the_default_top_k_off() -> None:
    assert parse({"messages": USER, "top_k": -1}).to_chat_request("r", 16, GEMMA).sampling.top_k == 0


def test_without_defaults_a_request_samples_as_openais_do() -> None:
    sampling = parse({"messages": USER}).to_chat_request("r", 16).sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty) == (1.0, 0, 1.0, 1.0)
