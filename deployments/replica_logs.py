"""Where a replica's own log records go: into its Serve log, in Serve's format, with its replica and request.

Owns: `route_logs`, called first by every replica's constructor. Does not own Serve's logging config (the
deployments' `logging_config`) nor what is logged.

NOTE: Serve gives handlers to its documented `ray.serve` logger only (and stops it propagating), and a replica's
root logger has none: a record of any other logger below WARNING is dropped, and one at WARNING or above goes
to Python's last-resort handler, a bare line in the worker's stderr file without time, level, replica or request
(a 500's traceback, a lost replica's retry, the step thread's death were all there and nowhere else).
"""

from __future__ import annotations

import logging

ROUTED = ("mmserve", "deployments")  # the engine's loggers and this package's own


def route_logs() -> None:
    """Records from INFO up of the ROUTED loggers go through the handlers Serve gives `ray.serve`, once each.
    Outside a Serve replica (no such handlers) nothing changes."""
    serve_logger = logging.getLogger("ray.serve")
    if not serve_logger.handlers:
        return
    for name in ROUTED:
        routed = logging.getLogger(name)
        routed.setLevel(logging.INFO)
        for handler in serve_logger.handlers:
            if handler not in routed.handlers:
                routed.addHandler(handler)
        routed.propagate = False  # NOTE: each record once, in Serve's format
