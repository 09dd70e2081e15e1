"""mmserve/preprocess/image_slots.py, and the Preprocessor under it: however many threads preprocess at once, at
most `slots` images are worked on at a time, and a request whose caller left stops waiting for one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any

import pytest

from mmserve.preprocess.image_slots import ImageSlots


def test_at_most_slots_bodies_run_at_once() -> None:
    slots = ImageSlots(2)
    lock, running, most = threading.Lock(), [0], [0]

    def work() -> None:
        with slots.held(lambda: False):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.02)
            with lock:
                running[0] -= 1

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: work(), range(16)))
    assert most[0] == 2


def test_a_caller_that_left_stops_waiting_and_a_failed_body_frees_its_slot() -> None:
    slots = ImageSlots(1)
    with slots.held(lambda: False), pytest.raises(CancelledError, match="left while its image waited"), \
            slots.held(lambda: True):
        pass
    with pytest.raises(RuntimeError), slots.held(lambda: False):
        raise RuntimeError("the processor failed")
    with slots.held(lambda: False):  # free again
        pass
    with pytest.raises(ValueError):
        ImageSlots(0)


def test_the_preprocessor_works_on_no_more_images_at_once_than_its_slots(tiny_ckpt_224, monkeypatch) -> None:
    from mmserve.config import EngineConfig
    from mmserve.messages import ChatRequest, SamplingParams
    from mmserve.preprocess.preprocessor import Preprocessor
    from mmserve.preprocess.processor_cache import ProcessorCache
    from mmserve.stages import StageFactory
    from tests.unit.test_parity import data_url, make_image

    factory = StageFactory(EngineConfig(model=str(tiny_ckpt_224)))
    pre = factory.preprocessor(ProcessorCache(1 << 24), image_slots=ImageSlots(1))
    lock, running, most = threading.Lock(), [0], [0]
    item = Preprocessor._item

    def counted(self, *args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.02)
            return item(self, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(Preprocessor, "_item", counted)

    def one(i: int) -> None:
        image = {"type": "image_url", "image_url": {"url": data_url(make_image(64, 48, seed=700 + i))}}
        content = [image, {"type": "text", "text": "hi"}]
        pre.process(ChatRequest(f"s{i}", [{"role": "user", "content": content}], SamplingParams(max_tokens=2)))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(6)))
    assert most[0] == 1


def test_slow_fetches_hold_up_only_other_fetching_requests_and_a_caller_gone_stops_waiting(tiny_ckpt_224) -> None:
    """A request whose image URL is slow holds its process's one fetch slot: a text request is served meanwhile,
    a second fetching request waits for the slot (its reads not started), and stops waiting once its caller left."""
    import io

    from mmserve.config import EngineConfig, MediaConfig
    from mmserve.messages import ChatRequest, PreprocessedRequest, SamplingParams
    from mmserve.preprocess.media import MediaLoader
    from mmserve.preprocess.processor_cache import ProcessorCache
    from mmserve.stages import StageFactory
    from tests.unit.test_parity import make_image

    buf = io.BytesIO()
    make_image(64, 48, seed=9).save(buf, format="PNG")
    png, release, reads = buf.getvalue(), threading.Event(), list[str]()

    class SlowLoader(MediaLoader):
        def read_all(self, urls: list[str], cancelled: Callable[[], bool] = lambda: False) -> Iterator[bytes]:
            reads.extend(urls)
            if urls:
                release.wait(60)  # the network, slow
            yield from (png for _ in urls)

    factory = StageFactory(EngineConfig(model=str(tiny_ckpt_224)))
    pre = factory.preprocessor(ProcessorCache(1 << 24), image_slots=ImageSlots(2), fetch_slots=ImageSlots(1))
    pre.loader = SlowLoader(MediaConfig())

    def ask(rid: str, url: str | None, cancelled: Callable[[], bool] = lambda: False) -> PreprocessedRequest:
        parts: list[dict[str, Any]] = [{"type": "text", "text": "hi"}]
        if url is not None:
            parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
        return pre.process(ChatRequest(rid, [{"role": "user", "content": parts}], SamplingParams(max_tokens=2)),
                           cancelled)

    with ThreadPoolExecutor(3) as pool:
        slow = pool.submit(ask, "slow", "http://images.example/a.png")
        deadline = time.monotonic() + 30
        while not reads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reads, slow.exception() if slow.done() else "the slow request's reads never began"
        assert ask("text", None).prompt_token_ids  # served while the fetch hangs
        second = pool.submit(ask, "second", "http://images.example/b.png")
        gone = pool.submit(ask, "gone", "http://images.example/c.png", lambda: True)
        with pytest.raises(CancelledError, match="left while its image waited"):
            gone.result(timeout=5)
        time.sleep(0.1)
        assert reads == ["http://images.example/a.png"]  # the second waits for the slot, its reads not begun
        release.set()
        assert slow.result(timeout=30).features and second.result(timeout=30).features
    assert reads == ["http://images.example/a.png", "http://images.example/b.png"]
