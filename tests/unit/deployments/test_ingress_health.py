"""The ingress's rules: readiness behind GET /health (every deployment of the app has a running
replica) and how a failed request is counted."""

from __future__ import annotations

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


def test_unknown_app_is_not_ready():
    assert deployments_without_replicas(_status(Ingress={"RUNNING": 1}), "other") == ["application 'other'"]


def test_a_failure_counts_by_the_http_status_its_error_maps_to():
    from mmserve.errors import InvalidRequestError, OverloadedError, ReplicaLostError

    assert failure_status(InvalidRequestError("bad image")) == "client_error"
    assert failure_status(RuntimeError("step failed")) == "server_error"
    assert failure_status(OverloadedError("a stage's queue is full")) == "overloaded"  # load shed, not a fault
    assert failure_status(ReplicaLostError("a serving replica was lost")) == "server_error"
