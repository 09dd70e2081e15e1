"""The last step of a Hugging Face image processor, moved from the preprocess stage to the encoder.

Owns: `PixelNormalization` (rescale then per-channel normalize, as the checkpoint's image-processor
config says) and the processor kwargs that make the preprocess stage stop before that step, so
processed items stay `uint8` (1 byte per value instead of float32's 4: a quarter of the bytes in the
processor cache and through the object store, and the float work runs where the vision tower runs).
Does not own: resizing or pan-and-scan (the HF processor still does those), nor which processor a
model uses.

NOTE: the arithmetic is transformers' own torch backend's fused form, `(x - mean / scale) / (std /
scale)` in float32; its PIL backend (rescale, then normalize, in numpy) agrees within one float32 ulp.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmserve.runtime.host_copy import floats_to_device

# What the preprocess stage passes to the HF image processor so it returns resized uint8 pixels.
DEFER_TO_ENCODER: dict[str, bool] = {"do_rescale": False, "do_normalize": False}


@dataclass(frozen=True)
class PixelNormalization:
    rescale_factor: float | None  # multiplier of the uint8 values (e.g. 1/255); None = no rescale
    mean: tuple[float, ...] | None  # per channel, after rescaling; None = no normalize
    std: tuple[float, ...] | None  # per channel, after rescaling

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PixelNormalization:
        """From an image-processor config (`preprocessor_config.json`); transformers' defaults where unset."""
        scale = float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None
        if not config.get("do_normalize", True):
            return cls(scale, None, None)
        mean, std = config.get("image_mean", [0.5] * 3), config.get("image_std", [0.5] * 3)
        return cls(scale, _per_channel(mean), _per_channel(std))

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> PixelNormalization:
        return cls.from_config(image_processor_config(model_dir))

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """(n, C, H, W) uint8 -> (n, C, H, W) float32 on the same device, as the HF processor would give."""
        if pixels.dtype != torch.uint8:
            raise TypeError(f"expected uint8 pixels (the preprocess stage's output), got {pixels.dtype}")
        x = pixels.to(torch.float32)
        scale = 1.0 if self.rescale_factor is None else self.rescale_factor
        if self.mean is None or self.std is None:
            return x.mul_(scale)
        # NOTE: non-blocking copies: a blocking one waits for the device's queue before the forward is queued
        mean = floats_to_device(self.mean, x.device).view(1, -1, 1, 1) * (1.0 / scale)  # (1, C, 1, 1)
        std = floats_to_device(self.std, x.device).view(1, -1, 1, 1) * (1.0 / scale)
        return x.sub_(mean).div_(std)


def image_processor_config(model_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's image-processor config: `preprocessor_config.json`, else the `image_processor`
    section of `processor_config.json` (where newer transformers save it), else empty."""
    folder = Path(model_dir)
    own = folder / "preprocessor_config.json"
    if own.is_file():
        return dict(json.loads(own.read_text()))
    processor = folder / "processor_config.json"
    return dict(json.loads(processor.read_text()).get("image_processor", {})) if processor.is_file() else {}


def as_uint8(pixels: np.ndarray) -> np.ndarray:
    """The processor's resized pixels as uint8; refuses values a uint8 cannot hold exactly."""
    if pixels.dtype == np.uint8:
        return np.ascontiguousarray(pixels)
    if pixels.size and (pixels.min() < 0 or pixels.max() > 255 or not np.array_equal(pixels, np.rint(pixels))):
        raise RuntimeError(f"image processor returned {pixels.dtype} pixels that are not whole values in "
                           "0..255 with rescale and normalize off")
    return np.ascontiguousarray(pixels, dtype=np.uint8)


def _per_channel(values: float | list[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values) if isinstance(values, list | tuple) else (float(values),) * 3
