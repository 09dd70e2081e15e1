"""Ingress deployment: the OpenAI-compatible HTTP API (FastAPI on Serve).

Owns the HTTP edge only: parse and validate the body (mmserve.api.protocol), ask Preprocess for token
ids and FeatureSpecs, stream the Decoder's outputs back as JSON or server-sent events, map errors to
OpenAI-shaped 4xx/5xx, time each request, and serve the metrics of every stage. No tensor passes
through here: the ingress holds only small specs with ObjectRefs. Does not own the schemas, error bodies or
chunks (mmserve/api/), its failures' handling (ingress_failures.py) nor the retry policy (retry.py).
"""

# NOTE: no `from __future__ import annotations` here: FastAPI reads handler annotations at runtime.

import asyncio
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from ray.serve.exceptions import BackPressureError

from deployments import ingress_failures as failures
from deployments.app_health import AppHealth
from deployments.args import AppArgs
from deployments.handles import awaited, cancel, hold, shed
from deployments.metrics_hub import HUB_TIMEOUT_S, MetricsReporter
from deployments.model_lookup import ModelLookup
from deployments.replica_logs import route_logs
from deployments.retry import Kept, attempt_id, retrying, unwrapped
from mmserve.api import edge
from mmserve.api.body import validated
from mmserve.api.deadline import Deadline
from mmserve.api.openapi import with_request_body
from mmserve.api.protocol import ChatCompletionRequest, ModelCard, ModelList, check_model
from mmserve.api.server_timing import ServerTiming
from mmserve.api.stream import SSE_HEADERS, ChunkBuilder, CompletionBuilder, sse_error
from mmserve.messages import ChatRequest, PreprocessedRequest
from mmserve.runtime import affinity
from mmserve.runtime.ingress_metrics import IngressMetrics, RequestStatus, admission_snapshot
from mmserve.runtime.metrics import MetricsSnapshot, merge
from mmserve.runtime.prometheus import CONTENT_TYPE, render_prometheus

log = logging.getLogger("ray.serve")

# NOTE: no redirect of a path with a trailing slash: Starlette's 307 names the scheme it was reached by, http
# behind a TLS-terminating balancer, and a client following it drops its API key (or sends its prompt in clear)
api = FastAPI(title="mmserve", docs_url=None, redoc_url=None, redirect_slashes=False)
CHAT_ROUTE = "/v1/chat/completions"
CHAT_BOUND = "ingress.chat"  # the name of the edge's settings (bound, CORS, API keys) the replica's Ingress sets
edge.install(api, CHAT_BOUND, frozenset({CHAT_ROUTE}))
api.add_exception_handler(failures.StarletteHTTPException, failures.route_error)


def _openapi() -> dict[str, Any]:
    """FastAPI's document plus the chat body, which the handler parses itself (mmserve.api.openapi)."""
    if api.openapi_schema is None:
        document = get_openapi(title=api.title, version=api.version, routes=api.routes)
        api.openapi_schema = with_request_body(document, CHAT_ROUTE, "post", ChatCompletionRequest)
    return api.openapi_schema


