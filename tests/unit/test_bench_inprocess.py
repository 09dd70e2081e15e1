"""scripts/bench_lib/inprocess.py: the stage timers wrap an Engine without changing how it is called (they
once took fewer arguments than the Engine passes, and every in-process cell failed)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_lib.inprocess import StageTimers

from mmserve.config import EngineConfig
from mmserve.engine import Engine
from tests.unit.test_engine import IMAGE, chat


def test_timed_stages_serve_a_request_and_time_each_stage(tiny_ckpt_224: Path) -> None:
    with Engine(EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048)) as eng:
        timers = StageTimers(eng)

        async def run() -> list:
            return [o async for o in eng.stream(chat("timed", IMAGE, max_tokens=3, ignore_eos=True))]

        outs = asyncio.run(run())
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 3
        events = timers.events["timed"]
        assert events["pre_start"] <= events["pre_end"] <= events["enc_end"]
        assert timers.forwards and timers.prefill_steps["timed"]
