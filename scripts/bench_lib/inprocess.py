"""The in-process systems: transformers' own `generate` (the baseline a user scripts by hand) and
mmserve's `Engine` (no Ray, no HTTP), fed the same requests as the servers.

Owns: loading each, serving one request and timing it, and the engine's stage timers (wrappers set on
this process's engine instance only: no engine code changes) that split a request's time to first
token into preprocess, encoder wait + forward, decoder wait, prefill.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench_lib.images import data_url
from bench_lib.loadgen import CellRun, RequestResult, complete
from bench_lib.workloads import BenchRequest, ImageSpec, openai_messages


def _url(spec: ImageSpec) -> str:
    return data_url(spec.seed, spec.width, spec.height, spec.fmt)


# --- transformers generate ------------------------------------------------------------------------


class _FirstToken:
    """A streamer that notes when generate() emits its first new token (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class GenerateBaseline:
    """`Gemma3ForConditionalGeneration.generate` + its processor, one request at a time."""

    name = "generate"

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoProcessor, Gemma3ForConditionalGeneration

        self.torch = torch
        self.model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.processor = AutoProcessor.from_pretrained(model_dir)

    def serve_one(self, req: BenchRequest) -> tuple[float, float, int, int]:
        """(seconds to first token, seconds to end, output tokens, prompt tokens) for one request,
        from its data URLs (decoded by transformers, as `transformers serve` does)."""
        urls = [_url(s) for s in req.images]  # NOTE: made before the clock starts, as the HTTP senders do
        t0 = time.perf_counter()
        conversation = [
            {"role": m["role"], "content": [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str)
             else [{"type": "image", "url": p["image_url"]["url"]} if p["type"] == "image_url" else p
                   for p in m["content"]]}
            for m in openai_messages(req, lambda spec: urls[req.images.index(spec)])]
        kwargs = {"do_pan_and_scan": True} if req.pan_and_scan else {}
        inputs = self.processor.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True,
            return_tensors="pt", processor_kwargs=kwargs)
        streamer = _FirstToken()
        with self.torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=req.max_tokens, min_new_tokens=req.max_tokens,
                                      do_sample=False, streamer=streamer)
        end = time.perf_counter()
        n_prompt = inputs["input_ids"].shape[-1]
        return (streamer.first or end) - t0, end - t0, out.shape[-1] - n_prompt, n_prompt

    def run_cell(self, requests: list[BenchRequest], concurrency: int, desc: str) -> CellRun:
        """Serve the requests back to back; `concurrency` closed-loop clients are accounted for exactly:
        request i arrives when request i - concurrency ends (or at the start), so its TTFT and latency
        include the time it waited behind the others."""
        for req in requests:  # build the data URLs before the clock starts, as the HTTP clients do
            for spec in req.images:
                _url(spec)
        ends: list[float] = []
        results = []
        epoch0, t0 = time.time(), time.perf_counter()
        for i, req in tqdm(list(enumerate(requests)), desc=desc, unit="req", leave=False, dynamic_ncols=True):
            started = time.perf_counter()
            arrived = t0 if i < concurrency else ends[i - concurrency]
            try:
                ttft, e2e, n_out, n_prompt = self.serve_one(req)
            except Exception as exc:
                ends.append(time.perf_counter())
                results.append(RequestResult(req.key, False, arrived - t0, None, None, 0, None, repr(exc)[:300]))
                continue
            ends.append(started + e2e)
            results.append(complete(RequestResult(req.key, True, arrived - t0, started + ttft - arrived,
                                                  ends[-1] - arrived, n_out, n_prompt), req))
        return CellRun(results, time.perf_counter() - t0, epoch0)


# --- mmserve Engine -----------------------------------------------------------------------------


class StageTimers:
    """Wraps the stages of one Engine instance and records, per request id, when each stage ran."""

    def __init__(self, engine: Any):
        self.events: dict[str, dict[str, float]] = defaultdict(dict)
        self.forwards: list[tuple[float, int]] = []  # (seconds, crops) per vision forward
        # request id -> (start, end, tokens in the step) of each step that computed its prompt
        self.prefill_steps: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
        self._wrap_preprocess(engine)
        self._wrap_encoder(engine)
        self._wrap_decoder(engine)

    def _wrap_preprocess(self, engine: Any) -> None:
        inner = engine.preprocessor.process

        def process(req, *args, **kwargs):
            self.events[req.request_id]["pre_start"] = time.perf_counter()
            out = inner(req, *args, **kwargs)
            self.events[req.request_id]["pre_end"] = time.perf_counter()
            return out

        engine.preprocessor.process = process

    def _wrap_encoder(self, engine: Any) -> None:
        runner, inner = engine.encoder.runner, engine.encoder.runner.embed_multimodal
        service, encode = engine.encoder_service, engine.encoder_service.encode

        def embed(items):
            t = time.perf_counter()
            out = inner(items)
            self.forwards.append((time.perf_counter() - t, sum(int(i.num_tiles) for i in items)))
            return out

        async def timed_encode(request_id, features):
            self.events[request_id]["enc_start"] = time.perf_counter()
            out = await encode(request_id, features)
            self.events[request_id]["enc_end"] = time.perf_counter()
            return out

        runner.embed_multimodal = embed
        service.encode = timed_encode

    def _wrap_decoder(self, engine: Any) -> None:
        runner, inner = engine.decoder.runner, engine.decoder.runner.execute

        def execute(scheduled):
            t = time.perf_counter()
            out = inner(scheduled)
            end = time.perf_counter()
            tokens = sum(n for _, n in scheduled)
            for seq, n in scheduled:
                if n > 1 or seq.num_computed_tokens == 0:
                    self.prefill_steps[seq.request_id].append((t, end, tokens))
            return out

        runner.execute = execute


