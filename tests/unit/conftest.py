"""Fixtures of the unit tests: an in-process Engine on the tiny checkpoint with the default config."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mmserve.config import EngineConfig
from mmserve.engine import Engine


@pytest.fixture(scope="module")
def default_engine(tiny_ckpt_224) -> Iterator[Engine]:
    eng = Engine(EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048))
    yield eng
    eng.shutdown()
