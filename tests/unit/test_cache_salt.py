"""A request's cache salt keeps every cache apart: processed images, embeddings and KV are shared only
between requests with the same salt (or none), so no timing tells one salt what another sent."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mmserve.config import EngineConfig
from mmserve.engine import Engine, EngineStats
from tests.unit.test_engine import chat
from tests.unit.test_parity import data_url, make_image

IMAGE = data_url(make_image(300, 200, seed=77))  # NOTE: no other test sends it


@pytest.fixture(scope="module")
def engine(tiny_ckpt_224):
    eng = Engine(EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048))
    yield eng
    eng.shutdown()


def ask(engine: Engine, request_id: str, salt: str | None, text: str = "What is this?") -> tuple[str, EngineStats]:
    [out] = engine.generate([replace(chat(request_id, IMAGE, text=text), cache_salt=salt)])
    return out.text, engine.stats()


def made(before: EngineStats, after: EngineStats) -> tuple[int, int, int]:
    """(image processor calls, vision forwards, ProcessorCache hits) between two stats."""
    return (after.image_processor_calls - before.image_processor_calls,
            after.encoder.forward_passes - before.encoder.forward_passes,
            after.processor_cache.hits - before.processor_cache.hits)


def test_another_salt_processes_and_encodes_the_image_again(engine):
    start = engine.stats()
    first, a = ask(engine, "a1", "tenant-a")
    assert made(start, a) == (1, 1, 0)
    other, b = ask(engine, "b1", "tenant-b")
    assert made(a, b) == (1, 1, 0)  # nothing of tenant-a's image served tenant-b
    assert other == first  # the same answer all the same
    _, a2 = ask(engine, "a2", "tenant-a", text="And now?")
    assert made(b, a2) == (0, 0, 1)  # its own salt's image: a hit, no forward
    _, plain = ask(engine, "u1", None)
    assert made(a2, plain) == (1, 1, 0)  # no salt is a tenant of its own too


def test_the_item_keys_carry_the_salt(engine):
    keys = {salt: engine.preprocess(replace(chat("k", IMAGE), cache_salt=salt)).features[0].identifier
            for salt in (None, "tenant-a", "tenant-b")}
    assert len(set(keys.values())) == 3
    assert engine.preprocess(replace(chat("k2", IMAGE), cache_salt="tenant-a")).features[0].identifier \
        == keys["tenant-a"]
