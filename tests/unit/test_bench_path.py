"""scripts/bench_lib/path.py and bench_path.py: a served stream's per-token span ends where the in-process one
does (the choice's last output, with or without text), and each pair's order turns rep by rep."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_path
from bench_lib.path import Timed, served


class Stream:
    """A client whose stream answers four tokens: text at 1, 2 and 3 s, then a last chunk without text at 4 s."""

    def stream(self, path: str, body: dict[str, Any]) -> tuple[float, list[tuple[float, str]], dict[str, str]]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        events = [(1.0, chunk({"role": "assistant", "content": "a"})), (2.0, chunk({"content": "b"})),
                  (3.0, chunk({"content": "c"})), (4.0, chunk({}, "length")),
                  (4.1, json.dumps({"choices": [], "usage": {"completion_tokens": 4}})), (4.2, "[DONE]")]
        return 0.0, events, {}


def test_a_served_streams_span_ends_at_the_chunk_that_finishes_it() -> None:
    timed = served(Stream(), [], 4)  # a Client as far as `served` reads one
    assert timed.ttft_ms == 1e3
    assert timed.per_token_ms == 1e3  # (4 s - 1 s) / 3 gaps: not (3 s - 1 s) / 3


def test_each_pair_runs_its_sides_in_turn() -> None:
    ran: list[str] = []

    def side(name: str) -> Timed:
        ran.append(name)
        return Timed(1.0 if name == "here" else 2.0, None, {})

    for rep in range(2):  # (in process, served) whichever ran first
        assert [t.ttft_ms for t in bench_path.pair(lambda: side("here"), lambda: side("there"), rep)] == [1.0, 2.0]
    assert ran == ["here", "there", "there", "here"]
