"""The application's arguments: what `serve run deployments.app:build_app k=v` or a Serve config's
`args:` may set, validated at the edge.

Owns: reading every argument into `AppArgs`, the app-wide Serve side (the metrics push interval, retries, the
device) and the checks across stages. Each stage's own Serve side is `stage_args.py`'s. The engine side is not restated
here: it *is* mmserve's frozen `EngineConfig` tree, validated by pydantic from the same dotted keys
(`decoder.max_num_seqs`, `media.max_image_pixels`), so a knob added to mmserve/config.py is an
argument at once. A stage's section holds both halves: `encoder.num_gpus` (Serve) beside
`encoder.cache_capacity_tokens` (engine). Does not own building deployments (app.py). No Ray import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import logging
import typing
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, Field, TypeAdapter, model_validator

from deployments.stage_args import (
    SERVE_CALL_S,
    DecoderArgs,
    EncoderArgs,
    IngressArgs,
    PreprocessArgs,
    StageArgs,
    StrictArgs,
)
from mmserve.config import EngineConfig, check_device
from mmserve.runtime.metrics_board import STALE_AFTER_S

log = logging.getLogger(__name__)


# the shortest step that counts as hung (AppArgs.hung_step_s). NOTE: longer than an Encoder step that waits out
# its pixel reads' timeouts and runs its forward: such a step is slow, not hung, and replacing its replica would
# lose its cache. A miss whose copy is lost waits: its own copy (cache_store.READ_TIMEOUT_S, 60 s), the store's
# copy of it (a lookup, LOOKUP_TIMEOUT_S, 5 s, and a read, 60 s), the other requests' copies together (60 s):
# 185 s; each further copy lost among those adds a lookup and a read (not bounded: several failures at once)
LOST_PIXELS_STEP_S = 185.0
HUNG_STEP_MIN_S = 300.0


class AppArgs(StrictArgs):
    engine: EngineConfig  # every engine knob; `model` None = the built-in tiny checkpoint
    device: str | None = None  # every stage's torch device; None = by stage: "cuda" when it has GPUs
    # NOTE: each push is a Serve call; at 1 s the hub replica alone took a visible share of an idle small
    # node's CPU (docs/benchmarks.md).
    # how often each replica reports to the MetricsHub (s); NOTE: at most a third of the time after which the hub
    # takes a silent replica's gauges for gone (mmserve/runtime/metrics_board.py), or live ones would blink out
    metrics_push_interval_s: float = Field(5.0, gt=0, le=STALE_AFTER_S / 3)
    # times an idempotent call (a request's way to its first token, a non-streamed one's to its end, an encode) is
    # made again on a live replica when the one answering it dies (deployments/retry.py)
    replica_loss_retries: int = Field(2, ge=0)
    ingress: IngressArgs = Field(default_factory=IngressArgs)
    preprocess: PreprocessArgs = Field(default_factory=PreprocessArgs)
    encoder: EncoderArgs = Field(default_factory=EncoderArgs)
    decoder: DecoderArgs = Field(default_factory=DecoderArgs)

    @model_validator(mode="after")
    def _batch_within_reach(self) -> AppArgs:
        """Warn where Serve lets fewer calls into a Decoder replica than its batch holds: the batch never fills."""
        seqs, ongoing = self.engine.decoder.max_num_seqs, self.decoder.max_ongoing_requests
        if seqs > ongoing:
            log.warning("decoder.max_num_seqs=%d is above decoder.max_ongoing_requests=%d: a replica's batch never "
                        "holds more than the latter", seqs, ongoing)
        return self

    @model_validator(mode="after")
    def _accelerators_reserved(self) -> AppArgs:
        """Refuse an accelerator `device` for a computing stage that reserves no GPU: Ray might place its replicas
        on a node without one, and would count none of the GPU memory they take (a share of one: `num_gpus` 0.5)."""
        if self.device is not None:
            check_device(self.device)
        if self.device is not None and self.device != "cpu":
            for name, stage in (("encoder", self.encoder), ("decoder", self.decoder)):
                if stage.num_gpus <= 0:
                    raise ValueError(f"device={self.device} but {name}.num_gpus is {stage.num_gpus}: set "
                                     f"{name}.num_gpus, a share of a GPU at least (a stage with GPUs computes on "
                                     "them without device=...)")
        return self

    def may_idle(self) -> frozenset[str]:
        """The deployments (by Serve's names) autoscaled with `min_replicas` 0, which may have no replica at all."""
        stages = {"Preprocess": self.preprocess, "Encoder": self.encoder, "Decoder": self.decoder}
        return frozenset(name for name, stage in stages.items()
                         if stage.autoscaling is not None and stage.autoscaling.min_replicas == 0)

    def hung_step_s(self) -> float:
        """How long one Encoder or Decoder step may run before the replica counts as hung (Serve's check_health
        fails and replaces it): longer than any request may live, so every request in it has had its deadline,
        and at least HUNG_STEP_MIN_S (a slow first step on a CPU is no hang)."""
        return max(self.ingress.request_timeout_s, HUNG_STEP_MIN_S)

    def encoder_call_s(self) -> float:
        """About how long an Encoder call may take, which a replica being removed waits out: a step that waits out
        its lost pixels' reads (LOST_PIXELS_STEP_S), and a step's wait more. NOTE: an estimate: calls queued
        behind several such steps take longer; most calls take milliseconds, and a drain ends when they do."""
        return LOST_PIXELS_STEP_S + SERVE_CALL_S

    def preprocess_call_s(self) -> float:
        """About how long a Preprocess call may take, which a replica being removed waits out: its fetches (side
        by side, each within `media.fetch_timeout_s`), then the processor. NOTE: an estimate, not a bound: a call
        waiting for a fetch or image slot takes longer (the request's deadline bounds it, and a call cut is
        retried)."""
        return self.engine.media.fetch_timeout_s + SERVE_CALL_S

    def early_encode(self) -> bool:
        """Whether Preprocess sends the Encoder a request's new images early (`preprocess.early_encode`)."""
        wanted = self.preprocess.early_encode
        if wanted is None:
            wanted = self.engine_config(self.encoder).device != "cpu"
        return wanted and self.encoder.routing == "affinity"

    def engine_config(self, stage: StageArgs | None = None) -> EngineConfig:
        """The engine config a replica of `stage` runs with (its device follows its GPUs unless set)."""
        device = self.device or (stage.device() if stage is not None else "cpu")
        return replace(self.engine, device=device)


def parse_args(raw: dict[str, Any]) -> AppArgs:
    """From `serve run ... k=v` (flat strings, dotted keys for nesting, JSON values) or a YAML dict.

    Raises ValueError naming an unknown argument, pydantic's ValidationError naming a bad value.
    """
    app: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    engine_fields = _field_types(EngineConfig)
    for key, value in _nested(raw).items():
        if key == "engine":  # NOTE: AppArgs's field, built from the top-level keys: one given here would be dropped
            raise ValueError("the engine's arguments are top-level keys (dtype=..., decoder.max_num_seqs=...), not "
                             "under 'engine'")
        placement = AppArgs.model_fields.get(key)
        if placement is None and key not in engine_fields:
            _refuse(key, [k for k in (*AppArgs.model_fields, *engine_fields) if k != "engine"], "at the top level")
        kind = placement.annotation if placement is not None else None
        section = isinstance(value, dict) and isinstance(kind, type) and issubclass(kind, BaseModel)
        if section:  # a stage's section: a misspelt key is named with its likely meaning
            serve_fields = typing.cast(type[BaseModel], kind).model_fields
            own = _field_types(engine_fields[key]) if key in engine_fields else {}
            for k in value:
                if k not in serve_fields and k not in own:
                    _refuse(f"{key}.{k}", [*serve_fields, *own], f"under {key!r}")
        if key not in engine_fields or key == "device":
            app[key] = value
        elif not section:
            engine[key] = value
        else:  # its Serve fields to AppArgs, the rest to the engine's group
            app[key] = {k: v for k, v in value.items() if k in serve_fields}
            engine[key] = {k: v for k, v in value.items() if k not in serve_fields}
    _refuse_unknown(engine, EngineConfig, "")
    return AppArgs.model_validate({**app, "engine": TypeAdapter(EngineConfig).validate_python(engine)})


def _nested(raw: dict[str, Any]) -> dict[str, Any]:
    """`{"a.b": "1"}` -> `{"a": {"b": 1}}`: dotted keys nest, string values are parsed as JSON if they can."""
    nested: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, str):
            with contextlib.suppress(ValueError):  # else a plain string, e.g. a path
                value = json.loads(value)
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"argument {key!r}: {part!r} is a value, not a section")
        if isinstance(node.get(leaf), dict) and isinstance(value, dict):
            node[leaf].update(value)
        else:
            node[leaf] = value
    return nested


def _field_types(cls: type) -> dict[str, Any]:
    """A config dataclass's field names -> their resolved types."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _refuse_unknown(values: Any, cls: type, prefix: str) -> None:
    """Raise ValueError naming the first key of `values` that is no field of the config dataclass `cls`."""
    if not isinstance(values, dict):
        return  # pydantic reports a wrong type with its path
    types = _field_types(cls)
    for key, value in values.items():
        name = prefix + key
        if key not in types:
            _refuse(name, types, f"under {prefix.rstrip('.')!r}" if prefix else "at the top level")
        if dataclasses.is_dataclass(types[key]):
            _refuse_unknown(value, types[key], name + ".")


def _refuse(name: str, known: typing.Iterable[str], where: str) -> typing.NoReturn:
    """Raise ValueError naming the unknown argument `name`, the known names nearest to its last part (a
    misspelling's likely meaning) and every argument `where` it stands."""
    known = sorted(set(known))
    near = difflib.get_close_matches(name.rsplit(".", 1)[-1], known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
    raise ValueError(f"unknown argument {name!r}; {hint}the arguments {where}: {known} "
                     "(docs/deploying.md lists them)")
