"""process_setup.py: the engine's INFO records (its start-up measurements) reach a replica's Serve log."""

from __future__ import annotations

import logging

import pytest

from deployments.process_setup import route_engine_logs


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def loggers():
    engine, serve_logger = logging.getLogger("mmserve"), logging.getLogger("ray.serve")
    saved = (engine.level, engine.propagate, list(engine.handlers), list(serve_logger.handlers))
    yield engine, serve_logger
    engine.setLevel(saved[0])
    engine.propagate = saved[1]
    engine.handlers[:] = saved[2]
    serve_logger.handlers[:] = saved[3]


def test_engine_info_records_go_through_serves_handlers_once(loggers) -> None:
    _, serve_logger = loggers
    captured = _Captured()
    serve_logger.handlers[:] = [captured]
    route_engine_logs()
    route_engine_logs()  # a second stage in the same process adds nothing twice
    logging.getLogger("mmserve.runtime.step_threads").info("step threads: %d", 1)
    assert captured.messages == ["step threads: 1"]


def test_outside_serve_nothing_changes(loggers) -> None:
    engine, serve_logger = loggers
    serve_logger.handlers[:] = []
    before = (engine.level, engine.propagate, list(engine.handlers))
    route_engine_logs()
    assert (engine.level, engine.propagate, list(engine.handlers)) == before
