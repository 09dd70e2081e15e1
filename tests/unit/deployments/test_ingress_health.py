"""The ingress's rules: readiness behind GET /health (every deployment of the app has a running
replica) and how a failed request is counted."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from deployments.app_health import deployments_without_replicas
from deployments.ingress_failures import failure_status


def _status(**deployments: dict[str, int]) -> SimpleNamespace:
    app = SimpleNamespace(deployments={name: SimpleNamespace(replica_states=states)
                                       for name, states in deployments.items()})
    return SimpleNamespace(applications={"mm": app})


def test_ready_only_when_every_deployment_has_a_running_replica():
    assert deployments_without_replicas(_status(Ingress={"RUNNING": 1}, Decoder={"RUNNING": 2}), "mm") == []
    starting = _status(Ingress={"RUNNING": 1}, Preprocess={"STARTING": 1}, Decoder={"RUNNING": 0, "STARTING": 1})
    assert deployments_without_replicas(starting, "mm") == ["Decoder", "Preprocess"]


def test_a_rolling_update_keeps_it_ready_while_old_replicas_run():
    assert deployments_without_replicas(_status(Decoder={"RUNNING": 1, "STARTING": 1, "STOPPING": 1}), "mm") == []


def test_a_stage_autoscaled_to_zero_is_ready_while_serve_holds_it_settled():
    """A load balancer that took an app scaled to zero out would send it no request to scale up for."""
    def status(state: str) -> SimpleNamespace:
        app = SimpleNamespace(deployments={"Ingress": SimpleNamespace(replica_states={"RUNNING": 1}),
                                           "Decoder": SimpleNamespace(replica_states={}, status=state)})
        return SimpleNamespace(applications={"mm": app})

    idle = frozenset({"Decoder"})
    assert deployments_without_replicas(status("HEALTHY"), "mm", idle) == []
    assert deployments_without_replicas(status("DeploymentStatus.UPSCALING"), "mm", idle) == []
    assert deployments_without_replicas(status("HEALTHY"), "mm") == ["Decoder"]  # min_replicas above 0: starting
    assert deployments_without_replicas(status("UPDATING"), "mm", idle) == ["Decoder"]  # a deploy under way
    assert deployments_without_replicas(status("UNHEALTHY"), "mm", idle) == ["Decoder"]


def test_the_stages_that_may_idle_are_those_autoscaled_from_zero():
    import pytest

    from deployments.args import parse_args

    assert parse_args({}).may_idle() == frozenset()
    args = parse_args({"decoder.autoscaling": '{"min_replicas": 0, "max_replicas": 2, "initial_replicas": 1}',
                       "preprocess.autoscaling.min_replicas": "0", "preprocess.autoscaling.initial_replicas": "1"})
    assert args.may_idle() == frozenset({"Decoder", "Preprocess"})
    # NOTE: without a first replica Serve calls such a stage HEALTHY at once, and /health would say ready for a model
    # that never loaded
    with pytest.raises(ValueError, match="min_replicas 0 needs initial_replicas >= 1"):
        parse_args({"decoder.autoscaling": '{"min_replicas": 0, "max_replicas": 2}'})


def test_unknown_app_is_not_ready():
    assert deployments_without_replicas(_status(Ingress={"RUNNING": 1}), "other") == ["application 'other'"]


def test_a_failure_counts_by_the_http_status_its_error_maps_to():
    from mmserve.errors import InvalidRequestError, OverloadedError, ReplicaLostError

    assert failure_status(InvalidRequestError("bad image")) == "client_error"
    assert failure_status(RuntimeError("step failed")) == "server_error"
    assert failure_status(OverloadedError("a stage's queue is full")) == "overloaded"  # load shed, not a fault
    assert failure_status(ReplicaLostError("a serving replica was lost")) == "server_error"


def _failing_status() -> SimpleNamespace:
    status = _status(Ingress={"RUNNING": 1}, Decoder={"STARTING": 0}, Encoder={"STARTING": 1})
    app = status.applications["mm"]
    app.deployments["Decoder"].status, app.deployments["Decoder"].message = "DEPLOY_FAILED", "CUDA OOM " * 100
    app.deployments["Encoder"].status = "UPDATING"
    return status


def test_a_failed_deployment_is_named_with_serves_message_and_the_rest_as_starting():
    from deployments.app_health import MESSAGE_CHARS, AppHealth

    health = AppHealth(status=_failing_status, app_name=lambda: "mm")
    status, body = asyncio.run(health.answer())
    assert status == 503 and body["status"] == "failed" and body["waiting_for"] == ["Decoder", "Encoder"]
    assert list(body["failed"]) == ["Decoder"] and body["failed"]["Decoder"].startswith("DEPLOY_FAILED: CUDA OOM")
    assert len(body["failed"]["Decoder"]) <= len("DEPLOY_FAILED: ") + MESSAGE_CHARS
    ready = AppHealth(status=lambda: _status(Ingress={"RUNNING": 1}), app_name=lambda: "mm")
    assert asyncio.run(ready.answer()) == (200, {"status": "ok"})


def test_probes_share_one_call_and_a_silent_controller_is_answered_in_time():
    from deployments.app_health import AppHealth

    calls, release = [], threading.Event()

    def slow() -> SimpleNamespace:
        calls.append(1)
        release.wait(5)
        return _status(Ingress={"RUNNING": 1})

    health = AppHealth(status=slow, app_name=lambda: "mm", timeout_s=0.2)

    async def probes() -> list[tuple[int, dict]]:
        answers = await asyncio.gather(*(health.answer() for _ in range(10)))
        release.set()
        await asyncio.sleep(0.1)
        return [*answers, await health.answer()]

    *silent, later = asyncio.run(probes())
    assert len(calls) == 1  # ten probes, one call to the controller
    assert all(a == (503, {"status": "unknown", "reason": "Serve's controller did not answer within 0.2 s"})
               for a in silent)
    assert later == (200, {"status": "ok"})  # the call that went on answered the next probe


def test_a_controller_that_stops_answering_leaves_the_last_answer_standing_at_once():
    from deployments import app_health

    answers = iter([_status(Ingress={"RUNNING": 1})])
    hang = threading.Event()

    def status() -> SimpleNamespace:
        try:
            return next(answers)
        except StopIteration:
            hang.wait(5)
            raise RuntimeError("no controller") from None

    health = app_health.AppHealth(status=status, app_name=lambda: "mm", timeout_s=5, grace_s=0.05)

    async def run() -> tuple[tuple[int, dict], tuple[int, dict], float]:
        first = await health.answer()
        assert health._status is not None
        back = app_health.HEALTH_STATUS_TTL_S + 3
        health._status, health._asked_at = (health._status[0] - back, health._status[1]), health._asked_at - back
        started = time.monotonic()
        stale = await health.answer()  # NOTE: a call under way, hung; the last answer is recent enough
        waited = time.monotonic() - started
        hang.set()  # NOTE: the hung call ends (failing) before the loop closes
        return first, stale, waited

    first, stale, waited = asyncio.run(run())
    assert first == (200, {"status": "ok"})
    assert stale[0] == 200 and stale[1]["status"] == "ok" and stale[1]["as_of_s_ago"] >= 5
    assert waited < 2.0  # the grace, not the call's timeout (a kubelet's probe gives up at 1 s)


def test_a_failing_controller_is_named_as_failing_and_asked_again_only_after_the_ttl():
    from deployments.app_health import AppHealth

    calls: list[int] = []

    def failing() -> SimpleNamespace:
        calls.append(1)
        raise RuntimeError("controller gone")

    health = AppHealth(status=failing, app_name=lambda: "mm", timeout_s=5)

    async def probes() -> list[tuple[int, dict]]:
        return [await health.answer() for _ in range(3)]

    answers = asyncio.run(probes())
    assert calls == [1]  # one call per TTL, not one per probe
    why = "Serve's status call failed: RuntimeError('controller gone')"
    assert all(a == (503, {"status": "unknown", "reason": why}) for a in answers)
