"""The app builder's process-wide defaults: a Ray cluster that `serve run` starts after building the app gets
mmserve's cluster environment (bodies inline up to the Ingress's limit, Serve's loops at a slower pace; HAProxy in
front of the Ingress only by opt-in)."""

from __future__ import annotations

import os

import pytest

from deployments import app, cluster_env
from deployments.cluster_env import CLUSTER_ENV
from deployments.stage_args import INGRESS_INLINE_BYTES

KEY = "RAY_max_direct_call_object_size"
HA = "RAY_SERVE_ENABLE_HA_PROXY"


def test_a_cluster_started_after_the_build_gets_the_cluster_env_and_a_users_value_or_a_running_ray_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in CLUSTER_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(HA, raising=False)
    monkeypatch.setattr(cluster_env.ray, "is_initialized", lambda: False)
    app.cluster_env_started_here()  # NOTE: the name build_app calls
    assert os.environ[KEY] == str(INGRESS_INLINE_BYTES)
    assert (os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"], os.environ["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"]) == (
        "0.5", "1000")  # Serve's controller and metrics flushes at a slower pace (deployments/cluster_env.py)
    assert HA not in os.environ  # HAProxy's mode is an opt-in (docs/deploying.md)

    monkeypatch.setenv(KEY, "4096")  # the user's own choices
    monkeypatch.setenv(HA, "1")
    app.cluster_env_started_here()
    assert (os.environ[KEY], os.environ[HA]) == ("4096", "1")
    monkeypatch.delenv(HA)

    for key in CLUSTER_ENV:
        monkeypatch.delenv(key)
    monkeypatch.setattr(cluster_env.ray, "is_initialized", lambda: True)  # too late: the cluster has its settings
    app.cluster_env_started_here()
    assert not set(CLUSTER_ENV) & set(os.environ)


def test_a_text_only_gemma3_checkpoint_is_refused_by_the_builder_naming_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    import json
    from pathlib import Path

    folder = Path(str(tmp_path))
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    monkeypatch.setattr(app, "cluster_env_started_here", lambda: None)
    with pytest.raises(ValueError, match="text-only Gemma 3"):
        app.build_app({"model": str(folder)})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama' is not supported"):
        app.build_app({"model": str(folder)})


def test_a_model_under_the_home_folder_is_found_as_a_shell_would_and_an_empty_one_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    import json
    from pathlib import Path

    from mmserve.config import EngineConfig
    from mmserve.models.registry import checkpoint_dir

    home = Path(str(tmp_path))
    (home / "ckpt").mkdir()
    (home / "ckpt" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(app, "cluster_env_started_here", lambda: None)
    assert checkpoint_dir("~/ckpt") == str(home / "ckpt")
    with pytest.raises(ValueError, match="'llama' is not supported"):  # read at build: the folder was found
        app.build_app({"model": "~/ckpt"})
    with pytest.raises(ValueError, match="model is empty"):
        EngineConfig(model=" ")


def test_each_stage_is_given_the_drain_budget_of_its_longest_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Encoder waits out a step with lost pixels (a downscale cut those encodes, and the Decoders' retries
    with them), Preprocess its fetches, the Decoder and the Ingress a request's whole life."""
    from deployments.args import LOST_PIXELS_STEP_S
    from deployments.stage_args import SERVE_CALL_S, SHUTDOWN_HOOK_S

    given: dict[str, dict] = {}

    class Recorded:
        def __init__(self, deployment: object) -> None:
            self.name = str(getattr(deployment, "name", ""))  # a Serve Deployment's

        def options(self, **options: object) -> Recorded:
            given[self.name] = options
            return self

        def bind(self, *args: object) -> Recorded:
            return self

    monkeypatch.setattr(app, "cluster_env_started_here", lambda: None)
    monkeypatch.setattr(app, "_deployment", Recorded)
    app.build_app({"ingress.request_timeout_s": "120"})
    budget = {name: options["graceful_shutdown_timeout_s"] for name, options in given.items()}
    assert budget["Encoder"] == LOST_PIXELS_STEP_S + SERVE_CALL_S + SHUTDOWN_HOOK_S
    assert budget["Decoder"] == budget["Ingress"] == 120 + SHUTDOWN_HOOK_S
    assert budget["Preprocess"] == 10 + SERVE_CALL_S + SHUTDOWN_HOOK_S  # media.fetch_timeout_s 10
