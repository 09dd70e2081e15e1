"""The app's arguments are mmserve's EngineConfig tree: every field settable by its dotted path, as
`serve run deployments.app:build_app k=v` passes it, and an unknown argument refused by name."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from deployments.args import AppArgs, parse_args
from deployments.stage_args import Autoscaling, StageArgs
from mmserve.config import DecoderConfig, EncoderConfig, EngineConfig
from mmserve.stages import StageFactory


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, type, default) of every non-dataclass field of the config tree under `cls`."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out += _leaves(typing.cast(type, kind), f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append((prefix + f.name, kind, default))
    return out


def _other_value(kind: Any, default: Any) -> Any:
    """A valid value of `kind` that differs from `default`."""
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    base = next(t for t in options if t is not type(None))
    if typing.get_origin(base) is tuple:
        return ("example.com",)
    if base is bool:
        return not default
    if base is str:
        return {"float32": "bfloat16", "cpu": "cuda:1"}.get(default, "/some/folder")
    if base in (int, float):
        return base((default or 1) * 3 + 1)
    raise AssertionError(f"no sample value for {kind}")


def _get(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


LEAVES = _leaves(EngineConfig)


def test_the_tree_has_the_knobs_users_set() -> None:
    paths = {path for path, _, _ in LEAVES}
    assert {"model", "dtype", "media.max_image_pixels", "processor_cache.capacity_bytes",
            "encoder.cache_capacity_tokens", "decoder.max_num_seqs", "decoder.num_blocks"} <= paths


@pytest.mark.parametrize(("path", "kind", "default"), LEAVES, ids=[p for p, _, _ in LEAVES])
def test_every_engine_field_is_an_argument(path: str, kind: Any, default: Any) -> None:
    value = _other_value(kind, default)
    raw = json.dumps(list(value)) if isinstance(value, tuple) else json.dumps(value)
    if isinstance(value, str):
        raw = value  # as a shell passes it: a plain string, not JSON
    gpus = {"encoder.num_gpus": "1", "decoder.num_gpus": "1"} if path == "device" else {}  # a device needs them
    args = parse_args({path: raw, **gpus})
    assert _get(args.engine_config(), path) == value
    assert _get(parse_args({}).engine_config(), path) == (default if path != "device" else "cpu")


def test_a_stage_section_holds_serve_and_engine_keys_apart() -> None:
    args = parse_args({"encoder.num_gpus": "1", "encoder.cache_capacity_tokens": "512",
                       "decoder.max_ongoing_requests": "9", "decoder.max_num_seqs": "3"})
    assert args.encoder.num_gpus == 1 and args.engine.encoder.cache_capacity_tokens == 512
    assert args.decoder.max_ongoing_requests == 9 and args.engine.decoder.max_num_seqs == 3
    assert args.engine_config(args.encoder).device == "cuda" and args.engine_config(args.decoder).device == "cpu"
    for stage in ("encoder", "decoder"):  # one name, one meaning
        engine = {f.name for f in dataclasses.fields(_get(EngineConfig(), stage))}
        serve = set(typing.cast(type[StageArgs], AppArgs.model_fields[stage].annotation).model_fields)
        assert not engine & serve


@pytest.mark.parametrize("name", ["decoder.max_num_seq", "media.max_pixels", "modell", "encoder.foo.bar"])
def test_an_unknown_argument_is_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=name.split(".")[-1] if name.count(".") < 2 else "foo"):
        parse_args({name: "1"})


@pytest.mark.parametrize(("name", "meant"), [
    ("modle", "model"), ("decoder.max_num_seq", "max_num_seqs"), ("decoder.num_replica", "num_replicas"),
    ("preprocess.autoscalng", "autoscaling"), ("ingress.max_ongoing_request", "max_ongoing_requests"),
    ("media.max_pixels", "max_image_pixels"),
])
def test_a_misspelt_argument_is_refused_with_what_it_likely_meant(name: str, meant: str) -> None:
    """Serve keys and engine keys of a section alike: `decoder.num_replica` is not answered with the engine's list."""
    with pytest.raises(ValueError, match=rf"unknown argument '{re.escape(name)}'; did you mean '{meant}'"):
        parse_args({"model": "m", name: "1"})


def test_a_bad_value_is_refused_with_its_path() -> None:
    with pytest.raises(ValidationError, match=r"engine\.decoder\.num_blocks|decoder\.num_blocks"):
        parse_args({"decoder.num_blocks": "0"})
    with pytest.raises(ValidationError, match="max_image_bytes"):
        parse_args({"media.max_image_bytes": "lots"})
    with pytest.raises(ValueError, match="must be >= 1"):  # the engine checks its own bounds too
        dataclasses.replace(EngineConfig().decoder, num_blocks=0)


