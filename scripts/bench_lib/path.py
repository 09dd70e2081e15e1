"""Where a request's time goes between the client and the engine: one client, the tiny model, one run.

Owns: the probes (a text request, a new image, the same image again; a 64-token stream for the cost per
token), timing them against the in-process Engine and through HTTP and the deployments, reading the
phases the stages report (the ingress's `Server-Timing` header, the Engine's first output), and Serve's
own floor from the no-op app (noop_app.py). Does not own starting Ray or printing.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from mmserve.engine import Engine
from mmserve.messages import ChatRequest, SamplingParams

STREAM_TOKENS = 64  # tokens of the per-token probe


def image_url(seed: int, size: tuple[int, int] = (640, 480)) -> str:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(size)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(text: str, url: str | None) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}] if url else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@dataclass
class Timed:
    ttft_ms: float  # request sent -> first output (ms)
    per_token_ms: float | None  # first output -> last, per token after the first (ms)
    phases: dict[str, float] = field(default_factory=dict)  # the stages' phases and the ingress's round trips (ms)


class Client:
    """One keep-alive HTTP connection, as a client making requests one after another would keep."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def stream(self, path: str, body: dict[str, Any]) -> tuple[float, list[tuple[float, str]], dict[str, str]]:
        """(start, [(arrival, data)] of each SSE event, headers)."""
        payload = json.dumps(body).encode()
        start = time.perf_counter()
        self.conn.request("POST", path, payload, {"content-type": "application/json"})
        response = self.conn.getresponse()
        events = []
        while True:
            line = response.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                events.append((time.perf_counter(), data))
                if data == "[DONE]":
                    break
        response.read()
        if response.status != 200:
            raise RuntimeError(f"{path}: HTTP {response.status}")
        return start, events, dict(response.getheaders())

    def get(self, path: str) -> float:
        start = time.perf_counter()
        self.conn.request("GET", path)
        self.conn.getresponse().read()
        return (time.perf_counter() - start) * 1e3

    def post(self, path: str, body: dict[str, Any]) -> float:
        start = time.perf_counter()
        self.conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
        self.conn.getresponse().read()
        return (time.perf_counter() - start) * 1e3


def chat_body(msgs: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """The streamed, greedy chat request `served` sends."""
    return {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def served(client: Client, msgs: list[dict[str, Any]], max_tokens: int) -> Timed:
    start, events, headers = client.stream("/v1/chat/completions", chat_body(msgs, max_tokens))
    chunks = [(t, json.loads(d)) for t, d in events if d != "[DONE]"]
    content = [t for t, c in chunks if c["choices"] and c["choices"][0]["delta"].get("content") is not None]
    # NOTE: up to the chunk that finishes the choice, as the in-process side's last output: a last token whose
    # text is empty (or held back) sends that chunk without content, and the span would end a token early
    end = next((t for t, c in chunks if c["choices"] and c["choices"][0].get("finish_reason")), content[-1])
    tokens = next((c["usage"]["completion_tokens"] for _, c in chunks if c.get("usage")), max_tokens)
    per_token = (end - content[0]) * 1e3 / (tokens - 1) if tokens > 1 and len(content) > 1 else None
    pairs = [item.strip().split(";dur=") for item in headers.get("Server-Timing", headers.get("server-timing", ""))
             .split(",") if ";dur=" in item]
    phases = summed((name, float(dur)) for name, dur in pairs)
    return Timed((content[0] - start) * 1e3, per_token, phases)  # the ingress's round trips, the stages' phases


def in_process(engine: Engine, msgs: list[dict[str, Any]], max_tokens: int) -> Timed:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def run() -> Timed:
        start = time.perf_counter()
        stamps, tokens = [], 0
        phases: dict[str, float] = {}
        async for out in engine.stream(ChatRequest(f"probe-{time.monotonic_ns()}", msgs, sampling)):
            stamps.append(time.perf_counter())
            tokens = out.num_output_tokens
            phases = phases or summed(out.timings)  # the stages' phases, on the first output
        per_token = (stamps[-1] - stamps[0]) * 1e3 / (tokens - 1) if tokens > 1 and len(stamps) > 1 else None
        return Timed((stamps[0] - start) * 1e3, per_token, phases)

    return asyncio.run(run())


def summed(pairs: Iterable[tuple[str, float]]) -> dict[str, float]:
    """(phase, ms) pairs as a dict; NOTE: a phase marked once per image is summed over the images."""
    out: dict[str, float] = {}
    for name, ms in pairs:
        out[name] = out.get(name, 0.0) + ms
    return out


@dataclass
class ServeFloor:
    """Serve's own cost, sampled from the no-op app: a sample at a time, so that a run can take them between
    its own probes and the machine's drift falls on both alike."""

    ping: list[float] = field(default_factory=list)  # proxy -> ingress and back (ms)
    hop: list[float] = field(default_factory=list)  # the same plus one handle hop (ms)
    first: list[float] = field(default_factory=list)  # the same plus a streamed hop, to its first item (ms)
    per_item: list[float] = field(default_factory=list)  # each further streamed item (ms)
    # the path (proxy, ingress reading the JSON body, a hop carrying it, a streamed hop's first item) with
    # a request's own body, by the name of the request it copies (ms)
    with_body: dict[str, list[float]] = field(default_factory=dict)

    def sample(self, client: Client, bodies: Mapping[str, dict[str, Any]] | None = None) -> None:
        """One sample of each: the small-body hops, and the path with each of `bodies` (name -> body)."""
        self.ping.append(client.get("/noop/ping"))
        self.hop.append(client.post("/noop/hop", {"x": 1}))
        start, events, _ = client.stream("/noop/chat?n=33", {"x": 1})
        items = [t for t, d in events if d != "[DONE]"]
        self.first.append((items[0] - start) * 1e3)
        self.per_item.append((items[-1] - items[0]) * 1e3 / (len(items) - 1))
        for name, body in (bodies or {}).items():
            start, events, _ = client.stream("/noop/chat?n=1", body)
            self.with_body.setdefault(name, []).append((events[0][0] - start) * 1e3)

    def summary(self) -> dict[str, Any]:
        """Medians (ms): the proxy to the ingress, one handle hop, a streamed hop's first item, each further
        streamed item, the text path (proxy, hop, streamed hop) with a small body, and that path with each
        sampled request's own body."""
        m = statistics.median
        return {"proxy_to_ingress": m(self.ping), "handle_hop": m(self.hop) - m(self.ping),
                "streamed_hop_first": m(self.first) - m(self.hop), "streamed_item": m(self.per_item),
                "text_path": m(self.first), "path_with_body": {k: m(v) for k, v in self.with_body.items()}}
