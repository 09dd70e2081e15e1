"""Where a replica's own log records go: into its Serve log, in Serve's format, with its replica and request.

Owns: `route_logs`, called first by every replica's constructor. Does not own Serve's logging config (the
deployments' `logging_config`) nor what is logged.

NOTE: Serve gives handlers to its documented `ray.serve` logger only (and stops it propagating), and a replica's
root logger has none: a record of any other logger below WARNING is dropped, and one at WARNING or above goes
to Python's last-resort handler, a bare line in the worker's stderr file without time, level, replica or request
(a 500's traceback, a lost replica's retry, the step thread's death were all there and nowhere else).
NOTE: records are handed to `ray.serve` itself, not to copies of its handlers: Serve replaces its handlers when a
deployment's `logging_config` changes in place, and copies would keep writing through the old ones.
"""

from __future__ import annotations

import logging

ROUTED = ("mmserve", "deployments")  # the engine's loggers and this package's own
SERVE_LOGGER = "ray.serve"


class _ToServe(logging.Handler):
    """Hands each record to `ray.serve`'s handlers as they are when it comes, at `ray.serve`'s level then."""

    def emit(self, record: logging.LogRecord) -> None:
        serve_logger = logging.getLogger(SERVE_LOGGER)
        if record.levelno >= serve_logger.getEffectiveLevel():
            serve_logger.handle(record)


def route_logs() -> None:
    """The ROUTED loggers' records go through `ray.serve`'s handlers, once each, from the deployment's log level
    (`logging_config.log_level`, INFO by default). Outside a Serve replica (no such handlers) nothing changes."""
    serve_logger = logging.getLogger(SERVE_LOGGER)
    if not serve_logger.handlers:
        return
    for name in ROUTED:
        routed = logging.getLogger(name)
        routed.setLevel(serve_logger.getEffectiveLevel())
        if not any(isinstance(h, _ToServe) for h in routed.handlers):
            routed.addHandler(_ToServe())
        routed.propagate = False  # NOTE: each record once, in Serve's format
