"""What an Encoder and a Decoder replica share as Serve sees them: the health probe of their step thread and
their graceful shutdown.

Owns: `check_health` (a dead step thread, or a step that outlived any request's deadline, fails it; after a
dead step thread the replica's process exits) and `__del__` (the last metrics, then the step thread joined). Does
not own the stage (mmserve's services) nor the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
EXIT_AFTER_S = 1.0  # from a failed probe to the process's exit: Serve has its answer first (s)


class StepReplica:
    """A mixin for a replica whose `service` runs a step loop and whose `reporter` pushes its metrics; it sets
    `stuck_after_s` (AppArgs.hung_step_s)."""

    service: Any
    stuck_after_s: float
    exit_process: Callable[[int], object] = staticmethod(os._exit)  # NOTE: a test's stand-in replaces it
    _exiting: threading.Timer | None = None  # the exit under way, once the step thread died

    def watch_step_thread(self) -> None:
        """Exit soon after the step thread dies, not at Serve's next probe (seconds later): meanwhile the replica
        would answer every call at once with StageStopped, and a router that sends work to the least loaded, or to
        the owner of a request's cache entries, would keep choosing it. Called once `service` is set."""
        self.service.loop.on_death = self._exit_soon

    def check_health(self) -> None:
        """Serve's periodic probe: a replica whose step thread died, or whose step outlived any request's
        deadline (a hung device), is replaced.

        NOTE: Serve stops an unhealthy replica gracefully, waiting out the calls it holds for up to its
        `graceful_shutdown_timeout_s` (for a Decoder, as long as a request may live). After a dead step thread
        those calls will never be answered: the process exits once the probe has failed, so that they fail over
        at once as on any replica's loss (a request not yet streaming is retried on a live replica). A step
        over the bound may still end (the probe passes again, and Serve replaces a replica only after several
        failed probes): no exit; by then every request in it has had its deadline and left it anyway.
        """
        try:
            self.service.check_health(self.stuck_after_s)
        except Exception:
            if self.service.loop.died():
                self._exit_soon()
            raise

    def _exit_soon(self) -> None:
        """Exit the process in EXIT_AFTER_S (once): the failures already delivered reach their callers first."""
        if self._exiting is not None:
            return
        log.error("the step thread died: the replica's process exits in %.1f s", EXIT_AFTER_S)
        self._exiting = threading.Timer(EXIT_AFTER_S, self.exit_process, args=(1,))
        self._exiting.daemon = True
        self._exiting.start()

    async def __del__(self) -> None:
        """Serve calls this on the replica's graceful shutdown: the last metrics, then join the step thread (see
        StepLoop.stop)."""
        reporter, service = getattr(self, "reporter", None), getattr(self, "service", None)  # None: __init__ failed
        if reporter is not None:
            await reporter.close()
        if service is not None:  # NOTE: off the loop: the step thread may wait on it (a call through a handle)
            await asyncio.to_thread(service.stop)
