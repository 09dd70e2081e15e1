"""The application builder: `serve run deployments.app:build_app [model=DIR] [stage.option=value ...]`.

Owns: composing the deployments (Ingress -> Preprocess -> Decoder -> Encoder, Preprocess's early encodes to
the Encoder, with the shared ProcessorCacheStore and the MetricsHub) and applying each stage's placement
from the arguments; and the process-wide defaults for a Ray that `serve run` starts after building the app
(deployments/cluster_env.py).
Does not own argument names or defaults (args.py, stage_args.py) nor any stage's logic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from ray.serve import Application, Deployment
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from deployments.args import parse_args
from deployments.cache_store import ProcessorCacheStore
from deployments.cluster_env import cluster_env_started_here
from deployments.decoder import Decoder
from deployments.encoder import Encoder
from deployments.ingress import Ingress
from deployments.metrics_hub import MetricsHub
from deployments.preprocess import Preprocess
from mmserve.errors import OverloadedError
from mmserve.models.registry import served_model_type


def _deployment(decorated: Any) -> Deployment:
    """NOTE: `@serve.deployment` turns each class into a `Deployment`, but mypy still sees the class."""
    return cast(Deployment, decorated)


def _router(config: dict[str, Any]) -> dict[str, Any]:
    """`.options` for a stage's request router; none (Serve's default) for an empty config."""
    return {"request_router_config": RequestRouterConfig(**config)} if config else {}


def build_app(args: dict[str, Any] | None = None) -> Application:
    cluster_env_started_here()
    app_args = parse_args(args or {})  # NOTE: model None: each replica finds or builds the tiny checkpoint
    config_path = Path(app_args.engine.model or "").expanduser() / "config.json"
    if app_args.engine.model is not None and config_path.exists():  # NOTE: else only the replicas' nodes have it
        served_model_type(config_path)  # a checkpoint no family serves is refused here, not by each replica
    hub = _deployment(MetricsHub).bind()
    store = _deployment(ProcessorCacheStore).bind(app_args.engine.processor_cache.capacity_bytes, hub,
                                                  app_args.metrics_push_interval_s)
    encoder = _deployment(Encoder).options(**app_args.encoder.deployment_options(app_args.encoder_call_s()), **_router(
        app_args.encoder.router("deployments.routers:EncoderAffinityRouter"))).bind(app_args, store, hub)
    preprocess = _deployment(Preprocess).options(**app_args.preprocess.deployment_options(
        app_args.preprocess_call_s())).bind(app_args, store, hub, encoder)
    # NOTE: the decoder's index of routed prompt blocks holds about what its KV pool caches
    holds_for_s = app_args.ingress.request_timeout_s  # a Decoder holds a request to its last token
    decoder = _deployment(Decoder).options(**app_args.decoder.deployment_options(holds_for_s), **_router(
        app_args.decoder.router("deployments.routers:DecoderAffinityRouter",
                                index_blocks=app_args.engine.decoder.num_blocks))).bind(app_args, encoder, hub)
    # NOTE: Serve's own refusals at the Ingress (its probe slots full too) carry a Retry-After as well
    ingress = _deployment(Ingress).options(**app_args.ingress.deployment_options(), backpressure_config=(
        BackpressureConfig(retry_after_s=OverloadedError.retry_after_s)))
    return ingress.bind(app_args, preprocess, decoder, hub)
