"""The environment mmserve wants every Ray node to start with, and giving it to a Ray that `serve run` starts.

Owns: `CLUSTER_ENV` (request bodies inline everywhere, Serve's own loops at a slower pace) and
`cluster_env_started_here`. Serve has no per-app setting for a node's environment, so clusters started on
their own get the same values from their start commands (cluster.yaml, the RayService's containers,
docs/deploying.md). Does not own a replica's own environment (`<stage>.env`, deployments/stage_args.py).
"""

from __future__ import annotations

import os

import ray

from deployments.stage_args import INGRESS_INLINE_BYTES

# Seconds between the Serve controller's passes over the cluster's state (Ray's default 0.1).
# NOTE: each pass costs the controller's CPU whether anything changed or not: idle, the controller was the
# busiest of a small node's Ray processes, and at 0.5 s it took much less (docs/benchmarks.md).
# What waits for a pass (a replica started or replaced, an autoscaling decision, a route change reaching the
# proxies) waits up to 0.4 s longer; health checks keep their own period (10 s).
SERVE_CONTROL_LOOP_INTERVAL_S = 0.5
# Milliseconds between flushes of Serve's cached metrics to Ray's metrics (Ray's default 100), in every replica and
# every handle's router. NOTE: each flush wakes a loop in each of those processes; at 1,000 ms a small node's
# Ray processes took less CPU and woke less often (docs/benchmarks.md).
# Prometheus reads them every 10 s or so; mmserve's own /metrics (the MetricsHub) and Serve's autoscaling
# metrics have pushes of their own, untouched.
SERVE_METRICS_EXPORT_INTERVAL_MS = 1000
# The environment mmserve wants every Ray node to start with (Serve has no per-app setting for it): bodies
# inline as above, in Serve's own processes too, and Serve's loops at the paces above.
# NOTE: HAProxy's mode (`RAY_SERVE_ENABLE_HA_PROXY=1`) is not in it: the Decoder ran slower beside it on the
# benchmark checkpoint, and its HAProxy binds fixed ports (8404, 9101), so a second Ray in that mode on one
# machine fails to start. docs/deploying.md has how to opt in and what it gains.
CLUSTER_ENV = {"RAY_max_direct_call_object_size": str(INGRESS_INLINE_BYTES),
               "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": str(SERVE_CONTROL_LOOP_INTERVAL_S),
               "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": str(SERVE_METRICS_EXPORT_INTERVAL_MS)}


def cluster_env_started_here() -> None:
    """Give a Ray cluster that this process is about to start mmserve's cluster environment (`CLUSTER_ENV`:
    request bodies up to `INGRESS_INLINE_BYTES` inline everywhere, Serve's proxy included, and Serve's
    controller and metrics flushes at their slower paces); a value already set is kept. (HAProxy in front of the
    Ingress is an opt-in of the same kind: docs/deploying.md.)

    NOTE: `serve run <import path>` builds the app before it starts Ray, and the local cluster it starts
    inherits this process's environment. Serve has no per-app setting for it: the proxy's reply to the
    Ingress carries the body (a data URL's image) through the object store past Ray's 100 KiB default. A Ray
    already running is left alone (`ray start` clusters and
    config files: docs/deploying.md).
    """
    if not ray.is_initialized():
        for key, value in CLUSTER_ENV.items():
            os.environ.setdefault(key, value)
