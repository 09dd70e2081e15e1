"""A checkpoint's recommended sampling: the values of its generation_config.json that a request's unset fields take.

Owns: reading them (temperature, top_p, top_k, min_p, repetition_penalty: the fields of vLLM's default
`--generation-config auto` that mmserve samples with) and refusing values no request could use. Does not own
applying them to a request (the HTTP edge: `mmserve/api/protocol.py`) nor whether they apply at all
(`EngineConfig.sampling_defaults_from_checkpoint`).

NOTE: Gemma 3's file recommends top_k 64 and top_p 0.95. OpenAI's defaults (temperature 1, no truncation)
would draw from all 262k tokens of its vocabulary: lower-quality text than the model's authors meant, and
unlike what the same request gets from vLLM. `do_sample` is not read (vLLM does not either): a request
is greedy when it asks for temperature 0. A value equal to transformers' own default (`GenerationConfig`:
temperature 1.0, top_p 1.0, top_k 50, repetition_penalty 1.0; min_p unset) is not a recommendation, as vLLM reads it
(`to_diff_dict`): a file spelling out top_k 50 keeps a request untruncated there, and here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mmserve.errors import InvalidSamplingError
from mmserve.messages import SamplingDefaults, SamplingParams

log = logging.getLogger(__name__)


def _valid(name: str, value: Any) -> bool:
    """Whether `value` is one a request could set for `name`: a number that SamplingParams.validate takes."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if name == "top_k" and not float(value).is_integer():
        return False
    field: dict[str, Any] = {name: int(value) if name == "top_k" else float(value)}
    try:
        SamplingParams(**field).validate()
    except InvalidSamplingError:
        return False
    return True


# transformers' GenerationConfig defaults of the fields read: a file's value equal to one is not read (NOTE above)
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0, "min_p": None}


def sampling_defaults(model_dir: Path, *, enabled: bool = True) -> SamplingDefaults:
    """The sampling fields the checkpoint's generation_config.json sets (none without the file, or when not
    `enabled`: `EngineConfig.sampling_defaults_from_checkpoint`); a value out of a request's range is left out,
    with a warning."""
    path = model_dir / "generation_config.json"
    raw = json.loads(path.read_text()) if enabled and path.exists() else {}
    if not isinstance(raw, dict):
        log.warning("generation_config.json is not a JSON object; no sampling defaults read from it")
        return SamplingDefaults()
    found: dict[str, Any] = {}
    for name, transformers_default in _TRANSFORMERS_DEFAULTS.items():
        value = raw.get(name)
        if value is None or value == transformers_default:
            continue
        if not _valid(name, value):
            log.warning("generation_config.json: %s=%r is not a value a request may set; not used", name, value)
            continue
        found[name] = int(value) if name == "top_k" else float(value)
    return SamplingDefaults(**found)
