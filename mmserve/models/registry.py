"""Which model module serves a checkpoint folder, decided by its config's `model_type`.

Owns: the table from `model_type` to family class, and the default checkpoint (the built-in tiny
random-weight Gemma 3) when none is given. This is the only place that names models; everything
else reads `ModelSpec` and calls the family's methods. Does not own any family's rules (its module) nor
building the tiny checkpoint (tiny_checkpoint.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from mmserve.config import EngineConfig
from mmserve.models.base import ModelFamily
from mmserve.models.gemma3 import Gemma3Family
from mmserve.models.tiny_checkpoint import default_tiny_checkpoint

FAMILIES: dict[str, Callable[[Path, EngineConfig], ModelFamily]] = {"gemma3": Gemma3Family}


def checkpoint_dir(model: str | None) -> str:
    """The checkpoint folder to serve: `model`, or the built-in tiny one (built on first use).

    NOTE: the tiny checkpoint is deterministic, so each process (on each node) that resolves it finds or
    builds the same folder in its own cache.
    """
    return model if model is not None else str(default_tiny_checkpoint())


def load_family(model_dir: str, config: EngineConfig) -> ModelFamily:
    """The family of the checkpoint in `model_dir`, set up by `config`; reads config files, no weights yet."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face checkpoint folder (no config.json)")
    model_type = json.loads(config_path.read_text()).get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported; known: {sorted(FAMILIES)}")
    return family(Path(model_dir), config)