api.openapi = _openapi  # type: ignore[method-assign]


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(self, app_args: AppArgs, preprocess: Any, decoder: Any, hub: Any):
        route_logs()
        # NOTE: asked of Preprocess on first use, not read here: reading a checkpoint's config imports torch and
        # transformers, whose start-up time and memory the edge would pay for nothing else (docs/benchmarks.md)
        self.max_body_bytes = app_args.ingress.max_body_bytes
        self.request_timeout_s = app_args.ingress.request_timeout_s
        self.stage_timing = app_args.ingress.stage_timing
        self.replica_loss_retries = app_args.replica_loss_retries
        self.preprocess, self.hub = hold(preprocess), hold(hub)
        # NOTE: options() builds a new handle (and its router): once here, not once per request
        self.decoder = hold(decoder).options(stream=True)
        self.lookup = ModelLookup(self.preprocess, self.replica_loss_retries)
        self.stats = IngressMetrics()
        self.app_health = AppHealth(may_idle=app_args.may_idle())
        self.reporter = MetricsReporter(hub, "Ingress", self._metrics, app_args.metrics_push_interval_s)
        self.reporter.ensure_started()
        self.chat_bound = edge.configure(
            CHAT_BOUND, limit=app_args.ingress.max_ongoing_requests, cors_origins=tuple(
                app_args.ingress.cors_allowed_origins), environ=os.environ, logger=log,
            on_refused=lambda: self._done("overloaded", time.perf_counter()))  # as other 503s are counted

    async def __del__(self) -> None:
        """Serve calls this on a graceful shutdown (a downscale): the last metrics (see MetricsReporter.close)."""
        if (reporter := getattr(self, "reporter", None)) is not None:  # None: __init__ failed
            await reporter.close()

    # NOTE: HEAD beside GET on the probes' routes (uptime monitors probe with HEAD; FastAPI adds it to no route),
    # kept out of the API's document. As routes of their own (one route of both would give the document two
    # operations of one id); GET's is registered first (the inner decorator), so a 405 on these paths lists GET
    @api.head("/health", include_in_schema=False)
    @api.get("/health")
    async def health(self) -> Response:
        """200 once every deployment of the app has a running replica; 503 naming those that have none, and why.

        NOTE: Serve routes HTTP to the ingress as soon as its own replica runs, while the model stages may
        still be loading (seconds): a probe that only reached the ingress said "ok" while the first
        request waited for them.
        """
        status, body = await self.app_health.answer()
        return JSONResponse(body, status_code=status)

    @api.head("/v1/models", include_in_schema=False)
    @api.get("/v1/models")
    async def models(self) -> Response:
        try:
            served = await self.lookup.get()
        except Exception as exc:
            return failures.error_response(exc)
        return JSONResponse(ModelList(data=[ModelCard(id=served.model_id, max_model_len=served.max_model_len)])
                            .model_dump())

    @api.head("/v1/models/{model:path}", include_in_schema=False)
    @api.get("/v1/models/{model:path}")  # NOTE: a path: model ids hold slashes (google/gemma-3-4b-it)
    async def model(self, model: str) -> Response:
        try:
            served = await self.lookup.get()
            if not model:  # NOTE: `/v1/models/`, the list's path with a slash: the list
                return await self.models()
            check_model(model, served.model_id, empty_is_any=False)
        except Exception as exc:
            return failures.error_response(exc)
        return JSONResponse(ModelCard(id=served.model_id, max_model_len=served.max_model_len).model_dump())

    def _model_id(self) -> str:
        """The served name, once a request has fetched it (every answer comes after its request did)."""
        assert self.lookup.served is not None
        return self.lookup.served.model_id

    def _metrics(self) -> MetricsSnapshot:
        """What this replica pushes: its requests, its bound's use, and its Decoder router's decisions."""
        return merge([self.stats.snapshot(), admission_snapshot(self.chat_bound.in_flight, self.chat_bound.limit),
                      affinity.DECISIONS.snapshot()])

    @api.get("/metrics")
    async def metrics(self) -> Response:
        try:
            await self.reporter.push()  # NOTE: this replica's latest counts in the answer
        except Exception as exc:
            log.warning("pushing this replica's metrics before a scrape failed: %r", exc)
        try:
            merged = await asyncio.wait_for(awaited(self.hub.collect.remote()), HUB_TIMEOUT_S)
        except Exception as exc:
            return PlainTextResponse(f"the metrics hub did not answer: {exc!r}", status_code=503)
        return Response(render_prometheus(merged), media_type=CONTENT_TYPE)

    @api.post(CHAT_ROUTE)
    async def chat(self, request: Request) -> Response:
        started = time.perf_counter()
        deadline = Deadline(self.request_timeout_s)
        self.reporter.ensure_started()
        timing = ServerTiming(self.stage_timing)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"  # the response's id: the logs name the request by it
        try:
            raw = await failures.read_body(request, self.max_body_bytes, deadline)  # a slow drip too
            body = await deadline.wait(validated(raw, ChatCompletionRequest))
            served = await deadline.wait(self.lookup.get(timeout_s=None))
            check_model(body.model, served.model_id)
            make = functools.partial(body.to_chat_request, request_id, served.max_model_len, served.sampling_defaults)
            # NOTE: a constraint is compiled here (seconds, for some): off the loop that serves every other request
            chat = await deadline.wait(asyncio.to_thread(make)) if body.constrained else make()
            timing.mark("parse")
            if body.stream:
                kept: Kept[PreprocessedRequest] = Kept()
                first, outputs, pre = await retrying(
                    lambda attempt: self._first(chat, attempt, deadline, timing, kept, count_retry=True),
                    retries=self.replica_loss_retries, what=f"request {chat.request_id}")
        except asyncio.CancelledError:  # NOTE: Serve cancels the handler of a client that left
            self._done("aborted", started)
            raise
        except failures.ClientGone:
            self._done("aborted", started)
            return Response(status_code=failures.CLIENT_CLOSED_REQUEST)  # NOTE: nobody reads it
        except Exception as exc:
            self._done(failures.failure_status(exc), started)
            return failures.error_response(exc, request_id)
        if not body.stream:
            return await self._complete(chat, started, deadline, timing, bool(body.return_token_ids))
        self.stats.observe_ttft(first_s := time.perf_counter() - started)
        return failures.GuardedStream(
            lambda start: self._sse(ChunkBuilder(chat.request_id, self._model_id(), n=chat.sampling.n,
                                                 include_usage=body.include_usage,
                                                 continuous_usage=body.continuous_usage,
                                                 prompt_token_ids=pre.prompt_token_ids if body.return_token_ids
                                                 else None),
                                    first, outputs, (started, first_s), deadline, start),
            unstarted=lambda: self._abandoned(outputs, started), media_type="text/event-stream",
            headers={**timing.header(), **SSE_HEADERS})

    async def _first(self, chat: ChatRequest, attempt: int, deadline: Deadline, timing: ServerTiming,
                     kept: Kept[PreprocessedRequest], *, count_retry: bool) -> tuple[Any, Any, PreprocessedRequest]:
        """Preprocess (unless the last attempt `kept` its answer), then the Decoder's stream up to its first
        output: (that output, the stream, the preprocessed request).

        NOTE: idempotent (nothing has reached the client yet), so a replica lost on the way is retried;
        each retry under a request id of its own downstream (the client still sees `chat.request_id`).
        """
        chat = replace(chat, request_id=attempt_id(chat.request_id, attempt))
        reused = kept.take()
        if attempt:
            timing.mark("retry")
            if count_retry:  # NOTE: `_complete` counts its own (an attempt of it may be past its first output)
                self.stats.observe_retry(after_first_output=False, reused=reused is not None)
        pre = await self._preprocessed(chat, deadline) if reused is None else reused
        kept.made(pre)
        timing.mark("preprocess")
        outputs = self.decoder.generate.remote(pre.for_attempt(chat.request_id, kept=reused is not None))
        try:  # errors before the first token get a 4xx/5xx status
            first = failures.raise_failed(await self._within(deadline, outputs.__anext__()))
        except BaseException as exc:
            cancel(outputs)  # e.g. the deadline: the decoder drops the request and frees its KV blocks
            kept.lost_after(exc)
            raise
        timing.mark("first")
        timing.add(first.timings)
        return first, outputs, pre

    async def _preprocessed(self, chat: ChatRequest, deadline: Deadline) -> PreprocessedRequest:
        preprocessing = self.preprocess.process.remote(chat)
        try:
            answer = await self._within(deadline, preprocessing)
        except BaseException:
            cancel(preprocessing)  # e.g. the deadline: the Preprocess replica stops at the request's next image
            raise
        pre: PreprocessedRequest = failures.raise_failed(answer)
        return pre

    async def _within(self, deadline: Deadline, awaitable: Any) -> Any:
        """`await awaitable` by the request's deadline; Serve's BackPressureError (a stage's queue is full)
        as an OverloadedError."""
        try:
            return await deadline.wait(awaitable)
        except BackPressureError as exc:
            raise shed(exc) from None

    async def _next(self, outputs: Any, deadline: Deadline) -> Any | None:
        """The Decoder stream's next message, or None at its end."""
        try:
            return await self._within(deadline, outputs.__anext__())
        except StopAsyncIteration:
            return None

    async def _complete(self, chat: ChatRequest, started: float, deadline: Deadline, timing: ServerTiming,
                        token_ids: bool) -> Response:
        """A non-streamed request's whole answer (with the prompt's and each choice's token ids if `token_ids`).

        NOTE: the client reads nothing before the end, so the whole request is idempotent: a replica lost
        at any point, a Decoder mid-decode too, is retried (the answer is then the retry's, made from scratch
        or, when only its Decoder was lost, from the lost attempt's preprocessed request).
        """
        builders: dict[int, CompletionBuilder] = {}  # attempt number -> its builder, for those that got an output
        firsts: list[float] = []  # when each attempt's first output came (s after arrival)
        kept: Kept[PreprocessedRequest] = Kept()  # the preprocessed request, kept when the Decoder alone was lost

        async def attempt(number: int) -> CompletionBuilder:
            if number:
                self.stats.observe_retry(after_first_output=number - 1 in builders, reused=kept.ready)
            first, outputs, pre = await self._first(chat, number, deadline, timing, kept, count_retry=False)
            firsts.append(time.perf_counter() - started)  # NOTE: the answered attempt's is the last
            if len(firsts) == 1:
                self.stats.observe_ttft(firsts[0])
            builders[number] = builder = CompletionBuilder(
                chat.request_id, self._model_id(), n=chat.sampling.n,
                prompt_token_ids=pre.prompt_token_ids if token_ids else None)
            try:
                builder.add(first)
                while not builder.finished and (message := await self._next(outputs, deadline)) is not None:
                    builder.add(message)
                if not builder.finished:
                    raise RuntimeError(f"the decoder's stream of {chat.request_id} ended before its answer")
            except BaseException as exc:
                kept.lost_after(exc)
                raise
            finally:
                if not builder.finished:  # it failed, or this handler was cancelled: abort it in the decoder
                    cancel(outputs)
            return builder

        def tokens() -> tuple[int, int]:  # a failed request's: its last attempt that got an output
            return next(reversed(builders.values())).choices.tokens if builders else (0, 0)

        try:
            builder = await retrying(attempt, retries=self.replica_loss_retries, what=f"request {chat.request_id}")

            def render() -> JSONResponse:
                return JSONResponse(builder.build().model_dump(), headers=timing.header())

            # NOTE: an answer with log-probs is built off the event loop: up to 21 entries a token to build and
            # encode, so a long one would hold every other request of this replica meanwhile
            answer = render() if chat.sampling.logprobs is None else await asyncio.to_thread(render)
        except asyncio.CancelledError:  # the client left: counted as a stream that loses its client is
            self._done("aborted", started, tokens())
            raise
        except Exception as exc:
            self._done(failures.failure_status(exc), started, tokens())
            return failures.error_response(exc, chat.request_id)
        self._done("ok", started, builder.choices.tokens, firsts[-1], chat.sampling.n)
        return answer

    def _abandoned(self, outputs: Any, started: float) -> None:
        """A stream whose client left before its first event: abort it in the decoder, count it."""
        cancel(outputs)
        self._done("aborted", started)

    async def _sse(self, chunks: ChunkBuilder, first: Any, outputs: Any, times: tuple[float, float],
                   deadline: Deadline, start: Callable[[], None]) -> AsyncIterator[str]:
        """The stream's events; `times`: (its arrival, perf_counter s; its first output, s after it)."""
        started, first_s = times
        start()  # NOTE: from here on this generator's `finally` cleans up (see GuardedStream)
        status: RequestStatus = "aborted"  # the client left mid-stream unless we get to the end
        try:
            # NOTE: a message's events (a last delta, usage, [DONE]) go as one body part: each part is a
            # socket write behind HAProxy, and with Serve's proxy an item streamed to it, with its own cost
            if events := chunks.events(first):
                yield "".join(events)
            while not chunks.finished and (message := await self._next(outputs, deadline)) is not None:
                if events := chunks.events(message):
                    yield "".join(events)
            if not chunks.finished:  # NOTE: as the non-streamed path: a stream cut short is an error, not an end
                raise RuntimeError(f"the decoder's stream of {chunks.response_id} ended before its answer")
            status = "ok"
        except Exception as exc:  # headers are sent: report in-band, as OpenAI does
            status = failures.failure_status(exc)
            failures.log_fault(exc, chunks.response_id)
            yield sse_error(unwrapped(exc))
        finally:
            if not chunks.finished:  # the client left, or the deadline: abort it in the decoder, free its KV
                cancel(outputs)
            self._done(status, started, chunks.choices.tokens, first_s, chunks.choices.n)

    def _done(self, status: RequestStatus, started: float, tokens: tuple[int, int] = (0, 0),
              first_s: float | None = None, choices: int = 1) -> None:
        """Count a finished request with its (prompt, output) tokens and its first output's time (s)."""
        self.stats.observe_request(status, time.perf_counter() - started, *tokens, first_s, choices)


