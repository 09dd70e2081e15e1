"""The load generator: closed-loop clients on the official async `openai` client, one cell at a time.

Owns: sending a cell's requests at a fixed concurrency (each of `concurrency` workers sends its next
request as soon as its previous one ends), timing each one from the client's side (time to the first
content chunk, end to end, output tokens from the usage of the last chunk), and the progress bar.
Does not own what the body of a request holds (systems.py) nor the statistics (stats.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from openai import AsyncOpenAI
from tqdm import tqdm

from bench_lib.workloads import BenchRequest


@dataclass
class RequestResult:
    key: str
    ok: bool
    start_s: float  # sent, seconds after the cell started
    ttft_s: float | None  # sent -> first chunk with content
    e2e_s: float | None  # sent -> last chunk
    output_tokens: int  # from usage (or counted chunks when a server sends none)
    prompt_tokens: int | None
    error: str | None = None


@dataclass
class CellRun:
    results: list[RequestResult]
    wall_s: float  # first send -> last end
    epoch0: float = 0.0  # time.time() when the cell started (to align with server logs)


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=900.0)


async def one_request(api: AsyncOpenAI, model: str, req: BenchRequest, kwargs: dict[str, Any],
                      cell_t0: float) -> RequestResult:
    sent = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    try:
        stream = await api.chat.completions.create(model=model, stream=True, **kwargs)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                if first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
    except Exception as exc:  # a failed request is counted, never fatal
        return RequestResult(req.key, False, sent - cell_t0, None, None, 0, None, f"{type(exc).__name__}: {exc}"[:300])
    out_tokens = usage.completion_tokens if usage is not None else chunks
    return RequestResult(req.key, True, sent - cell_t0, (first or end) - sent, end - sent, out_tokens,
                         usage.prompt_tokens if usage is not None else None)


Send = Callable[[BenchRequest, float], Awaitable[RequestResult]]  # (request, cell start) -> its result


def complete(result: RequestResult, req: BenchRequest) -> RequestResult:
    """`result`, failed unless it has every token asked for: each system is asked for `max_tokens` greedy
    tokens with the end ignored, so a stream that stopped short is a failure, not a fast request."""
    if result.ok and result.output_tokens != req.max_tokens:
        return replace(result, ok=False, error=f"{result.output_tokens} output tokens of {req.max_tokens} asked")
    return result


def http_sender(base_url: str, model: str, requests: list[BenchRequest],
                make_kwargs: Callable[[BenchRequest], dict[str, Any]]) -> Send:
    """A `Send` over HTTP; every body (images base64-encoded) is built now, before any clock starts.

    NOTE: one client per event loop: an AsyncOpenAI's connection pool belongs to the loop it first ran
    on, and each cell runs in its own `asyncio.run`; a pooled connection from a closed loop fails.
    """
    bodies = {req.key: make_kwargs(req) for req in requests}
    current: dict[str, Any] = {}

    async def send(req: BenchRequest, t0: float) -> RequestResult:
        loop = asyncio.get_running_loop()
        if current.get("loop") is not loop:
            current.update(loop=loop, api=client(base_url))
        return await one_request(current["api"], model, req, bodies[req.key], t0)

    async def aclose() -> None:  # called by run_cell at the end of its loop
        api = current.pop("api", None)
        current.pop("loop", None)
        if api is not None:
            await api.close()

    send.aclose = aclose  # type: ignore[attr-defined]
    return send


async def run_cell(requests: list[BenchRequest], concurrency: int, send: Send, desc: str) -> CellRun:
    """Send `requests` in order through `concurrency` closed-loop workers."""
    queue: asyncio.Queue = asyncio.Queue()
    for req in requests:
        queue.put_nowait(req)
    results: list[RequestResult] = []
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False, dynamic_ncols=True)
    epoch0, t0 = time.time(), time.perf_counter()

    async def worker() -> None:
        while not queue.empty():
            req = queue.get_nowait()
            results.append(complete(await send(req, t0), req))
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    close = getattr(send, "aclose", None)
    if close is not None:
        await close()
    bar.close()
    return CellRun(sorted(results, key=lambda r: r.start_s), wall, epoch0)
