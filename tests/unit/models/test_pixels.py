"""PixelNormalization and as_uint8: the image processor's last step, as the encoder runs it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.models.pixels import DEFER_TO_ENCODER, PixelNormalization, as_uint8
from tests.numerics import assert_close_ulps

CLIP = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


def photo(seed: int, width: int = 300, height: int = 200) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("config", [
    {},  # Gemma 3's own: 1/255, mean = std = 0.5
    {**CLIP, "rescale_factor": 1 / 255},  # a different value per channel: order and broadcasting matter
    {"do_normalize": False},
    {"do_rescale": False, **CLIP},
])
def test_encoder_side_equals_the_processor_doing_it(tiny_ckpt_224: Path, config: dict) -> None:
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(tiny_ckpt_224, **config)
    images = [photo(1), photo(2, 120, 400)]
    full = processor(images, return_tensors="np")["pixel_values"]  # (2, 3, 224, 224) float32
    raw = processor(images, return_tensors="np", **DEFER_TO_ENCODER)["pixel_values"]
    assert raw.dtype == np.uint8 and raw.shape == full.shape
    ours = PixelNormalization.from_config(processor.to_dict())(torch.from_numpy(raw))
    assert ours.dtype == torch.float32
    # NOTE: no sums here: per value, ours rounds a fused multiply-add, the processor a multiply, a
    # subtract and a divide; a few roundings at the output's scale (~1, or ~950 unscaled). Std 1% off
    # is ~1e5 ulps away.
    assert_close_ulps(ours, full, ulps=4)


def test_reads_the_checkpoint_like_the_processor(tiny_ckpt_224: Path) -> None:
    from transformers import AutoImageProcessor

    saved = json.loads((tiny_ckpt_224 / "preprocessor_config.json").read_text())
    assert PixelNormalization.from_checkpoint(tiny_ckpt_224) == PixelNormalization.from_config(saved)
    loaded = AutoImageProcessor.from_pretrained(tiny_ckpt_224).to_dict()
    assert PixelNormalization.from_checkpoint(tiny_ckpt_224) == PixelNormalization.from_config(loaded)


def test_float_pixels_are_refused() -> None:
    with pytest.raises(TypeError, match="uint8"):
        PixelNormalization(1 / 255, (0.5,) * 3, (0.5,) * 3)(torch.zeros(1, 3, 2, 2))


def test_as_uint8_keeps_whole_values_and_refuses_others() -> None:
    whole = np.array([[0.0, 17.0, 255.0]], dtype=np.float32)
    assert as_uint8(whole).dtype == np.uint8 and as_uint8(whole).tolist() == [[0, 17, 255]]
    for bad in (np.array([0.5]), np.array([-1.0]), np.array([256.0])):
        with pytest.raises(RuntimeError, match=r"0\.\.255"):
            as_uint8(bad)
