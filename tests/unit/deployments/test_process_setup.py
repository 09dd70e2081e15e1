"""replica_logs.py: the engine's and the deployments' own records from INFO up (start-up measurements, a 500's
traceback, a retry) reach a replica's Serve log, once each."""

from __future__ import annotations

import logging

import pytest

from deployments.replica_logs import ROUTED, route_logs


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def loggers():
    routed, serve_logger = [logging.getLogger(name) for name in ROUTED], logging.getLogger("ray.serve")
    saved = [(log.level, log.propagate, list(log.handlers)) for log in routed]
    serving, level = list(serve_logger.handlers), serve_logger.level
    yield routed[0], serve_logger
    for log, (level, propagate, handlers) in zip(routed, saved, strict=True):
        log.setLevel(level)
        log.propagate = propagate
        log.handlers[:] = handlers
    serve_logger.handlers[:] = serving
    serve_logger.setLevel(level)


def test_engine_info_records_go_through_serves_handlers_once(loggers) -> None:
    _, serve_logger = loggers
    captured = _Captured()
    serve_logger.handlers[:] = [captured]
    serve_logger.setLevel(logging.INFO)
    route_logs()
    route_logs()  # a second stage in the same process adds nothing twice
    logging.getLogger("mmserve.runtime.step_threads").info("step threads: %d", 1)
    logging.getLogger("deployments.ingress_failures").warning("request failed with a server fault")
    logging.getLogger("deployments.retry").info("replica lost; retry")
    assert captured.messages == ["step threads: 1", "request failed with a server fault", "replica lost; retry"]


def test_a_changed_logging_config_is_followed_handlers_and_level(loggers) -> None:
    """Serve replaces `ray.serve`'s handlers (and sets its level) when a deployment's logging_config changes."""
    _, serve_logger = loggers
    old, new = _Captured(), _Captured()
    serve_logger.handlers[:] = [old]
    serve_logger.setLevel(logging.INFO)
    route_logs()
    serve_logger.handlers[:] = [new]
    serve_logger.setLevel(logging.WARNING)
    logging.getLogger("deployments.retry").info("replica lost; retry")
    logging.getLogger("deployments.ingress_failures").warning("request failed with a server fault")
    assert old.messages == [] and new.messages == ["request failed with a server fault"]


def test_outside_serve_nothing_changes(loggers) -> None:
    engine, serve_logger = loggers
    serve_logger.handlers[:] = []
    before = (engine.level, engine.propagate, list(engine.handlers))
    route_logs()
    assert (engine.level, engine.propagate, list(engine.handlers)) == before


def test_every_replica_routes_its_logs_first() -> None:
    """Each deployment's constructor starts by routing its logs (a step replica's through its process set-up)."""
    import inspect

    from deployments.cache_store import ProcessorCacheStore
    from deployments.decoder import Decoder
    from deployments.encoder import Encoder
    from deployments.ingress import Ingress
    from deployments.metrics_hub import MetricsHub
    from deployments.preprocess import Preprocess

    for deployment in (Ingress, Preprocess, ProcessorCacheStore, MetricsHub, Encoder, Decoder):
        cls = getattr(deployment, "func_or_class", deployment)  # NOTE: a Serve Deployment wraps its class
        # NOTE: `serve.ingress` subclasses it with a constructor of its own, which calls ours
        init = next(init for c in cls.__mro__ if inspect.isfunction(init := vars(c).get("__init__"))
                    and init.__code__.co_filename.endswith(f"{cls.__module__.replace('.', '/')}.py"))
        first = inspect.getsource(init).split(":\n", 1)[1].strip().splitlines()[0]
        assert first in ("route_logs()", "configure_step_process(app_args.encoder)",
                         "configure_step_process(app_args.decoder)"), (deployment, first)
