"""`n` choices from one prompt: seeded and reproducible, different from each other, the prompt's KV computed
and allocated once (the other choices share its blocks through the prefix cache)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mmserve.engine import Engine
from mmserve.messages import ChatRequest, SamplingParams
from tests.unit.test_engine import IMAGE
from tests.unit.test_parity import data_url, make_image

PROMPT = "Describe the picture in one sentence, then say what colour the sky is."


def chat(request_id: str, salt: str, image: bool = True, **sampling) -> ChatRequest:
    parts = [{"type": "image_url", "image_url": {"url": IMAGE}}] if image else []
    sampling.setdefault("max_tokens", 12)
    return ChatRequest(request_id, [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}],
                       SamplingParams(**sampling), cache_salt=salt)


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine


def test_seeded_choices_are_reproducible_and_differ_from_each_other(engine):
    first = engine.generate([chat("a", "s1", n=4, temperature=1.0, seed=7)])
    again = engine.generate([chat("b", "s2", n=4, temperature=1.0, seed=7)])
    assert [c.index for c in first] == [0, 1, 2, 3] and all(c.request_id == "a" for c in first)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) == 4
    # choice i is the request with seed 7 + i alone (vLLM's rule)
    alone = engine.generate([chat(f"c{i}", "s3", temperature=1.0, seed=7 + i) for i in range(4)])
    assert [c.token_ids for c in alone] == [c.token_ids for c in first]


def test_greedy_choices_agree(engine):
    choices = engine.generate([chat("g", "s4", n=3, temperature=0.0)])
    assert len(choices) == 3 and len({tuple(c.token_ids) for c in choices}) == 1


def test_the_prompt_is_computed_and_allocated_once(engine):
    def fetched(stats) -> int:  # image embeddings taken from the encoder or the Decoder's embedding cache
        cache = stats.decoder.embedding_cache
        return stats.encoder.queries + (cache.hits if cache is not None else 0)

    def run(request: ChatRequest) -> tuple[int, int, list[int]]:
        before = engine.stats()
        done = engine.generate([request])
        after = engine.stats()
        return (after.decoder.allocated_blocks - before.decoder.allocated_blocks,
                fetched(after) - fetched(before), [c.num_cached_tokens for c in done])

    kwargs: dict[str, Any] = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    cold, cold_encodes, [cold_cached] = run(chat("one", "s5", **kwargs))
    warm, warm_encodes, [warm_cached] = run(chat("one-again", "s5", **kwargs))  # the same prompt, cached
    assert cold_cached == 0 and warm_cached > 0 and warm < cold and warm_encodes == 0
    many, many_encodes, cached = run(chat("four", "s6", n=4, **kwargs))  # another salt: nothing shared before
    assert cached == [0, warm_cached, warm_cached, warm_cached]  # choices 1-3 find the prompt's full blocks
    assert many == cold + 3 * warm  # the prompt's blocks once, then each choice its own tail
    assert many_encodes == cold_encodes == 1  # the image's embeddings fetched once: the other choices need none


def test_closing_the_stream_early_aborts_every_choice(engine):
    async def close_once_all_run() -> list[str]:
        pre = engine.preprocess(chat("early", "s7", n=3, temperature=1.0, seed=1, max_tokens=1900, ignore_eos=True))
        stream = engine._serve(pre)
        seen: set[int] = set()
        async for out in stream:
            seen.add(out.index)
            if len(seen) == 3:  # every choice is running
                break
        await stream.aclose()
        for _ in range(1200):  # the aborts reach the step thread a moment later
            if not engine.has_unfinished():  # NOTE: busy while an abort is queued or running: idle, all have run
                break
            await asyncio.sleep(0.025)
        return engine.decoder.request_ids()

    steps_before = engine.decoder.stats().steps
    assert asyncio.run(close_once_all_run()) == []
    assert engine.decoder.stats().running == 0
    # NOTE: choices that ran to their end would have made a step per token: the aborts cut them short
    assert engine.decoder.stats().steps - steps_before < 1900 // 2


def test_without_prefix_caching_the_choices_call_the_encoder_one_at_a_time(tiny_ckpt_224) -> None:
    """All choices start at once then, each needing the image: they get embeddings one after another (a
    transport may route a request's calls by its id, and two in flight under one id could wait for ever);
    the later ones find them in the decoder's cache."""
    from mmserve.config import DecoderConfig, EngineConfig

    engine = Engine(EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048,
                                 decoder=DecoderConfig(enable_prefix_caching=False)))
    real, in_flight, most, calls = engine._encode, [0], [0], [0]

    async def watched(pre: Any) -> Any:
        calls[0] += 1
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            await asyncio.sleep(0.05)  # NOTE: long enough for the other choices' calls to come meanwhile
            return await real(pre)
        finally:
            in_flight[0] -= 1

    engine._encode = watched  # type: ignore[method-assign]
    try:
        before = engine.stats().encoder
        choices = engine.generate([chat("once", "s8", n=3, temperature=0.0, max_tokens=4)])
        after = engine.stats().encoder
    finally:
        engine.shutdown()
    assert [c.index for c in choices] == [0, 1, 2] and len({tuple(c.token_ids) for c in choices}) == 1
    assert most[0] == 1  # never two calls at once
    assert after.forward_passes - before.forward_passes == 1
    assert calls[0] == 1  # the later choices found the embeddings in the decoder's cache, waiting their turn


