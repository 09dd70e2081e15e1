"""Ray Serve's own floor: a no-op app shaped like mmserve's path (proxy -> FastAPI ingress -> a handle hop
-> a streamed hop), so that the cost of Serve itself is measured beside ours in the same run.

Owns nothing of mmserve: `/noop/ping` is the proxy to the ingress alone, `/noop/hop` adds one handle call,
`/noop/chat?n=N` adds a streamed call of N items sent on as server-sent events, each hop holding its
handle as mmserve's replicas do (built once, calls by reference).
"""

# NOTE: no `from __future__ import annotations`: FastAPI reads handler annotations at runtime.

import typing
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from deployments.handles import hold

api = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class NoopHop:
    async def process(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"keys": len(body)}  # NOTE: a small answer, as Preprocess's is, whatever the body carried


@serve.deployment(ray_actor_options={"num_cpus": 0})
class NoopStream:
    async def generate(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class NoopIngress:
    def __init__(self, hop: Any, stream: Any) -> None:
        self.hop, self.stream = hold(hop), hold(stream).options(stream=True)

    @api.get("/ping")
    async def ping(self) -> JSONResponse:
        return JSONResponse({})

    @api.post("/hop")
    async def one_hop(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.hop.process.remote(await request.json()))

    @api.post("/chat")
    async def chat(self, request: Request, n: int = 1) -> StreamingResponse:
        await self.hop.process.remote(await request.json())
        items = self.stream.generate.remote(n)
        first = await items.__anext__()

        async def events() -> AsyncIterator[str]:
            yield f"data: {first}\n\n"
            async for item in items:
                yield f"data: {item}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def noop_app() -> Any:
    # NOTE: `@serve.deployment` makes each class a Deployment, but mypy still sees the class
    ingress, hop, stream = typing.cast(Any, NoopIngress), typing.cast(Any, NoopHop), typing.cast(Any, NoopStream)
    return ingress.bind(hop.bind(), stream.bind())
