"""The app's readiness, as the ingress's GET /health reports it.

Owns: which deployments of the app have no running replica yet, from `serve.status()`, asked of Serve's
controller at most once per `HEALTH_STATUS_TTL_S` however many probes come. Does not own the HTTP answer
(the ingress) nor a replica's own health (each deployment's `check_health`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray import serve

# NOTE: serve.status() is an RPC to Serve's controller: probes from every load balancer and kubelet
# share one answer for this long instead of each making one.
HEALTH_STATUS_TTL_S = 2.0


def deployments_without_replicas(status: Any, app_name: str) -> list[str]:
    """Deployments of `app_name` with no RUNNING replica in a `serve.status()` (all, if the app is unknown)."""
    app = status.applications.get(app_name)
    if app is None:
        return [f"application {app_name!r}"]
    return sorted(name for name, d in app.deployments.items()
                  if not any(state == "RUNNING" and n > 0 for state, n in d.replica_states.items()))


class AppHealth:
    def __init__(self) -> None:
        self._status: tuple[float, Any] | None = None  # (monotonic s, serve.status()) of the last probe

    async def waiting_for(self) -> list[str]:
        """The deployments of this replica's app that have no running replica yet ([] once all do)."""
        now = time.monotonic()
        if self._status is None or now - self._status[0] > HEALTH_STATUS_TTL_S:
            self._status = (now, await asyncio.to_thread(serve.status))
        return deployments_without_replicas(self._status[1], serve.get_replica_context().app_name)