def test_the_later_choices_queue_in_the_first_choices_place(engine, monkeypatch):
    """The service names choice 0 as each later choice's sibling, by the id choice 0 is scheduled under."""
    scheduler = engine.decoder.scheduler
    add, places = scheduler.add, {}

    def spy(seq: Any, sibling: str | None = None) -> None:
        add(seq, sibling)
        places[seq.request_id] = (sibling, seq.arrival_order)

    monkeypatch.setattr(scheduler, "add", spy)
    engine.generate([chat("p", "s6", n=3, temperature=1.0, seed=3, max_tokens=4)])
    assert [places[f"p/{i}"][0] for i in range(3)] == [None, "p/0", "p/0"]
    assert len({order for _, order in places.values()}) == 1  # one place in the queue: the request's


def test_a_request_cancelled_twice_while_its_choices_wait_gives_back_their_places_in_the_queue(engine, monkeypatch):
    """Choices 1..n-1 count against max_waiting_requests until they start; a second cancel arriving while the
    request's stream closes (Serve cancels a cancelled call's children too) must not keep them counted."""
    service = engine.decoder_service
    asked = asyncio.Event()

    async def held(request_id: str, features: Any, early: bool = False) -> Any:
        asked.set()
        await asyncio.Event().wait()  # NOTE: the first choice's embeddings never come: its siblings stay waiting

    monkeypatch.setattr(engine.encoder_service, "encode", held)

    async def cancel_twice() -> int:
        # NOTE: an image no other test sends, so that no cache has its embeddings and the encoder is asked
        fresh = [{"type": "image_url", "image_url": {"url": data_url(make_image(200, 150, seed=909))}},
                 {"type": "text", "text": PROMPT}]
        pre = engine.preprocess(ChatRequest("twice", [{"role": "user", "content": fresh}], SamplingParams(
            n=3, temperature=1.0, seed=3, max_tokens=400, ignore_eos=True)))

        async def consume() -> None:
            async for _ in engine._serve(pre):
                pass

        task = asyncio.create_task(consume())
        await asyncio.wait_for(asked.wait(), 30)  # the first choice waits for its embeddings, held
        assert service._arriving == 3  # it and its two siblings, waiting for its prefill
        task.cancel()
        await asyncio.sleep(0)  # the stream's `finally` now waits for its choices' tasks
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(400):
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.025)
        return service._arriving

    assert service._arriving == 0
    assert asyncio.run(cancel_twice()) == 0
