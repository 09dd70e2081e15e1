"""The in-process Engine as a library: a batch of any size, a call from a coroutine, an engine dropped without
`shutdown`, the checkpoint's sampling on request, a cancel during preprocessing, the package's exports."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any

import numpy as np
import pytest

import mmserve
from mmserve.config import DecoderConfig, EngineConfig
from mmserve.engine import Engine
from mmserve.messages import SamplingParams
from tests.unit.test_engine import IMAGE, chat, collect


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine


def test_a_batch_larger_than_the_waiting_bound_completes_whole(tiny_ckpt_224):
    config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048,
                          decoder=DecoderConfig(max_num_seqs=1, max_waiting_requests=2))
    requests = [chat(f"b{i}", *([IMAGE] if i % 2 else []), max_tokens=3, ignore_eos=True) for i in range(6)]
    requests += [chat("b-n", max_tokens=3, ignore_eos=True, n=2), chat("b-wide", max_tokens=3, ignore_eos=True, n=3)]
    with Engine(config) as eng:
        done = eng.generate(requests)  # NOTE: before, the third request in flight was refused as an overload
        assert [(c.request_id, c.index) for c in done] == [(r.request_id, 0) for r in requests[:-2]] + \
            [("b-n", 0), ("b-n", 1), ("b-wide", 0), ("b-wide", 1), ("b-wide", 2)]  # more choices than the bound: alone
        assert all(len(c.token_ids) == 3 for c in done)
        assert not eng.has_unfinished()


def test_a_prompt_longer_than_the_pool_is_refused_before_its_images_are_encoded(tiny_ckpt_224, monkeypatch):
    from mmserve.errors import CapacityError

    config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048, decoder=DecoderConfig(num_blocks=2))
    with Engine(config) as eng:
        encoded: list[Any] = []
        monkeypatch.setattr(eng.encoder_service, "encode", lambda *a, **k: encoded.append(a))
        with pytest.raises(CapacityError, match="KV blocks"):
            eng.generate([chat("long", IMAGE, text="What is this? " * 20)])
        assert encoded == []


def test_a_batch_is_not_refused_while_other_callers_fill_the_waiting_queue(tiny_ckpt_224):
    config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048,
                          decoder=DecoderConfig(max_num_seqs=1, max_waiting_requests=1))

    async def run(eng: Engine) -> list[Any]:
        long = eng.stream(chat("w0", max_tokens=400, ignore_eos=True))
        await long.__anext__()  # w0 runs: the one sequence slot is taken
        queued = asyncio.ensure_future(collect(eng, chat("w1", max_tokens=2)))
        async with asyncio.timeout(30):
            while len(eng.decoder.scheduler.waiting) < 1:  # the waiting queue is full
                await asyncio.sleep(0.005)
        done = await asyncio.to_thread(eng.generate, [chat(f"g{i}", max_tokens=2) for i in range(3)])
        await long.aclose()
        await queued
        return done

    with Engine(config) as eng:
        done = asyncio.run(run(eng))
        assert [c.request_id for c in done] == ["g0", "g1", "g2"] and all(len(c.token_ids) == 2 for c in done)


def test_async_with_shuts_the_engine_down_off_the_callers_loop(tiny_ckpt_224, monkeypatch):
    """`async with`: the stop's joins run on a worker thread, and the caller's loop keeps running meanwhile."""
    config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048)
    stopped_on: list[str] = []
    ticks: list[int] = []

    async def run() -> None:
        async with Engine(config) as eng:
            [done] = [c async for c in eng.stream(chat("aw", max_tokens=2, ignore_eos=True))][-1:]
            assert done.finished
            stop = eng.shutdown

            def slow_shutdown() -> None:  # as a stop that waits on a step thread for a while
                stopped_on.append(threading.current_thread().name)
                threading.Event().wait(0.2)
                stop()

            monkeypatch.setattr(eng, "shutdown", slow_shutdown)

            async def tick() -> None:
                for i in range(100):
                    ticks.append(i)
                    await asyncio.sleep(0.01)

            ticker = asyncio.ensure_future(tick())
        ticker.cancel()
        assert eng.decoder_service.loop._stopped  # stopped for real

    asyncio.run(run())
    assert stopped_on and stopped_on[0] != threading.main_thread().name
    assert len(ticks) >= 5  # the loop ran while the stop waited


def test_a_collected_engines_finalizer_stops_it_off_any_thread_but_the_main_one():
    from mmserve.engine import _stop_when_collected

    stopped: list[str] = []

    class Stage:
        def stop(self) -> None:
            stopped.append(threading.current_thread().name)

    worker = threading.Thread(target=_stop_when_collected, args=(Stage(), Stage()), name="a-step-thread")
    worker.start()
    worker.join(10)
    for _ in range(100):
        if len(stopped) == 2:
            break
        threading.Event().wait(0.05)
    assert stopped == ["mmserve-engine-stop"] * 2
    stopped.clear()
    _stop_when_collected(Stage(), Stage())  # type: ignore[arg-type]  # the main thread: here, at once (exit)
    assert stopped == [threading.main_thread().name] * 2


def test_generate_called_from_a_coroutine_says_to_use_stream_before_any_work(engine, monkeypatch):
    calls: list[Any] = []
    monkeypatch.setattr(engine, "preprocess", lambda *a: calls.append(a))

    async def inside() -> None:
        engine.generate([chat("co", IMAGE)])

    with pytest.raises(TypeError, match=r"Engine\.stream"):
        asyncio.run(inside())
    assert calls == []


def test_an_engine_dropped_without_shutdown_stops_its_threads_and_is_freed(tiny_ckpt_224):
    eng = Engine(EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048))
    eng.generate([chat("gc", IMAGE, max_tokens=2)])
    threads = [eng.decoder_service.loop._thread, eng.encoder_service.loop._thread]
    decoder = weakref.ref(eng.decoder)
    assert all(t is not None and t.is_alive() for t in threads)
    del eng
    gc.collect()
    for thread in threads:
        assert isinstance(thread, threading.Thread)
        thread.join(10)
        assert not thread.is_alive()
    gc.collect()
    assert decoder() is None  # NOTE: the weights and the KV pool went with it


def test_default_sampling_takes_the_checkpoints_recommendation_under_the_callers_fields(engine):
    assert engine.spec.sampling_defaults.top_k == 64  # the tiny checkpoint's generation_config.json
    made = engine.default_sampling(max_tokens=5, top_p=0.5)
    assert (made.top_k, made.top_p, made.max_tokens, made.temperature) == (64, 0.5, 5, 1.0)
    assert SamplingParams().top_k == 0  # a SamplingParams built directly is taken as it is


def test_one_stop_string_is_one_string_not_its_letters(engine):
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]
    assert SamplingParams(bad_words="foo").bad_words == ("foo",)  # type: ignore[arg-type]
    [free] = engine.generate([chat("s0", text="Say something", max_tokens=12, ignore_eos=True)])
    stop = free.text[3:6]
    assert stop and len(set(stop)) > 1
    [cut] = engine.generate([chat("s1", text="Say something", max_tokens=12, ignore_eos=True, stop=stop)])
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)  # the whole string, not one of its letters
    assert cut.text == free.text[:free.text.index(stop)]


def test_a_stream_cancelled_while_preprocessing_stops_the_preprocess_at_its_next_image(engine, monkeypatch):
    asked: list[Any] = []
    started, release = threading.Event(), threading.Event()

    def slow(request: Any, cancelled: Any) -> Any:
        asked.append(cancelled)
        started.set()
        release.wait(10)
        raise RuntimeError("not reached by the caller")

    monkeypatch.setattr(engine.preprocessor, "process", slow)

    async def run() -> None:
        task = asyncio.ensure_future(engine.stream(chat("pc", IMAGE)).__anext__())
        await asyncio.to_thread(started.wait, 10)
        assert not asked[0]()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert asked[0]()  # the worker thread sees its caller gone
        release.set()

    asyncio.run(run())


def test_the_library_is_importable_from_the_package():
    from mmserve import ChatRequest, Engine, EngineConfig, StageStopped

    assert (Engine, EngineConfig, ChatRequest, StageStopped) == (
        mmserve.engine.Engine, mmserve.config.EngineConfig, mmserve.messages.ChatRequest,
        mmserve.runtime.step_loop.StageStopped)
    with pytest.raises(AttributeError):
        _ = mmserve.Nothing


def test_a_config_subtree_or_number_of_the_wrong_type_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"EngineConfig\.decoder must be a DecoderConfig, got dict"):
        EngineConfig(decoder={"max_num_seqs": 4})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"DecoderConfig\.max_num_seqs must be a number, got '4'"):
        DecoderConfig(max_num_seqs="4")  # type: ignore[arg-type]
    assert EngineConfig(decoder=DecoderConfig(max_num_seqs=4)).decoder.max_num_seqs == 4
    assert DecoderConfig(max_num_seqs=np.int64(4)).max_num_seqs == 4  # type: ignore[arg-type]  # numpy's too
