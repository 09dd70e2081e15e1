"""Which model module serves a checkpoint folder, decided by its config's `model_type`.

Owns: the table from `model_type` to family class, and the default checkpoint (the built-in tiny
random-weight Gemma 3) when none is given. This is the only place that names models; everything
else reads `ModelSpec` and calls the family's methods. Does not own any family's rules (its module) nor
building the tiny checkpoint (tiny_checkpoint.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from mmserve.config import EngineConfig
from mmserve.models.base import ModelFamily
from mmserve.models.gemma3 import Gemma3Family
from mmserve.models.tiny_checkpoint import default_tiny_checkpoint

FAMILIES: dict[str, Callable[[Path, EngineConfig], ModelFamily]] = {"gemma3": Gemma3Family}
# model types of the same names that are not served -> why (a clearer refusal than "not supported")
NOT_SERVED: dict[str, str] = {
    "gemma3_text": "the text-only Gemma 3 checkpoints (gemma-3-1b, gemma-3-270m; Gemma3ForCausalLM) are not "
                   "served: mmserve serves the vision-language ones (gemma-3-4b, -12b, -27b)",
}


def checkpoint_dir(model: str | None) -> str:
    """The checkpoint folder to serve: `model` (`~` expanded), or the built-in tiny one (built on first use).

    NOTE: the tiny checkpoint is deterministic, so each process (on each node) that resolves it finds or
    builds the same folder in its own cache.
    """
    return os.path.expanduser(model) if model is not None else str(default_tiny_checkpoint())


def load_family(model_dir: str, config: EngineConfig) -> ModelFamily:
    """The family of the checkpoint in `model_dir`, set up by `config`; reads config files, no weights yet."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face checkpoint folder (no config.json)")
    return FAMILIES[served_model_type(config_path)](Path(model_dir), config)


def served_model_type(config_path: Path) -> str:
    """The checkpoint's `model_type` (its config.json at `config_path`); ValueError if no family serves it."""
    model_type = json.loads(config_path.read_text()).get("model_type")
    if model_type in NOT_SERVED:
        raise ValueError(f"{config_path.parent}: {NOT_SERVED[model_type]}")
    if model_type not in FAMILIES:
        raise ValueError(f"{config_path.parent}: model_type {model_type!r} is not supported; "
                         f"known: {sorted(FAMILIES)}")
    return str(model_type)

