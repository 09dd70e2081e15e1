"""The HTTP systems under test, each started and stopped by the benchmark itself.

Owns: how each server is launched on a free port, when it is ready, what its process tree is, and how a
`BenchRequest` becomes the keyword arguments of `chat.completions.create` for it:

- mmserve: `serve run` of `deployments.app:build_app` on a fresh local Ray (private RAY_TMPDIR),
  greedy, `ignore_eos`, pan-and-scan through `mm_processor_kwargs`, usage via `stream_options`.
- transformers serve: plain mode (its best for images), greedy; it has no `ignore_eos`, so 32 tokens
  are forced with a per-request `generation_config` (`min_new_tokens`); usage via `stream_options`
  (without it the client could count only its non-empty chunks: 9-32 for 32 tokens of the random
  weights); pan-and-scan goes in `chat_template_kwargs`, which it forwards to the processor.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench_lib import procs
from bench_lib.images import data_url
from bench_lib.workloads import BenchRequest, ImageSpec, openai_messages
from deployments.args import AppArgs
from deployments.cluster_env import CLUSTER_ENV

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20

# The mmserve app as the benchmark runs it: serve_config.local.yaml's placement (one replica per stage,
# 0 CPUs each so all start on 2 cores), bounded caches, and a KV pool that holds 8 `multi` prompts.
MMSERVE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "device": "cpu",
    "processor_cache.capacity_bytes": 256 * MiB,
    "ingress": {"num_replicas": 1, "num_cpus": 0},
    "preprocess": {"autoscaling": None, "num_replicas": 1, "num_cpus": 0},
    "encoder": {"num_replicas": 1, "num_cpus": 0, "cache_capacity_tokens": 256 * 64},
    "decoder": {"num_replicas": 1, "num_cpus": 0, "max_num_seqs": 8, "num_blocks": 2048},
}


def serve_request_id(key: str) -> str:
    """The id Ray Serve logs for a request (the x-request-id header), per request key."""
    return "bench-" + key.replace("/", "-")


def _url(spec: ImageSpec) -> str:
    return data_url(spec.seed, spec.width, spec.height, spec.fmt)


class HttpSystem:
    name = "?"
    has_metrics = False
    metrics_lag_s = 0.0  # how long its `/metrics` may lag what it served (s)

    def __init__(self, model_dir: Path, run_dir: Path, name: str | None = None, env: dict[str, str] | None = None,
                 app_args: dict[str, str] | None = None):
        self.name = name or type(self).name  # a variant's name: "mmserve+OMP_NUM_THREADS=2"
        self.extra_env = dict(env or {})  # environment of the server process on top of ours
        if app_args:
            raise ValueError(f"{self.name}: only mmserve takes app arguments, got {sorted(app_args)}")
        self.model_dir, self.run_dir = model_dir, run_dir
        self.port = procs.free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.root}/v1"
        self.proc: subprocess.Popen | None = None
        self.sampler: procs.RssSampler | None = None
        self.model = ""
        self.log = run_dir / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', self.name.replace('=', '-'))}.log"
        self.startup_s = 0.0
        self.killed_on_stop: list[int] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def request_kwargs(self, req: BenchRequest) -> dict[str, Any]:
        raise NotImplementedError

    def ready_url(self) -> str:
        return f"{self.root}/health"

    def start(self, timeout_s: float = 600.0) -> None:
        cmd, env = self.command()
        env = {**env, **self.extra_env}
        t = time.perf_counter()
        proc = self.proc = procs.start(cmd, self.log, env=env, cwd=str(REPO))
        self.sampler = procs.RssSampler(proc.pid).start()
        procs.wait_http(self.ready_url(), timeout_s, proc, self.log)
        self.startup_s = time.perf_counter() - t

    def stop(self) -> None:
        if self.proc is None:
            return
        assert self.sampler is not None
        self.sampler.stop()
        self.sampler.sample()
        self.killed_on_stop = procs.stop(self.proc, self.sampler.seen)
        self.proc = None


class Mmserve(HttpSystem):
    name = "mmserve"
    has_metrics = True
    ray_tmp: Path | None = None  # the private RAY_TMPDIR of its Ray (logs live there until removed)

    def __init__(self, model_dir: Path, run_dir: Path, name: str | None = None, env: dict[str, str] | None = None,
                 app_args: dict[str, str] | None = None):
        super().__init__(model_dir, run_dir, name, env)
        # NOTE: the variant's overrides go on after MMSERVE_ARGS as they are ("decoder.torch_threads": "1"):
        # the app's own parse_args nests and parses them exactly as `serve run ... k=v`.
        self.app_args: dict[str, Any] = {**MMSERVE_ARGS, **(app_args or {})}
        # NOTE: its replicas push their metrics this often (the app's argument, else its default)
        pushed = AppArgs.model_fields["metrics_push_interval_s"].default
        self.metrics_lag_s = float(self.app_args.get("metrics_push_interval_s", pushed))

    def command(self) -> tuple[list[str], dict[str, str]]:
        # NOTE: `serve run deployments.app:build_app k=v` always binds port 8000 (the import-path form has
        # no HTTP options), so the same app and args go through a Serve config file with our port.
        config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": self.port},
            "applications": [{"name": "mmserve", "route_prefix": "/", "import_path": "deployments.app:build_app",
                              "args": {"model": str(self.model_dir), **self.app_args}}],
        }
        path = self.log.with_name(self.log.stem + "_serve_config.yaml")
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        # NOTE: a short private temp dir: a fresh Ray of our own (never someone else's cluster), and its
        # unix socket paths stay under the 107-character limit.
        self.ray_tmp = Path(f"/tmp/mmb{self.port}")
        # NOTE: mmserve's cluster environment, as docs/deploying.md starts a config file (a variant adds to it:
        # `mmserve+RAY_SERVE_ENABLE_HA_PROXY=1` is HAProxy's mode; only one such server at a time: fixed ports)
        env = {**CLUSTER_ENV, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
               "RAY_TMPDIR": str(self.ray_tmp), "RAY_ADDRESS": ""}
        serve = str(Path(sys.executable).with_name("serve"))
        return [serve, "run", "--address", "local", str(path)], env

    def start(self, timeout_s: float = 600.0) -> None:
        super().start(timeout_s)  # NOTE: /health answers 200 once every stage has a running replica
        from openai import OpenAI

        self.model = OpenAI(base_url=self.base_url, api_key="unused").models.list().data[0].id

    def request_kwargs(self, req: BenchRequest) -> dict[str, Any]:
        extra: dict[str, Any] = {"ignore_eos": True}
        if req.pan_and_scan:
            extra["mm_processor_kwargs"] = {"do_pan_and_scan": True}
        return {"messages": openai_messages(req, _url), "max_tokens": req.max_tokens, "temperature": 0.0,
                "stream_options": {"include_usage": True}, "extra_body": extra,
                "extra_headers": {"x-request-id": serve_request_id(req.key)}}

    def ray_session_logs(self) -> Path | None:
        path = self.ray_tmp / "ray" / "session_latest" / "logs" if self.ray_tmp else None
        return path if path is not None and path.exists() else None


class TransformersServe(HttpSystem):
    name = "transformers"

    def command(self) -> tuple[list[str], dict[str, str]]:
        exe = str(Path(sys.executable).with_name("transformers"))
        self.model = str(self.model_dir)
        return [exe, "serve", str(self.model_dir), "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1",
                "--port", str(self.port), "--log-level", "warning"], {}

    def request_kwargs(self, req: BenchRequest) -> dict[str, Any]:
        gen = {"do_sample": False, "max_new_tokens": req.max_tokens, "min_new_tokens": req.max_tokens}
        extra: dict[str, Any] = {"generation_config": json.dumps(gen)}
        if req.pan_and_scan:
            extra["chat_template_kwargs"] = {"do_pan_and_scan": True}
        return {"messages": openai_messages(req, _url), "max_tokens": req.max_tokens, "temperature": 0.0,
                "stream_options": {"include_usage": True}, "extra_body": extra}


HTTP_SYSTEMS = {"mmserve": Mmserve, "transformers": TransformersServe}


def base_name(spec: str) -> str:
    """'mmserve+OMP_NUM_THREADS=2' -> 'mmserve' (a variant: the same system with extra environment)."""
    return spec.split("+", 1)[0]


def http_system(spec: str, model_dir: Path, run_dir: Path) -> HttpSystem:
    """The HTTP system named by `spec`: a base name, optionally followed by `+KEY=VALUE` assignments.

    A KEY that begins upper-case is environment of the server process (`mmserve+RAY_worker_niceness=0`); else
    an app argument in `serve run` form, its value JSON (`mmserve+decoder.torch_threads=1`).
    """
    base, *assignments = spec.split("+")
    pairs = [a.split("=", 1) for a in assignments]
    env = {k: v for k, v in pairs if k[:1].isupper()}
    app_args = {k: v for k, v in pairs if not k[:1].isupper()}
    return HTTP_SYSTEMS[base](model_dir, run_dir, name=spec, env=env, app_args=app_args)
