"""mmserve: a multimodal LLM serving engine (pure Python; the Ray Serve layer lives in deployments/).

The library's entry points are importable from here (`from mmserve import Engine, EngineConfig`); each is
loaded on first use, so that importing a light submodule (the HTTP edge's `mmserve.api`) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmserve.config import EngineConfig
    from mmserve.engine import Completion, Engine
    from mmserve.messages import ChatRequest, SamplingParams
    from mmserve.runtime.step_loop import StageStopped

_HOMES = {"Engine": "mmserve.engine", "Completion": "mmserve.engine", "EngineConfig": "mmserve.config",
          "ChatRequest": "mmserve.messages", "SamplingParams": "mmserve.messages",
          "StageStopped": "mmserve.runtime.step_loop"}
__all__ = ["ChatRequest", "Completion", "Engine", "EngineConfig", "SamplingParams", "StageStopped"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'mmserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