class EngineSystem:
    """mmserve's in-process Engine with the app's own config, driven through the same protocol parsing."""

    name = "engine"

    def __init__(self, model_dir: Path, app_args: dict[str, Any], timers: bool = True):
        from deployments.args import parse_args
        from mmserve.engine import Engine

        self.args = parse_args({"model": str(model_dir), **app_args})
        self.engine = Engine(self.args.engine_config())
        self.timers = StageTimers(self.engine) if timers else None
        self.request_ids: dict[str, str] = {}  # request key -> engine request id

    def chat_request(self, req: BenchRequest, request_id: str):
        from mmserve.api.protocol import ChatCompletionRequest

        body: dict[str, Any] = {"messages": openai_messages(req, _url), "max_tokens": req.max_tokens,
                                "temperature": 0.0, "ignore_eos": True, "stream": True}
        if req.pan_and_scan:
            body["mm_processor_kwargs"] = {"do_pan_and_scan": True}
        parsed = ChatCompletionRequest.model_validate(body)
        return parsed.to_chat_request(request_id, self.engine.spec.max_model_len, self.engine.spec.sampling_defaults)

    async def one(self, req: BenchRequest, cell_t0: float) -> RequestResult:
        """A `loadgen.Send`: one request through the engine; its id is kept in `request_ids[req.key]`."""
        request_id = f"bench-{uuid.uuid4().hex[:12]}"
        self.request_ids[req.key] = request_id
        for spec in req.images:  # NOTE: images are made before the clock starts, as the HTTP senders do
            _url(spec)
        sent = time.perf_counter()
        first, n_out, n_prompt = None, 0, None
        try:
            chat = self.chat_request(req, request_id)
            if self.timers is not None:
                self.timers.events[request_id]["sent"] = sent
            async for out in self.engine.stream(chat):
                n_out += len(out.new_token_ids)
                n_prompt = out.num_prompt_tokens
                if first is None and out.new_text:
                    first = time.perf_counter()
                    if self.timers is not None:
                        self.timers.events[request_id]["first"] = first
        except Exception as exc:
            return RequestResult(req.key, False, sent - cell_t0, None, None, 0, None, repr(exc)[:300])
        end = time.perf_counter()
        return RequestResult(req.key, True, sent - cell_t0, (first or end) - sent, end - sent, n_out, n_prompt)

    def breakdown(self, request_id: str) -> dict[str, float] | None:
        """TTFT split in ms: preprocess, encoder (wait + forward), decoder wait, prefill, first token out."""
        if self.timers is None:
            return None
        ev = self.timers.events.get(request_id, {})
        if "first" not in ev or "pre_end" not in ev:
            return None
        steps = self.timers.prefill_steps.get(request_id, [])
        enc_end = ev.get("enc_end", ev["pre_end"])
        prefill_start = steps[0][0] if steps else enc_end
        prefill_end = steps[-1][1] if steps else enc_end
        ms = lambda a, b: (b - a) * 1e3  # noqa: E731
        return {
            "parse+queue_to_preprocess": ms(ev["sent"], ev["pre_start"]),
            "preprocess": ms(ev["pre_start"], ev["pre_end"]),
            "encoder_wait+forward": ms(ev.get("enc_start", ev["pre_end"]), enc_end),
            "decoder_wait": ms(enc_end, prefill_start),
            "prefill_steps": ms(prefill_start, prefill_end),
            "first_token_out": ms(prefill_end, ev["first"]),
            "ttft": ms(ev["sent"], ev["first"]),
        }

    def median_forward_ms_per_crop(self) -> float | None:
        if self.timers is None or not self.timers.forwards:
            return None
        return statistics.median(s / max(1, n) for s, n in self.timers.forwards) * 1e3

    def shutdown(self) -> None:
        self.engine.shutdown()

