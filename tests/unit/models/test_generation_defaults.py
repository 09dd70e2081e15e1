"""mmserve/models/generation_defaults.py: a checkpoint's recommended sampling, as a request's unset fields take it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from mmserve.config import EngineConfig
from mmserve.messages import SamplingDefaults
from mmserve.models.generation_defaults import sampling_defaults
from mmserve.stages import StageFactory


def _folder(tmp_path: Path, config: Any) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_sampling_fields_the_file_sets_and_nothing_else(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"do_sample": True, "top_k": 64, "top_p": 0.95, "eos_token_id": [1, 106],
                                "cache_implementation": "hybrid"})
    assert sampling_defaults(folder) == SamplingDefaults(top_k=64, top_p=0.95)
    folder = _folder(tmp_path, {"temperature": 0.6, "repetition_penalty": 1.05, "top_k": 20.0, "min_p": 0.05})
    assert sampling_defaults(folder) == SamplingDefaults(temperature=0.6, top_k=20, min_p=0.05,
                                                         repetition_penalty=1.05)


def test_no_file_no_defaults(tmp_path: Path) -> None:
    assert sampling_defaults(tmp_path) == SamplingDefaults()
    assert SamplingDefaults().describe() == "OpenAI's defaults"


def test_values_no_request_could_set_are_left_out_with_a_warning(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    folder = _folder(tmp_path, {"top_p": 0.0, "top_k": 2.5, "temperature": -1, "repetition_penalty": "1.1",
                                "min_p": 1.5})
    with caplog.at_level(logging.WARNING):
        assert sampling_defaults(folder) == SamplingDefaults()
    assert len(caplog.records) == 5 and any("top_p=0.0" in r.getMessage() for r in caplog.records)


def test_the_tiny_checkpoint_recommends_gemmas_sampling_unless_told_not_to(tiny_ckpt_224: Path) -> None:
    spec = StageFactory(EngineConfig(model=str(tiny_ckpt_224))).spec
    assert spec.sampling_defaults == SamplingDefaults(top_k=64, top_p=0.95)
    assert spec.sampling_defaults.describe() == "top_p=0.95, top_k=64 (the checkpoint's generation_config.json)"
    off = StageFactory(EngineConfig(model=str(tiny_ckpt_224), sampling_defaults_from_checkpoint=False)).spec
    assert off.sampling_defaults == SamplingDefaults()


def test_transformers_own_defaults_spelled_out_are_no_recommendation_as_vllm_reads_them(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"top_k": 50, "temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0})
    assert sampling_defaults(folder) == SamplingDefaults()
    assert sampling_defaults(_folder(tmp_path, {"top_k": 40, "top_p": 1.0})) == SamplingDefaults(top_k=40)


def test_a_file_that_is_not_an_object_gives_no_defaults(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert sampling_defaults(_folder(tmp_path, [1, 2])) == SamplingDefaults()
    assert "not a JSON object" in caplog.text
