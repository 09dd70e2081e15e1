"""Loading Gemma 3's text model: transformers' layers go to the device one at a time and are dropped as the
paged model takes each, so a load never holds a second copy of the text weights; a checkpoint whose text
config asks for arithmetic the paged model does not do is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.models.gemma3 import Gemma3Family, gemma3_spec, one_at_a_time


def test_each_layer_is_moved_when_asked_for_and_dropped_when_the_next_is() -> None:
    layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
    dropped = []
    for layer in one_at_a_time(layers, torch.device("meta")):
        assert layer.weight.device.type == "meta"
        dropped.append([isinstance(m, torch.nn.Identity) for m in layers])
    assert dropped == [[False, False, False], [True, False, False], [True, True, False]]
    assert all(isinstance(m, torch.nn.Identity) for m in layers)  # the last one too, once the loop ends


def test_a_loaded_text_model_keeps_none_of_transformers_layers(tiny_ckpt_224: Path) -> None:
    family = Gemma3Family(tiny_ckpt_224, EngineConfig(model=str(tiny_ckpt_224)))
    text = family.load_text()
    language_model = family._load().model.language_model
    assert len(text.layers) == len(language_model.layers) > 0
    assert all(isinstance(m, torch.nn.Identity) for m in language_model.layers)


@pytest.mark.parametrize("key, value", [("hidden_activation", "gelu"), ("use_bidirectional_attention", True)])
def test_a_checkpoint_asking_for_other_arithmetic_is_refused_at_load(tiny_ckpt_224: Path, key: str,
                                                                     value: Any) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_ckpt_224)
    engine = EngineConfig(model=str(tiny_ckpt_224))
    assert gemma3_spec(tiny_ckpt_224, config, engine).family == "gemma3"  # as saved: served
    setattr(config.text_config, key, value)
    with pytest.raises(ValueError, match=f"text_config.{key}"):
        gemma3_spec(tiny_ckpt_224, config, engine)
