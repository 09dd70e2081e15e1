"""Which model module serves a checkpoint folder, decided by its config's `model_type`.

Owns: the table from `model_type` to family class. This is the only place that names models;
everything else reads `ModelSpec` and calls the family's methods.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmserve.config import ModelConfig
from mmserve.models.base import ModelFamily
from mmserve.models.gemma3 import Gemma3Family

FAMILIES: dict[str, type] = {"gemma3": Gemma3Family}


def load_family(model: ModelConfig) -> ModelFamily:
    config_path = Path(model.model_dir) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model.model_dir} is not a Hugging Face checkpoint folder (no config.json)")
    model_type = json.loads(config_path.read_text()).get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported; known: {sorted(FAMILIES)}")
    return family(model)
