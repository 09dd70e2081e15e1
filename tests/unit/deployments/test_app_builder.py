"""The app builder's one process-wide default: a Ray cluster that `serve run` starts after building the app
passes request bodies inline up to the Ingress's limit."""

from __future__ import annotations

import os

import pytest

from deployments import app
from deployments.args import INGRESS_INLINE_BYTES

KEY = "RAY_max_direct_call_object_size"


def test_a_cluster_started_after_the_build_inlines_bodies_and_a_users_value_or_a_running_ray_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY, raising=False)
    monkeypatch.setattr(app.ray, "is_initialized", lambda: False)
    app.inline_bodies_in_a_cluster_started_here()
    assert os.environ[KEY] == str(INGRESS_INLINE_BYTES)

    monkeypatch.setenv(KEY, "4096")  # the user's own choice
    app.inline_bodies_in_a_cluster_started_here()
    assert os.environ[KEY] == "4096"

    monkeypatch.delenv(KEY)
    monkeypatch.setattr(app.ray, "is_initialized", lambda: True)  # too late: the cluster has its settings
    app.inline_bodies_in_a_cluster_started_here()
    assert KEY not in os.environ
