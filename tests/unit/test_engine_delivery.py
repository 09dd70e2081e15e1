"""How the in-process engine hands requests their outputs: a final-only answer in at most two messages, and
a full waiting queue that refuses at once while the rest complete."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from mmserve.config import DecoderConfig, EngineConfig
from mmserve.engine import Engine
from mmserve.errors import OverloadedError
from tests.unit.test_engine import IMAGE, chat, collect
from tests.unit.test_parity import data_url, make_image


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine


def test_a_final_only_request_gets_its_first_output_then_the_rest_in_one_with_the_same_tokens(engine):
    [ref] = engine.generate([chat("f0", IMAGE, max_tokens=24, ignore_eos=True)])

    outs = asyncio.run(collect(engine, chat("f1", IMAGE, max_tokens=24, ignore_eos=True, final_only=True)))
    # NOTE: the first output may carry what was already queued with it; after it, nothing until the end
    assert len(outs) <= 2 and outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 24, outs
    assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
    assert "".join(o.new_text for o in outs) == ref.text


def test_a_full_waiting_queue_refuses_at_once_and_the_rest_complete(tiny_ckpt_224):
    config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048,
                          decoder=DecoderConfig(max_num_seqs=1, max_waiting_requests=2))

    async def run(eng: Engine) -> tuple[list[Any], OverloadedError]:
        # NOTE: q0 long enough to outlast the queueing below on a fast CPU (60 tokens did not, on one)
        long = eng.stream(chat("q0", max_tokens=1500, ignore_eos=True))
        first = await long.__anext__()  # q0 runs: the one sequence slot is taken
        waiting = [asyncio.ensure_future(collect(eng, chat(f"q{i}", max_tokens=4))) for i in (1, 2)]
        async with asyncio.timeout(30):
            while len(eng.decoder.scheduler.waiting) < 2:  # both accepted and queued behind q0
                await asyncio.sleep(0.005)
        with pytest.raises(OverloadedError) as refused:
            await collect(eng, chat("q3", max_tokens=4))
        rest = [o async for o in long]
        return [[first, *rest], *await asyncio.gather(*waiting)], refused.value

    with Engine(config) as eng:
        done, refused = asyncio.run(run(eng))
        assert "decoder.max_waiting_requests" in str(refused) and refused.status == 503
        assert all(outs[-1].finished and outs[-1].finish_reason in ("stop", "length") for outs in done)
        [after] = eng.generate([chat("q4", max_tokens=4)])  # and the queue has room again
        assert after.finish_reason in ("stop", "length")


def test_a_request_awaiting_its_embeddings_counts_among_the_waiting(engine, monkeypatch):
    """As `decoder.max_waiting_requests` counts it: the gauge of waiting requests is not 0 while the encoder is
    the bottleneck and the decoder refuses for its waiting requests."""
    async def run() -> None:
        gate, real = asyncio.Event(), engine.encoder_service.encode

        async def held(request_id: str, features: Any, early: bool = False) -> Any:
            await gate.wait()
            return await real(request_id, features, early)

        monkeypatch.setattr(engine.encoder_service, "encode", held)
        before = engine.stats().decoder.waiting
        new_image = data_url(make_image(320, 240, seed=4711))  # not in any cache: its embeddings are asked for
        task = asyncio.ensure_future(collect(engine, chat("w1", new_image, max_tokens=2)))
        async with asyncio.timeout(30):
            while engine.stats().decoder.waiting == before:
                await asyncio.sleep(0.005)
        assert engine.stats().decoder.waiting == before + 1 and not task.done()
        gate.set()
        outs = await asyncio.wait_for(task, 30)
        assert outs[-1].finished and engine.stats().decoder.waiting == before

    asyncio.run(run())


# a new image's in process, where the cache answers each lookup at once: the work after each lookup
IMAGE_PHASES = ("preprocess.image_read", "preprocess.image_lookup", "preprocess.image_decode", "preprocess.image_hash",
                "preprocess.image_lookup", "preprocess.image_process", "preprocess.image_store")


def test_a_first_output_carries_each_stage_s_phases_in_order_and_no_other_output_does(engine):
    async def timed(request) -> tuple[list[Any], float]:
        started = time.perf_counter()
        outs = await collect(engine, request)
        return outs, (time.perf_counter() - started) * 1e3

    new_image = chat("t1", data_url(make_image(320, 240, seed=int.from_bytes(os.urandom(4), "little"))),
                     max_tokens=64, ignore_eos=True)  # NOTE: longer than a stream interval: more outputs follow
    outs, wall_ms = asyncio.run(timed(new_image))
    # NOTE: outputs that pile up while the consumer sleeps come merged: a loaded machine may merge them all
    assert sum(len(o.new_token_ids) for o in outs) == 64 and all(not o.timings for o in outs[1:])
    phases = dict(outs[0].timings)
    assert [name for name, _ in outs[0].timings] == [
        "preprocess.prompt", *IMAGE_PHASES, "preprocess.features", "decoder.prefix", "decoder.encode_call",
        "encoder.pixels", "encoder.forward", "encoder.stage", "decoder.embeddings", "decoder.admit",
        "decoder.first_output"], outs[0].timings
    assert all(ms >= 0 for ms in phases.values())
    # each lies inside the next: the forward in the stage's stay, that in the call, the call in the phase
    assert phases["encoder.pixels"] + phases["encoder.forward"] <= phases["encoder.stage"]
    assert phases["encoder.stage"] <= phases["decoder.encode_call"] <= phases["decoder.embeddings"]
    assert sum(ms for name, ms in outs[0].timings if name.split(".")[0] in ("preprocess", "decoder")
               and name != "decoder.encode_call") <= wall_ms

    text_outs = asyncio.run(collect(engine, chat("t2", text="Hello there", max_tokens=2)))
    assert [name for name, _ in text_outs[0].timings] == [  # no image: no prefix lookup for it, no encoder
        "preprocess.prompt", "preprocess.features", "decoder.admit", "decoder.first_output"]
