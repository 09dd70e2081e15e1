"""The app's readiness, as the ingress's GET /health reports it.

Owns: which deployments of the app have no running replica, and why (Serve's status and message of each:
still starting, or failed), from `serve.status()`, asked of Serve's controller at most once per
`HEALTH_STATUS_TTL_S` however many probes come, one call at a time, within `HEALTH_STATUS_TIMEOUT_S`. Does
not own the HTTP answer (the ingress) nor a replica's own health (each deployment's `check_health`).

NOTE: this is readiness (can the app serve a request end to end); a load balancer's or kubelet's liveness
check of an ingress node is Serve's own `/-/healthz` on its proxy (docs/deploying.md), which asks no stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

log = logging.getLogger(__name__)

# NOTE: serve.status() is an RPC to Serve's controller: probes from every load balancer and kubelet
# share one answer for this long instead of each making one.
HEALTH_STATUS_TTL_S = 2.0
# NOTE: a controller restarting (or a head node down under GCS fault tolerance) does not answer, while the
# replicas go on serving: the last answer stands for STALE_S; a probe with none that recent waits this long
STATUS_TIMEOUT_S = 3.0
STALE_S = 60.0
GRACE_S = 0.3  # what a probe with a recent answer waits for the call under way (kubelet's probes time out at 1 s)
MESSAGE_CHARS = 300  # of a failed deployment's message, in the answer


@dataclass(frozen=True)
class Readiness:
    waiting_for: list[str]  # deployments of the app with no running replica (names; [] = ready)
    failed: dict[str, str]  # of those, the ones Serve reports failed or unhealthy: name -> "STATUS: message"
    stale_s: float | None = None  # the answer's age where the controller did not answer this probe (s)

    @property
    def ready(self) -> bool:
        return not self.waiting_for


# a deployment's statuses while Serve holds the replicas it wants, or moves to them by load (not a deploy)
SETTLED = ("HEALTHY", "UPSCALING", "DOWNSCALING")


def deployments_without_replicas(status: Any, app_name: str, may_idle: frozenset[str] = frozenset()) -> list[str]:
    """Deployments of `app_name` with no RUNNING replica in a `serve.status()` (all, if the app is unknown), but
    those of `may_idle` (autoscaled down to zero replicas) while Serve reports them settled: an app scaled to zero
    is ready, and a load balancer that took it out for that would send it no request to scale up for."""
    app = status.applications.get(app_name)
    if app is None:
        return [f"application {app_name!r}"]
    return sorted(name for name, d in app.deployments.items()
                  if not any(state == "RUNNING" and n > 0 for state, n in d.replica_states.items())
                  and not (name in may_idle and _status_name(d) in SETTLED))


def _status_name(deployment: Any) -> str:
    """A deployment's status as Serve names it ("HEALTHY", ...), whether an enum or a string."""
    return str(getattr(deployment, "status", "")).rsplit(".", 1)[-1]


def readiness(status: Any, app_name: str, may_idle: frozenset[str] = frozenset()) -> Readiness:
    """What /health says of a `serve.status()`: who has no running replica, and which of those failed."""
    waiting = deployments_without_replicas(status, app_name, may_idle)
    app = status.applications.get(app_name)
    failed = {}
    for name in waiting:
        deployment = app.deployments.get(name) if app is not None else None
        state = _status_name(deployment)
        if state in ("DEPLOY_FAILED", "UNHEALTHY"):
            failed[name] = f"{state}: {str(getattr(deployment, 'message', ''))[:MESSAGE_CHARS]}"
    return Readiness(waiting, failed)


class AppHealth:
    def __init__(self, status: Callable[[], Any] = serve.status, app_name: Callable[[], str] | None = None,
                 timeout_s: float = STATUS_TIMEOUT_S, grace_s: float = GRACE_S,
                 may_idle: frozenset[str] = frozenset()) -> None:
        self._ask_status = status  # a blocking call: Serve's controller's answer
        self.may_idle = may_idle  # deployments autoscaled with min_replicas 0 (`deployments_without_replicas`)
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self._app_name = app_name or (lambda: serve.get_replica_context().app_name)
        self._status: tuple[float, Any] | None = None  # (monotonic s, the status) of the last answer
        self._asking: asyncio.Task | None = None  # the one call to the controller, under way or the last
        self._asked_at = 0.0  # when that call began (monotonic s)
        self._error: Exception | None = None  # how that call failed; None: it answered (or is under way)

    async def check(self) -> Readiness:
        """This replica's app's readiness; raises TimeoutError when the controller has neither answered nor
        answered within STALE_S before (its reason says which: silent, or failing)."""
        now = time.monotonic()
        if self._asking is None or (self._asking.done() and now - self._asked_at > HEALTH_STATUS_TTL_S):
            self._asked_at, self._asking = now, asyncio.ensure_future(self._ask())
        if not self._asking.done():  # NOTE: shielded: a probe that stops waiting leaves the call to the next ones
            wait = self.grace_s if self._recent(now) else self.timeout_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._asking), wait)
        now = time.monotonic()
        if not self._recent(now):
            raise TimeoutError(self._why_not())
        assert self._status is not None
        answer = readiness(self._status[1], self._app_name(), self.may_idle)
        fresh = self._asking.done() and self._error is None
        return answer if fresh else Readiness(answer.waiting_for, answer.failed, now - self._status[0])

    def _recent(self, now: float) -> bool:
        return self._status is not None and now - self._status[0] <= STALE_S

    def _why_not(self) -> str:
        if self._asking is not None and not self._asking.done():
            return f"Serve's controller did not answer within {self.timeout_s:g} s"
        return f"Serve's status call failed: {self._error!r}"[:MESSAGE_CHARS]

    async def answer(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of GET /health: 200 `ok`; else 503 `starting` (deployments with no running
        replica yet, named), `failed` (one of them failed, with Serve's message) or `unknown` (no answer)."""
        try:
            ready = await self.check()
        except TimeoutError as exc:
            return 503, {"status": "unknown", "reason": str(exc)}
        body: dict[str, Any] = {"status": "ok"} if ready.ready else {
            "status": "failed" if ready.failed else "starting", "waiting_for": ready.waiting_for}
        if ready.failed:
            body["failed"] = ready.failed
        if ready.stale_s is not None:  # NOTE: the controller did not answer this probe; the replicas still serve
            body["as_of_s_ago"] = round(ready.stale_s, 1)
        return (200 if ready.ready else 503), body

    async def _ask(self) -> None:
        try:
            status = await asyncio.to_thread(self._ask_status)
        except Exception as exc:  # NOTE: kept for the answer's reason; the next call is a TTL later
            self._error = exc
            log.warning("/health: Serve's status call failed: %r", exc)
            return
        self._status, self._error = (time.monotonic(), status), None