def test_configuration_mistakes_that_would_be_dropped_or_crash_later_are_refused_at_once(
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="top-level keys"):  # AppArgs's engine field: it would have been dropped
        parse_args({"engine.dtype": "bfloat16"})
    for key in ("media.fetch_timeout_s", "encoder.batch_wait_ms", "ingress.request_timeout_s"):
        for huge in ("Infinity", "1e10"):  # an infinite or huge wait overflows the timers it reaches
            with pytest.raises(ValidationError, match=r"finite|past"):
                parse_args({key: huge})
    assert parse_args({"preprocess.autoscaling.target_ongoing_requests": "4"}).preprocess.autoscaling == \
        Autoscaling(min_replicas=1, max_replicas=2, target_ongoing_requests=4)  # over the stage's own default
    assert parse_args({"preprocess.autoscaling.min_replicas": "3"}).preprocess.autoscaling == \
        Autoscaling(min_replicas=3, max_replicas=3)  # a lone floor lifts the default's cap
    assert parse_args({"encoder.autoscaling.min_replicas": "6"}).encoder.autoscaling == \
        Autoscaling(min_replicas=6, max_replicas=6)  # the class's default cap too
    with pytest.raises(ValidationError, match="above max_replicas"):
        parse_args({"encoder.autoscaling": '{"min_replicas": 6, "max_replicas": 4}'})
    assert parse_args({"ingress.max_body_bytes": str(2 << 30)}).ingress.max_body_bytes == 2 << 30  # counts, not waits
    with caplog.at_level(logging.WARNING, logger="deployments.args"):
        parse_args({"decoder.max_num_seqs": "64", "decoder.max_ongoing_requests": "16"})
    assert "never holds more" in caplog.text


def test_a_max_model_len_past_the_checkpoints_and_an_encoder_cache_below_one_image_are_refused(
        tiny_ckpt_224: Path) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        StageFactory(EngineConfig(model=str(tiny_ckpt_224), max_model_len=1 << 20))
    small = EngineConfig(model=str(tiny_ckpt_224), encoder=EncoderConfig(cache_capacity_tokens=8))
    with pytest.raises(ValueError, match="below one image's 16 embedding rows"):
        StageFactory(small).encoder()


def test_a_kv_pool_that_cannot_hold_one_max_model_len_sequence_is_warned_of(
        tiny_ckpt_224: Path, caplog: pytest.LogCaptureFixture) -> None:
    decoder = DecoderConfig(num_blocks=4, measure_matmul_forms=False, small_step_threads=1, big_step_threads=1)
    config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048, decoder=decoder)
    with caplog.at_level(logging.WARNING, logger="mmserve.decoder.decoder"):
        service = StageFactory(config).decoder()
    service.stop()
    assert "below max_model_len 2048" in caplog.text


@pytest.mark.parametrize(("args", "early"), [
    ({}, False),  # the encoder on the CPU: its forward would share the cores with the request's trip
    ({"encoder.num_gpus": "1"}, True),
    ({"device": "cuda:0", "encoder.num_gpus": "1", "decoder.num_gpus": "1"}, True),
    ({"encoder.num_gpus": "1", "encoder.routing": "default"}, False),  # two calls could meet two replicas
    ({"preprocess.early_encode": "true"}, True),
    ({"encoder.num_gpus": "1", "preprocess.early_encode": "false"}, False),
])
def test_early_encodes_where_the_encoder_computes_apart_and_both_calls_meet_one_replica(
        args: dict[str, str], early: bool) -> None:
    assert parse_args(args).early_encode() is early


@pytest.mark.parametrize("stage", ["encoder", "decoder"])
def test_an_accelerator_device_for_a_stage_without_gpus_is_refused(stage: str) -> None:
    """Ray would place such a replica on any node, a GPU-less one too, and count none of its GPU memory."""
    other = "decoder" if stage == "encoder" else "encoder"
    with pytest.raises(ValueError, match=f"device=cuda but {stage}.num_gpus is 0.0: set {stage}.num_gpus"):
        parse_args({"device": "cuda", f"{other}.num_gpus": "1"})
    assert parse_args({"device": "cpu"}).engine_config(parse_args({}).decoder).device == "cpu"


@pytest.mark.parametrize("device", ["cdua", "gpu", "cuda:x"])
def test_a_device_torch_does_not_know_is_refused_by_name(device: str) -> None:
    """Before the GPU check (which would blame `num_gpus`), at the app and in the engine's own config."""
    with pytest.raises(ValidationError, match=rf"device '{re.escape(device)}' is no torch device"):
        parse_args({"model": "m", "device": device, "encoder.num_gpus": "1", "decoder.num_gpus": "1"})
    with pytest.raises(ValueError, match="is no torch device"):
        EngineConfig(device=device)
    assert parse_args({"model": "m", "device": "cuda:1", "encoder.num_gpus": "1", "decoder.num_gpus": "1"})


def test_a_push_interval_past_a_third_of_the_hubs_patience_is_refused() -> None:
    from deployments.args import parse_args
    from mmserve.runtime.metrics_board import STALE_AFTER_S

    assert parse_args({"metrics_push_interval_s": STALE_AFTER_S / 3}).metrics_push_interval_s == STALE_AFTER_S / 3
    with pytest.raises(ValueError, match="metrics_push_interval_s"):
        parse_args({"metrics_push_interval_s": STALE_AFTER_S})


def test_a_step_counts_as_hung_past_every_requests_deadline_and_its_pixel_reads_waits() -> None:
    from deployments.args import HUNG_STEP_MIN_S, parse_args
    from deployments.cache_store import LOOKUP_TIMEOUT_S, READ_TIMEOUT_S

    assert parse_args({}).hung_step_s() == parse_args({}).ingress.request_timeout_s
    assert parse_args({"ingress": {"request_timeout_s": 6}}).hung_step_s() == HUNG_STEP_MIN_S
    # a step of one miss may wait out: its own copy, a failed copy's lookup and read, the others' copies; + a forward
    assert HUNG_STEP_MIN_S > 3 * READ_TIMEOUT_S + LOOKUP_TIMEOUT_S + 60
