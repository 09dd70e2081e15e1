"""Gemma 3's vision tower and projector alone, loaded from a whole checkpoint.

Owns: a transformers model holding only `model.vision_tower` and `model.multi_modal_projector`, under the
names `Gemma3ForConditionalGeneration` gives them, so that `from_pretrained` maps every checkpoint layout
the same way (google's original key names, older transformers' and the current ones: the model type's own
renames) and skips the text model's tensors as keys it does not expect: they are never read. An Encoder
replica then reads ~0.4 B parameters of gemma-3-4b, not its 4.3 B. Does not own the forward (gemma3.py
wraps these parts) nor the text model (gemma3.py loads the whole checkpoint for it).

NOTE: imported only when the vision parts load: transformers' modeling code takes seconds to import.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import AutoModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector, Gemma3PreTrainedModel

from mmserve.models.gemma3 import TEXT_WEIGHTS


class _VisionModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)


class Gemma3VisionParts(Gemma3PreTrainedModel):
    # NOTE: the text model's keys in any layout; expected to be there, not loaded
    _keys_to_ignore_on_load_unexpected = [TEXT_WEIGHTS.pattern]

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = _VisionModel(config)
        self.post_init()
