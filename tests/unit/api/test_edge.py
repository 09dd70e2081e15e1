"""The edge's middleware as a client meets it: API keys asked of `/v1` only (the official client's key
accepted, a wrong or missing one a 401 it reads as an AuthenticationError), CORS before the key and the key
before the admission bound, and each process's settings."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from mmserve.api import edge
from mmserve.api.admission import AdmissionMiddleware
from mmserve.api.api_keys import ApiKeyMiddleware, ApiKeys, parse_keys
from mmserve.api.cross_origin import CrossOriginMiddleware

# NOTE: the HTTP library the installed client is built on (httpx, or httpx2 in recent releases)
http = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])
_names = itertools.count()


def app_with_edge(keys: str | None, origins: tuple[str, ...] = (), limit: int = 8) -> tuple[FastAPI, list[str]]:
    """A FastAPI app with the edge installed under a fresh name -> (app, the paths its handlers ran for)."""
    name, ran = f"edge-test-{next(_names)}", []
    app = FastAPI()
    edge.install(app, name, frozenset({"/v1/chat/completions"}))
    edge.configure(name, limit=limit, on_refused=lambda: None, cors_origins=origins,
                   environ={} if keys is None else {"MMSERVE_API_KEY": keys})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        ran.append("/v1/models")
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                         "owned_by": "mmserve"}]})

    @app.get("/health")
    async def health() -> JSONResponse:
        ran.append("/health")
        return JSONResponse({"status": "ok"})

    return app, ran


def served(app: FastAPI, ask: Any) -> Any:
    """`await ask(http client)` against `app` in process."""
    async def call() -> Any:
        async with http.AsyncClient(transport=http.ASGITransport(app=app), base_url="http://edge") as client:
            return await ask(client)

    return asyncio.run(call())


def models_with(app: FastAPI, key: str) -> Any:
    return served(app, lambda client: openai.AsyncOpenAI(
        base_url="http://edge/v1", api_key=key, http_client=client, max_retries=0).models.list())


def test_the_official_clients_key_is_accepted_and_a_wrong_one_is_an_authentication_error():
    app, ran = app_with_edge("old-key, new-key")
    assert [m.id for m in models_with(app, "new-key").data] == ["m"]
    assert [m.id for m in models_with(app, "old-key").data] == ["m"]
    with pytest.raises(openai.AuthenticationError) as refused:
        models_with(app, "new-ke")
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert refused.value.response.headers["www-authenticate"] == "Bearer"
    assert ran == ["/v1/models", "/v1/models"]  # the refused one never reached its handler


def test_without_keys_every_request_is_served_and_health_never_asks_for_one():
    app, _ = app_with_edge(None)
    assert [m.id for m in models_with(app, "anything").data] == ["m"]
    keyed, ran = app_with_edge("k")
    assert served(keyed, lambda client: client.get("/health")).status_code == 200 and ran == ["/health"]


def test_a_path_under_a_prefix_that_only_begins_like_it_is_still_asked_for_a_key():
    app, ran = app_with_edge("k")
    for root, path in (("/v", "/v1/models"), ("", "/v1/models"), ("/api", "/api/v1/models")):
        async def ask(client: Any, root: str = root, path: str = path) -> Any:
            return await client.request("GET", path, extensions={})
        scope_app = _with_root(app, root)
        assert served(scope_app, ask).status_code == 401, (root, path)
    assert ran == []


def _with_root(app: Any, root: str) -> Any:
    """`app` mounted under `root` as Serve's route prefix sets it (`root_path`)."""
    async def mounted(scope: Any, receive: Any, send: Any) -> None:
        await app({**scope, "root_path": root}, receive, send)
    return mounted


@pytest.mark.parametrize(("header", "admitted"), [
    (None, False), (b"Bearer k1", True), (b"bearer  k1 ", True), (b"Basic k1", False), (b"Bearer", False),
    (b"Bearer k", False), (b"Bearer k1k1", False), (b"Bearer k2", True)])
def test_a_key_is_read_from_a_bearer_header_only(header: bytes | None, admitted: bool):
    assert ApiKeys(parse_keys("k1,,  k2 ")).admits(header) is admitted
    assert ApiKeys().admits(header)  # no keys: everyone


def test_cors_answers_a_preflight_before_the_key_is_asked_and_the_key_before_the_bound_counts(caplog):
    app, _ = app_with_edge("k", origins=("https://chat.example",), limit=1)
    assert [m.cls for m in app.user_middleware] == [CrossOriginMiddleware, ApiKeyMiddleware, AdmissionMiddleware]
    answer = served(app, lambda client: client.options("/v1/chat/completions", headers={
        "Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"}))
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://chat.example"
    with caplog.at_level(logging.INFO, logger="mmserve.api.edge"):
        app_with_edge("a,b")
    assert "need one of 2 API keys (MMSERVE_API_KEY)" in caplog.text and "a,b" not in caplog.text
    told = logging.getLogger("a-replicas-own")
    with caplog.at_level(logging.INFO, logger=told.name):
        edge.configure("edge-told", limit=1, on_refused=lambda: None, cors_origins=(), environ={}, logger=told)
    assert [r.name for r in caplog.records if "need no API key" in r.message] == [told.name]
