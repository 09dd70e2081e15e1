"""The decoder behind an async API: one request's life from embeddings to its last token.

Owns: the request lifecycle around the Decoder — hash the prompt's blocks and ask the prefix cache
how much of it is cached, get embeddings only for the items not wholly inside that prefix (from its
own small cache of recent embeddings, else from an in-process encoder or a remote one), fetch later
the ones a request turns out to need after all (the cache let the blocks go before admission, or a
preemption), queue the request, stream its outputs, and abort it in the decoder if the consumer
leaves early. Nothing is held at the encoder once its embeddings are here (the encoder stage's
contract), so nothing is released at the end. Does not own: scheduling or the model (Decoder), where
embeddings come from (embedding_source.py), nor transport (the Engine and the Ray Decoder deployment both use this).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from mmserve.decoder.decoder import Decoder
from mmserve.decoder.embedding_cache import EmbeddingCache
from mmserve.decoder.embedding_source import EmbeddingSource, EncodeFn
from mmserve.decoder.stats import DecoderStats
from mmserve.decoder.stream_pacing import StreamPacing
from mmserve.errors import OverloadedError
from mmserve.messages import DecodeRequest, PreprocessedRequest, RequestOutput, merge_outputs
from mmserve.runtime.device_errors import device_fatal
from mmserve.runtime.shared_cores import SharedCores
from mmserve.runtime.step_loop import StepLoop
from mmserve.runtime.timeline import Timeline

# NOTE: a prompt this long is hashed off the event loop, whose every stream a 128k prompt's hashing would hold
# (docs/benchmarks.md, "A long prompt's block hashes"); a shorter one here, where a thread's hand-off would cost
# more than its hashing
HASH_OFF_LOOP_TOKENS = 8192


def choice_id(request_id: str, index: int) -> str:
    """The id choice `index` of an n > 1 request is served under."""
    return f"{request_id}/{index}"


@dataclass
class _Live:
    """A request between its `generate` call and its end, as a late fetch of embeddings needs it."""

    pre: PreprocessedRequest
    encode: EncodeFn | None
    loop: asyncio.AbstractEventLoop  # the consumer's
    encoding: asyncio.Lock  # held while getting embeddings; one for all the choices of a request (`_choices`)
    fetches: int = 0  # late fetches started (each its own encoder request id)
    fetching: set[concurrent.futures.Future[None]] = field(default_factory=set)  # late fetches under way
    ended: bool = False  # the consumer is gone: a late fetch finishing after it is dropped
    timeline: Timeline = field(default_factory=Timeline)  # this service's phases up to the first output


class DecoderService:
    def __init__(self, decoder: Decoder, *, pacing: StreamPacing | None = None, max_waiting: int | None = None,
                 embedding_cache_bytes: int = 0, encode_rows: int | None = None):
        self.decoder = decoder
        self.embeddings = EmbeddingCache(embedding_cache_bytes)  # recent items' embeddings, by content hash
        self.max_waiting = max_waiting  # requests accepted but not running; None = unbounded
        self.pacing = pacing or StreamPacing()  # how often a request's outputs go, the first at once
        self._streams = 0  # requests streaming now: past their first output, not final_only
        self.loop = StepLoop(decoder.step, decoder.has_unfinished, decoder.abort_all, name="mmserve-decoder",
                             fatal=device_fatal)
        self._live: dict[str, _Live] = {}
        self._reserved: set[str] = set()  # the ids of the requests being served and of their choices (n > 1)
        self._ids = threading.Lock()  # NOTE: one id's check and reservation at once, for consumers on several loops
        self._arriving = 0  # requests hashing or waiting for embeddings, not yet handed to the decoder
        decoder.on_missing = self._on_missing
        self.shared_cores = SharedCores()  # encodes in flight on this host's CPU: the steps take fewer threads
        self.source = EmbeddingSource(self.embeddings, self.shared_cores, encode_rows)
        decoder.runner.threads.beside = self.shared_cores.busy

    async def generate(
        self, pre: PreprocessedRequest, encode: EncodeFn | None = None, *, admit: bool = True
    ) -> AsyncGenerator[RequestOutput]:
        """Outputs of one request (of each of its `n` choices, by `index`); closing the iterator early aborts
        it and frees its KV blocks. `admit=False`: not refused past `max_waiting` (a caller bounding its own)."""
        n = pre.sampling.n
        ids = [pre.request_id, *(choice_id(pre.request_id, i) for i in range(n) if n > 1)]  # its choices' own too
        with self._ids:
            if taken := [i for i in ids if i in self._live or i in self._reserved]:
                raise ValueError(f"request {taken[0]} is already being served here")  # NOTE: the live one goes on
            self._reserved.update(ids)  # NOTE: with n > 1 the choices become live one by one, the request never
        try:
            if admit:
                self._admit_or_refuse(n)
            outputs = self._one(pre, encode) if n == 1 else self._choices(pre, encode)
            async with contextlib.aclosing(outputs):  # NOTE: closing this one closes (aborts) that one at once
                async for out in outputs:
                    yield out
        finally:
            with self._ids:
                self._reserved.difference_update(ids)

    async def _choices(self, pre: PreprocessedRequest, encode: EncodeFn | None) -> AsyncGenerator[RequestOutput]:
        """`n` choices as sequences of their own, each with seed `seed + index` (as vLLM), merged in one stream.

        NOTE: the first choice runs alone until its first output, i.e. until its prefill has put the prompt's
        blocks in the prefix cache; the others then find every full block of the prompt there (shared, not
        computed again) and compute only its last partial block. Without prefix caching each computes it all.
        """
        queue: asyncio.Queue[RequestOutput | Exception | None] = asyncio.Queue()
        encoding = asyncio.Lock()  # NOTE: the choices get embeddings one at a time (`_encode`)
        prefilled = asyncio.Event()
        if self.decoder.scheduler.hasher is None:
            prefilled.set()  # no prefix cache to share: no reason to wait for choice 0
        waiting = set(range(1, pre.sampling.n))  # choices not yet started: they count against max_waiting too
        self._arriving += len(waiting)

        def started(index: int) -> None:
            if index in waiting:  # from here `_one` counts it
                waiting.discard(index)
                self._arriving -= 1

        async def pump(index: int) -> None:
            seed = pre.sampling.seed
            child = replace(pre, request_id=choice_id(pre.request_id, index), sampling=replace(
                pre.sampling, n=1, seed=None if seed is None else seed + index))
            try:
                if index:
                    await prefilled.wait()
                    started(index)
                # NOTE: a later choice queues in the first's place (`Scheduler.add`), not behind later requests
                first = None if index == 0 else choice_id(pre.request_id, 0)
                async for out in self._one(child, encode, encoding, first):
                    prefilled.set()
                    queue.put_nowait(replace(out, request_id=pre.request_id, index=index))
            except Exception as exc:  # NOTE: not CancelledError: that is this stream closing
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i)) for i in range(pre.sampling.n)]
        try:
            for _ in tasks:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # each choice's own stream aborts its sequence as it closes
            for index in list(waiting):  # cancelled before they started
                started(index)  # NOTE: before the await, which a second cancel may cut short
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, pre: PreprocessedRequest, encode: EncodeFn | None, encoding: asyncio.Lock | None = None,
                   sibling: str | None = None) -> AsyncGenerator[RequestOutput]:
        request_id = pre.request_id
        live = _Live(pre, encode, asyncio.get_running_loop(), encoding or asyncio.Lock())
        # NOTE: before any state changes, in one atomic check-and-insert (consumers on two threads' loops): the
        # live one keeps its stream
        if self._live.setdefault(request_id, live) is not live:
            raise ValueError(f"request {request_id} is already being served here")
        finished = submitted = False
        self._arriving += 1
        try:
            try:
                self.decoder.scheduler.check_length(len(pre.prompt_token_ids))  # NOTE: before its images are encoded
                hashes = self._block_hashes(pre) if len(pre.prompt_token_ids) < HASH_OFF_LOOP_TOKENS else \
                    await asyncio.to_thread(self._block_hashes, pre)
                embeddings = await self._embeddings_outside_cache(live, hashes)
                pre = live.pre = without_encoded_pixels(pre, embeddings)  # a late fetch reads the rest here
                specs = [replace(f, data=None) for f in pre.features]  # the decoder needs no pixels
                request = DecodeRequest(request_id, pre.prompt_token_ids, specs, embeddings, pre.sampling,
                                        pre.cache_salt, tuple(hashes))
                matcher = await self._matcher(pre)
                self.loop.open(request_id)
                self.loop.submit(request_id, lambda: self.decoder.add(request, matcher, sibling))
                submitted = True
                live.timeline.mark("decoder.admit")  # the request handed to the step thread
            finally:
                self._arriving -= 1
            # NOTE: deltas that piled up while this consumer waited, or came within one stream interval,
            # go on as one: each output is a message through Serve to the ingress and on to the client.
            final_only, streaming, timed = pre.sampling.final_only, False, False
            outputs = self.loop.outputs(request_id, merge=merge_outputs, interval_s=lambda: (
                self.pacing.interval_s(self._streams, final_only=final_only)))
            try:
                async for out in outputs:
                    finished = out.finished
                    if not (streaming or final_only):  # NOTE: from its first output: a queued one sends nothing
                        streaming, self._streams = True, self._streams + 1
                    if not timed:
                        live.timeline.mark("decoder.first_output")  # scheduled, prefilled, sampled, handed over
                        out, timed = replace(out, timings=(*pre.timings, *live.timeline.phases)), True
                    yield out
            finally:
                self._streams -= streaming
                await outputs.aclose()  # NOTE: its channel goes now, not when the collector finds the generator
        finally:
            del self._live[request_id]
            live.ended = True
            for fetch in list(live.fetching):  # NOTE: its encoder call ends too, and lets go of what it holds there
                fetch.cancel()
            if submitted and not finished:  # NOTE: one refused before it reached the step thread holds nothing there
                self.loop.submit(None, lambda: self.decoder.abort(request_id))

    def _admit_or_refuse(self, n: int = 1) -> None:
        """Raise OverloadedError when the requests waiting here (encoding, queued, preempted), with the `n`
        sequences of this one, would pass the bound; with none waiting, a request of more choices than the bound
        goes alone (refused, it would be refused for ever).

        NOTE: read on the consumers' loop while the step thread updates the scheduler's waiting list (a
        list's len is atomic); a request between its submission and the step that adds it is in neither
        count for that moment: off by a request or two at a boundary, never unbounded.
        """
        if self.max_waiting is None:
            return
        waiting = self._arriving + len(self.decoder.scheduler.waiting)
        if waiting + n > self.max_waiting and waiting:  # NOTE: a request of more choices than the bound goes alone
            raise OverloadedError(f"the decoder has {waiting} requests waiting (decoder.max_waiting_requests "
                                  f"{self.max_waiting}); retry later")

    async def _matcher(self, pre: PreprocessedRequest) -> Any:
        """The request's grammar matcher, compiled on a worker thread: compiling a new schema can take longer
        than a decode step, and must stall neither the step thread nor this event loop."""
        structured = pre.sampling.structured
        if structured is None:
            return None
        return await asyncio.to_thread(self.decoder.grammars.matcher, structured)

    def _block_hashes(self, pre: PreprocessedRequest) -> list[bytes]:
        """The prompt's block hashes, computed here (NOTE: not in the step thread: a pure function of the
        request). NOTE: never those the message carries: they are a routing key, and a hash that did not
        match the decoder's own hashing would hand a prompt another prompt's KV."""
        hasher = self.decoder.scheduler.hasher
        return [] if hasher is None else list(hasher.prompt(pre.prompt_token_ids, pre.features, pre.cache_salt))

    async def _embeddings_outside_cache(self, live: _Live, hashes: list[bytes]) -> list[Any]:
        """Embeddings of the items not wholly inside the prompt's cached prefix; None for the others."""
        pre = live.pre
        if not pre.features or live.encode is None:
            return [None] * len(pre.features)
        hit = await self.loop.call(lambda: self.decoder.prefix_hit_tokens(hashes, len(pre.prompt_token_ids))) \
            if hashes else 0
        live.timeline.mark("decoder.prefix")  # the prompt's blocks hashed and looked up
        needed = [i for i, f in enumerate(pre.features) if f.placeholder.offset + f.placeholder.length > hit]
        embeddings = await self._encode(live, pre.request_id, needed)
        live.timeline.mark("decoder.embeddings")  # from this service's cache or the encoder
        return embeddings

    async def _encode(self, live: _Live, encoder_id: str, indices: list[int], call: str = "decoder.encode_call"
                      ) -> list[Any]:
        """Embeddings of the features at `indices` (None elsewhere), from `self.source`.

        NOTE: under `live.encoding`, which a request's choices share: they get embeddings one at a time, the
        later ones from the cache (or the encoder's). A transport may route every call made while serving one
        request by that request's id: Ray Serve does, and a custom router (the Encoder's affinity router) hands
        a chosen replica to the pending call of that id, so a second call in flight under it would wait for ever.
        """
        async with live.encoding:
            assert live.encode is not None
            return await self.source.get(live.pre, live.encode, encoder_id, indices, live.timeline, call)

    def _on_missing(self, request_id: str, indices: list[int]) -> None:
        """From the step thread: a running request needs embeddings it was added without."""
        live = self._live.get(request_id)
        if live is None:
            return  # it is ending; the decoder drops it
        fetching = self._fetch(live, indices)
        try:
            fetch = asyncio.run_coroutine_threadsafe(fetching, live.loop)
        except RuntimeError:  # NOTE: its consumer's loop has closed: that request ends, not the step's batch mates
            fetching.close()
            self.loop.submit(request_id, lambda: self._end_abandoned(live))
            return
        live.fetching.add(fetch)
        fetch.add_done_callback(live.fetching.discard)
        if live.ended:  # NOTE: it ended between our look and the add, its cancels done: this call ends too
            fetch.cancel()

    def _end_abandoned(self, live: _Live) -> None:
        """On the step thread: end a request whose consumer's loop closed without its own ending running (which
        aborts it, unless it did so meanwhile: then the id may be another request's already)."""
        request_id = live.pre.request_id
        if self._live.get(request_id) is not live:
            return
        del self._live[request_id]
        with self._ids:  # NOTE: its `generate`, on that loop, will not end to let go of the id. NOTE: a choice's
            self._reserved.discard(request_id)  # request (n > 1) keeps its own and its other choices' ids: not done
        live.ended = True
        self.decoder.abort(request_id)  # its KV back
        # NOTE: raised to be delivered to that closed loop, which drops the request's channel there
        raise RuntimeError(f"request {request_id}: its consumer's event loop has closed")

    async def _fetch(self, live: _Live, indices: list[int]) -> None:
        request_id = live.pre.request_id
        if live.ended:  # NOTE: it ended between the step thread's ask and this task's start: nobody cancels it
            return
        live.fetches += 1
        encoder_id = f"{request_id}/late-{live.fetches}"
        try:
            got = await self._encode(live, encoder_id, indices, call="decoder.late_encode_call")
            if live.ended:  # the request ended while this was in flight
                return
        except Exception as exc:
            if live.ended:  # NOTE: its id may already be another request's
                return
            # NOTE: fails the request (its consumer raises, then aborts it) unless it went past those items meanwhile
            self.loop.submit(request_id, functools.partial(self.decoder.fetch_failed, request_id, indices, exc))
            return
        live.pre = without_encoded_pixels(live.pre, got)
        self.loop.submit(request_id, lambda: self.decoder.provide_embeddings(request_id, {i: got[i] for i in indices}))

    def busy(self) -> bool:
        return self.loop.busy()

    def stats(self) -> DecoderStats:
        """The decoder's figures, with the requests still arriving among the waiting (as `max_waiting_requests`
        counts them), and this service's cache of embeddings."""
        stats = self.decoder.stats()
        return replace(stats, waiting=stats.waiting + self._arriving, embedding_cache=self.embeddings.stats())

    def check_health(self, stuck_after_s: float | None = None) -> None:
        self.loop.check_health(stuck_after_s)

    def stop(self) -> None:
        self.loop.stop()


def without_encoded_pixels(pre: PreprocessedRequest, embeddings: list[Any]) -> PreprocessedRequest:
    """`pre` with the pixel data of every item that has its embeddings dropped: the sequence keeps its
    embeddings for its whole life (a preemption recomputes from them), so the pixels are never needed
    again. NOTE: in the Ray app the object store still keeps such pixels until the decode call ends (Ray
    pins references nested in a call's arguments while it runs); this frees the decoder's own hold."""
    if all(emb is None for emb in embeddings):
        return pre
    pairs = zip(pre.features, embeddings, strict=True)
    return replace(pre, features=[replace(f, data=None) if emb is not None else f for f, emb in pairs])
