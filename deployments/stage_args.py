"""Each stage's Serve-side arguments: its replicas (a fixed count or autoscaling), resources, torch threads,
queue bounds, drain time, environment and, for stages that keep caches, how calls are routed to them; and the
replicas' default environments, with why each entry is there.

Owns those pydantic models and defaults. Does not own the engine's knobs (mmserve/config.py), reading the
arguments into them (args.py), nor building deployments (app.py). No Ray import.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mmserve.config import LARGEST_FLOAT
from mmserve.runtime.core_company import usable_cores


class StrictArgs(BaseModel):
    # NOTE: no float infinite or past LARGEST_FLOAT (seconds, milliseconds, ratios): a timeout, delay or wait past
    # ~9.2e9 s overflows the timers it reaches, so "no limit" spelled as a huge one would fail where it is used
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _not_huge(self) -> StrictArgs:
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, float) and abs(value) > LARGEST_FLOAT:
                raise ValueError(f"{name} is {value!r}, past {LARGEST_FLOAT:g}")
        return self


class Autoscaling(StrictArgs):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    # Optional: None leaves Serve's own default. Small values make scaling react in seconds (tests).
    metrics_interval_s: float | None = Field(None, gt=0)  # how often handles/replicas report load
    look_back_period_s: float | None = Field(None, gt=0)  # window the load is averaged over
    # Replicas the stage starts with (a deploy, an upgrade's new cluster), before load moves it; None: min_replicas.
    # E.g. the replicas the old cluster runs, so that traffic switched to the new one finds them. NOTE: Serve
    # applies it again on every redeploy that changes the app's args (any of them): remove it after the upgrade.
    initial_replicas: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _bounds_in_order(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas ({self.initial_replicas}) is outside min_replicas "
                             f"({self.min_replicas}) to max_replicas ({self.max_replicas})")
        if self.min_replicas == 0 and not self.initial_replicas:
            # NOTE: Serve would start no replica, call the stage HEALTHY, and /health (which counts a stage scaled to
            # zero as ready: app_health.py) say ready for a model that never loaded
            raise ValueError("min_replicas 0 needs initial_replicas >= 1: a deploy then loads one replica, so that "
                             "the app is ready only once its model is known to load; idle, it scales down to zero")
        return self


# NOTE: OpenMP threads that finished a parallel region spin-wait (libgomp: 300k spins, a few ms) before they
# sleep; with two step processes on few cores that spinning starves the other one (docs/benchmarks.md has the
# figures). libgomp reads it when torch loads, so it is set in the replica's environment. The Decoder keeps
# libgomp's own spin (DECODER_ENV): a short one put its second thread to sleep between a decode step's ~100
# small regions, and each wake waited for a core; its steps yield threads instead while an encode on its
# host's CPU runs (DecoderConfig.threads_beside_encodes), the other step process on a node's cores. What else
# shares those cores (Preprocess, another Decoder replica) meets its spin: measured with Preprocess beside it
# only, at 1 to 8 clients (docs/benchmarks.md); a node of several Decoder replicas may want the short spin back.
# NOTE: glibc's malloc serves a block above its mmap threshold with a fresh mapping, and gives the heap's
# free top back to the kernel past its trim threshold; either way the next request's buffers (a decoded
# image, its resized copy, activations) fault in their pages again. glibc raises both thresholds itself
# after freeing a big block, up to 32 MiB and twice that, but not for every pattern (a Preprocess replica
# faulted in every new image's buffers again: docs/benchmarks.md has the counts). These are glibc's own
# ceilings, set from the start. Other C libraries ignore them.
# NOTE: glibc makes up to 8 malloc arenas per core, and a Ray worker's ~40 threads have taken them all
# before a replica's first call; a thread started later is handed the next arena in turn. While the Encoder
# ran each vision forward on a thread of its own, each of its first forwards grew another arena to the
# forward's working set, faulting its pages in (slower), and every arena kept a copy of it; with two arenas
# only the first two did (docs/benchmarks.md). Its forwards now run in its step thread
# (StageFactory.encoder(alone=True)); the cap still keeps any thread that starts later on memory that
# earlier ones grew, and the replicas smaller: one arena for the serving threads' blocks, one for compute.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
MALLOC_ARENAS = 2  # glibc arenas per replica process (arenas)
DEFAULT_STAGE_ENV = {"GOMP_SPINCOUNT": "10000", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES),
                     "MALLOC_TRIM_THRESHOLD_": str(2 * MMAP_THRESHOLD_BYTES), "MALLOC_ARENA_MAX": str(MALLOC_ARENAS)}
DECODER_ENV = {k: v for k, v in DEFAULT_STAGE_ENV.items() if k != "GOMP_SPINCOUNT"}
# NOTE: Ray sends a call's argument inline, in the call's own message, up to 100 KiB, and through the
# object store past that: a put by the caller and a fetch by the callee through their raylet, which cost
# an image-sized argument milliseconds more than inline (docs/benchmarks.md). A request body carrying an image as a
# data URL is such an argument, sent once from the Ingress to Preprocess and read once there. Ray reads
# this limit in the calling process, so the Ingress raises it for its own calls only; bigger bodies (up to
# ingress.max_body_bytes) still go through the object store, whose fixed cost is small beside their copies.
INGRESS_INLINE_BYTES = 1 << 20
INGRESS_ENV = {**DEFAULT_STAGE_ENV, "RAY_max_direct_call_object_size": str(INGRESS_INLINE_BYTES)}
# NOTE: the same limit holds for what a call returns, read in the process that returns it: an Encoder replica's
# answer (one image's embeddings) then travels in the reply itself instead of a put into its node's object
# store and a fetch by the Decoder (docs/benchmarks.md). Sized for one image of gemma-3-4b in bfloat16:
# 256 rows x 2560 x 2 B = 1.31 MB, past the Ingress's 1 MiB.
ENCODER_INLINE_BYTES = 2 << 20
ENCODER_ENV = {**DEFAULT_STAGE_ENV, "RAY_max_direct_call_object_size": str(ENCODER_INLINE_BYTES)}


# NOTE: Serve gives a replica being removed one budget, `graceful_shutdown_timeout_s`, for both waiting out the
# calls it holds (checked every 2 s: graceful_shutdown_wait_loop_s) and its own shutdown hook, and force-kills it
# once the budget is spent, hook or not. The hooks: the last metrics push (HUB_TIMEOUT_S, 2 s); Preprocess's
# hand-over to the store (HAND_OVER_TIMEOUT_S, 2 s); an Encoder's or Decoder's step thread joined (StepLoop.stop,
# JOIN_TIMEOUT_S, 30 s). So the default budget is what the calls may take plus this.
SHUTDOWN_HOOK_S = 40.0
SERVE_CALL_S = 20.0  # how long a stage's call may take where nothing bounds it (Serve's own drain budget) (s)

# Requests on the ingress's other routes (/health, /metrics, /v1/models) a replica takes beside a full load of
# chat requests (requests)
INGRESS_PROBE_SLOTS = 16


class StageArgs(StrictArgs):
    """Placement and scale of one deployment."""

    num_replicas: int | None = Field(None, ge=1)  # fixed count: the stage then does not autoscale
    autoscaling: Autoscaling | None = None
    num_cpus: float = Field(0.0, ge=0)  # NOTE: 0 by default so that a 2-core machine starts every stage
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # custom resources, e.g. {"encoder_node": 0.01}
    max_ongoing_requests: int = Field(64, ge=1)
    # Calls waiting for a replica of this stage when every one holds max_ongoing_requests; past it the
    # caller gets Serve's BackPressureError at once (the ingress answers 503 + Retry-After). -1 = unbounded.
    max_queued_requests: int = Field(256, ge=-1)  # NOTE: 0 is refused below, as Serve refuses it
    # Intra-op threads of torch in each replica; None = num_cpus when >= 1, else the cores it may compute on at once
    # (its affinity, bounded by the tightest CPU quota of its cgroup and those above it).
    # NOTE: Ray sets OMP_NUM_THREADS to a worker's num_cpus (at least 1), so a replica asking for 0 CPUs
    # (our default) would run torch on one thread: about half the speed of encoder and prefill.
    torch_threads: int | None = Field(None, ge=1)
    env: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_STAGE_ENV))  # replica environment
    # Seconds a replica being removed (a downscale, a redeploy) goes on serving the calls it holds, then runs its
    # shutdown hook, before Serve stops it; None: how long its calls may take (the Ingress and the Decoder, which
    # hold a request to its last token, as long as a request may live, `ingress.request_timeout_s`; Preprocess, its
    # fetches' deadline and 20 s; the Encoder, a step with lost pixels and 20 s: args.py) plus SHUTDOWN_HOOK_S
    # (`deployment_options`' `holds_for_s`)
    graceful_shutdown_timeout_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _queue_bound(self) -> StageArgs:
        if self.max_queued_requests == 0:
            raise ValueError("max_queued_requests must be at least 1, or -1 for no bound (Serve refuses 0)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _autoscaling_over_the_stages_own(cls, data: Any) -> Any:
        """Autoscaling fields given over the stage's default autoscaling, not over the class's (a lone
        `preprocess.autoscaling.target_ongoing_requests=4` keeps Preprocess's 1 to 2 replicas); a lone
        `min_replicas` above the default's cap lifts the cap to it."""
        if not isinstance(data, dict) or not isinstance(data.get("autoscaling"), dict):
            return data
        default = cls.model_fields["autoscaling"].get_default(call_default_factory=True)
        given = data["autoscaling"]
        merged = {**(default.model_dump(exclude_unset=True) if default is not None else {}), **given}
        if "max_replicas" not in given and isinstance(given.get("min_replicas"), int):  # a lone floor lifts the cap
            cap = merged.get("max_replicas", Autoscaling.model_fields["max_replicas"].default)
            merged["max_replicas"] = max(cap, given["min_replicas"])
        return {**data, "autoscaling": merged}

    @model_validator(mode="before")
    @classmethod
    def _fixed_count_or_autoscaling(cls, data: Any) -> Any:
        """A `num_replicas` given is a fixed count, over a stage's default autoscaling too; given with an
        `autoscaling` of its own, it is refused (which one was meant is not ours to guess)."""
        if not isinstance(data, dict) or data.get("num_replicas") is None:
            return data
        if data.get("autoscaling") is not None:
            raise ValueError("num_replicas (a fixed count) and autoscaling exclude each other: set one of them")
        return {**data, "autoscaling": None}

    def threads(self) -> int:
        """The torch thread count this stage's replicas run with."""
        if self.torch_threads is not None:
            return self.torch_threads
        if self.num_cpus >= 1:
            return int(self.num_cpus)
        return usable_cores()

    def device(self) -> str:
        """Where this stage computes unless `device` is set: a GPU when the replica asks for one."""
        return "cuda" if self.num_gpus > 0 else "cpu"

    def deployment_options(self, holds_for_s: float | None = None) -> dict[str, Any]:
        """Serve's options of this stage's deployment; `holds_for_s`: how long a call to it may last, which a
        replica being removed waits out, then its shutdown hook, unless `graceful_shutdown_timeout_s` is set
        (None: SERVE_CALL_S)."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            actor["num_gpus"] = self.num_gpus
        if self.resources:
            actor["resources"] = dict(self.resources)
        if self.env:  # NOTE: Ray merges these env_vars over the job's own runtime_env env_vars
            actor["runtime_env"] = {"env_vars": dict(self.env)}
        options: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": self.max_ongoing_requests,
                                   "max_queued_requests": self.max_queued_requests}
        if self.autoscaling is not None:
            options["autoscaling_config"] = self.autoscaling.model_dump(exclude_none=True)
        else:
            options["num_replicas"] = self.num_replicas or 1
        options["graceful_shutdown_timeout_s"] = self.graceful_shutdown_timeout_s or (
            (SERVE_CALL_S if holds_for_s is None else holds_for_s) + SHUTDOWN_HOOK_S)
        return options


class RoutedStageArgs(StageArgs):
    """A stage whose replicas keep caches: how calls are spread over them (deployments/routers.py)."""

    # "affinity": each call to the replica that holds (or should hold) its cache entries, unless that one is
    # busier than the least loaded by more than routing_load_margin requests; "default": Serve's own router.
    routing: Literal["affinity", "default"] = "affinity"
    routing_load_margin: int = Field(4, ge=0)  # ongoing requests (requests)

    def router(self, router_class: str, **kwargs: Any) -> dict[str, Any]:
        """Serve's `request_router_config` for this stage, as a dict ({} for Serve's default router)."""
        if self.routing == "default":
            return {}
        return {"request_router_class": router_class,
                "request_router_kwargs": {"load_margin": self.routing_load_margin, **kwargs}}


class IngressArgs(StageArgs):
    # Chat requests one replica serves at once; one more gets a 503 `overloaded` with Retry-After at once
    # (mmserve.api.admission). NOTE: the ingress only awaits other stages: it holds many requests at once.
    max_ongoing_requests: int = Field(1024, ge=1)
    env: dict[str, str] = Field(default_factory=lambda: dict(INGRESS_ENV))  # replica environment
    max_body_bytes: int = Field(64 << 20, ge=1)  # bytes of one request body (inline images included); more: 413
    # Seconds a request may take from arrival to its last token; then it ends with a 504 (or an error
    # event in a stream) and is cancelled downstream (its KV blocks freed, an encode under way dropped).
    request_timeout_s: float = Field(600.0, gt=0)
    # Each stage's own phases in the `Server-Timing` header, beside the ingress's round trips (scripts/bench_path.py
    # turns it on). NOTE: off by default: which phases ran tells a client whether a cache held an image.
    stage_timing: bool = False
    # Web origins a browser app may call the API from (CORS), e.g. ["https://chat.example.com"]; ["*"] any.
    # NOTE: none by default (vLLM allows any): a server on a private network would answer any page its users open
    cors_allowed_origins: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _can_scale_up(self) -> IngressArgs:
        """NOTE: past `max_ongoing_requests` chat requests are refused, not queued, so a replica never counts
        more: a target at or above it would never scale the ingress up."""
        target = self.autoscaling.target_ongoing_requests if self.autoscaling is not None else 0.0
        if target >= self.max_ongoing_requests:
            raise ValueError(f"autoscaling.target_ongoing_requests ({target}) must be below max_ongoing_requests "
                             f"({self.max_ongoing_requests}): a replica refuses chat requests past the latter")
        return self

    def deployment_options(self, holds_for_s: float | None = None) -> dict[str, Any]:
        """As a stage's, with Serve's bound on the replica above mmserve's own (`max_ongoing_requests`), so that
        a chat request past it gets mmserve's answer, not Serve's, and health, metrics and model probes get
        through while chat requests fill the replica."""
        options = super().deployment_options(self.request_timeout_s if holds_for_s is None else holds_for_s)
        options["max_ongoing_requests"] = self.max_ongoing_requests + INGRESS_PROBE_SLOTS
        return options


class PreprocessArgs(StageArgs):
    autoscaling: Autoscaling | None = Field(default_factory=lambda: Autoscaling(min_replicas=1, max_replicas=2))
    # Hand a request's newly processed images to an idle Encoder at once, so that they are encoded while the
    # request travels on to the Decoder (whose call for them then finds them cached). Takes effect with the
    # encoder's affinity routing only, which sends both calls to one replica. None: where the Encoder runs on
    # an accelerator. NOTE: a CPU encoder's forward and the request's trip share the host's cores: on a
    # small VM the overlap cost a new image time to first token (docs/benchmarks.md).
    early_encode: bool | None = None


class EncoderArgs(RoutedStageArgs):
    env: dict[str, str] = Field(default_factory=lambda: dict(ENCODER_ENV))  # replica environment


class DecoderArgs(RoutedStageArgs):
    max_ongoing_requests: int = Field(256, ge=1)  # streams a replica holds at once (its batch and queue)
    env: dict[str, str] = Field(default_factory=lambda: dict(DECODER_ENV))  # replica environment
