"""What an Encoder and a Decoder replica share as Serve sees them: the health probe of their step thread and
their graceful shutdown.

Owns: `check_health` (a dead step thread, or a step that outlived any request's deadline, fails it) and `__del__`
(the last metrics, then the step thread joined). Does not own the stage (mmserve's services) nor the metrics.
"""

from __future__ import annotations

from typing import Any


class StepReplica:
    """A mixin for a replica whose `service` runs a step loop and whose `reporter` pushes its metrics; it sets
    `stuck_after_s` (AppArgs.hung_step_s)."""

    service: Any
    stuck_after_s: float

    def check_health(self) -> None:
        """Serve's periodic probe: a replica whose step thread died, or whose step outlived any request's
        deadline (a hung device), is replaced."""
        self.service.check_health(self.stuck_after_s)

    async def __del__(self) -> None:
        """Serve calls this on the replica's graceful shutdown: the last metrics, then join the step thread (see
        StepLoop.stop)."""
        reporter, service = getattr(self, "reporter", None), getattr(self, "service", None)  # None: __init__ failed
        if reporter is not None:
            await reporter.close()
        if service is not None:
            service.stop()
