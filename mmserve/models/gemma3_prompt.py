"""Gemma 3's own prompt rule: its image tokens, its output-changing processor kwargs, its expansion.

Owns: the strings the Gemma 3 tokenizer uses around images, the image-processor kwargs that change
the processed pixels (with their defaults and valid ranges), and `expand_image_placeholders`, which
rewrites each `<start_of_image>` the chat template emitted exactly as transformers'
`Gemma3Processor.replace_image_token` does, and reading one image's tiles from its processor's output. Does
not own: tokenizing or running the image processor (mmserve/preprocess/preprocessor.py), nor finding
placeholder ranges (mmserve/preprocess/image_runs.py), which work for any rule of this shape.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.errors import InvalidRequestError
from mmserve.models.pixels import image_processor_config

BOI_TOKEN = "<start_of_image>"  # the template's per-image placeholder, kept in the expansion
IMAGE_TOKEN = "<image_soft_token>"  # one embedding row of an image
EOI_TOKEN = "<end_of_image>"
# NOTE: the chat template's own markers: in user text they would be tokenized as the special tokens and
# forge turns (a "model" turn the model never wrote) or end the prompt early.
CONTROL_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>")

# Gemma3Processor.images_kwargs: the class defaults a processor call uses when none is given.
PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_pan_and_scan": False,
    "pan_and_scan_min_crop_size": 256,  # pixels
    "pan_and_scan_max_num_crops": 4,  # crops, the whole image not counted
    "pan_and_scan_min_ratio_to_activate": 1.2,  # long side / short side
}
MAX_CROPS_CAP = 16  # NOTE: our bound on a request's pan_and_scan_max_num_crops (memory, compute)


def full_image_sequence(mm_tokens: int, *, boi: str = BOI_TOKEN, image_token: str = IMAGE_TOKEN,
                        eoi: str = EOI_TOKEN) -> str:
    """One image (or crop) as text: blank lines, boi, `mm_tokens` image tokens, eoi, blank lines."""
    return f"\n\n{boi}{image_token * mm_tokens}{eoi}\n\n"


def expand_image_placeholders(text: str, crops_per_item: list[int], mm_tokens: int, *,
                              boi: str = BOI_TOKEN, image_token: str = IMAGE_TOKEN,
                              eoi: str = EOI_TOKEN) -> str:
    """Replace the i-th `boi` of `text` with item i's expansion (its crops included)."""
    pieces = text.split(boi)
    if len(pieces) - 1 != len(crops_per_item):
        raise ValueError(f"text has {len(pieces) - 1} {boi} placeholders for {len(crops_per_item)} items")
    full = full_image_sequence(mm_tokens, boi=boi, image_token=image_token, eoi=eoi)
    out = [pieces[0]]
    for crops, piece in zip(crops_per_item, pieces[1:], strict=True):
        if crops:  # pan-and-scan: the whole image, then each crop
            out.append(f"Here is the original image {full} and here are some crops to help you see better "
                       + " ".join([full] * crops))
        else:
            out.append(full)
        out.append(piece)
    return "".join(out)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"mm_processor_kwargs.{name} must be a boolean, got {value!r}")
    return value


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequestError(f"mm_processor_kwargs.{name} must be an integer {bound}, got {value!r}")
    return int(value)


def _check_ratio(name: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:  # NOTE: JSON's integers are unbounded: one past a float's range is no finite number either
        ok = ok and math.isfinite(value) and value > 0
    except OverflowError:
        ok = False
    if not ok:
        raise InvalidRequestError(f"mm_processor_kwargs.{name} must be a finite number > 0, "
                                  f"got {str(value)[:40]!r}")
    return float(value)


_CHECKS = {
    "do_pan_and_scan": _check_bool,
    # NOTE: at least the most crops a request may ask: transformers' crops are ceil(side / n) wide, and one narrower
    # than n can leave the last crop past the image's edge, empty (the processor raises, or pads a blank tile)
    "pan_and_scan_min_crop_size": lambda n, v: _check_int(n, v, MAX_CROPS_CAP),
    "pan_and_scan_max_num_crops": lambda n, v: _check_int(n, v, 1, MAX_CROPS_CAP),
    "pan_and_scan_min_ratio_to_activate": _check_ratio,
}


@dataclass(frozen=True)
class Gemma3PromptRule:
    """Gemma 3's placeholder rule as data; shared code calls it without asking which model it is."""

    mm_tokens: int  # image tokens per image or crop (= mm_tokens_per_image)
    defaults: tuple[tuple[str, Any], ...] = tuple(PROCESSOR_DEFAULTS.items())  # output-changing kwargs
    placeholder: str = BOI_TOKEN  # what the chat template emits for each {"type": "image"} part
    image_token: str = IMAGE_TOKEN
    boi_token: str = BOI_TOKEN
    eoi_token: str = EOI_TOKEN
    control_tokens: tuple[str, ...] = CONTROL_TOKENS

    @property
    def output_kwargs_defaults(self) -> dict[str, Any]:
        return dict(self.defaults)

    @property
    def reserved_strings(self) -> tuple[str, ...]:
        """Strings user text may not contain: they would fake or break image placeholders or turns."""
        return (self.boi_token, self.image_token, self.eoi_token, *self.control_tokens)

    def expand(self, text: str, crops_per_item: list[int]) -> str:
        return expand_image_placeholders(text, crops_per_item, self.mm_tokens, boi=self.boi_token,
                                         image_token=self.image_token, eoi=self.eoi_token)

    def tiles(self, processed: Mapping[str, Any]) -> np.ndarray:
        """One image's tiles from the image processor's output: `pixel_values`, the whole image then its
        `num_crops` crops ((1 + crops, 3, H, W)); raises when they do not add up."""
        pixels, crops = processed["pixel_values"], int(processed["num_crops"][0])
        if pixels.shape[0] != 1 + crops:
            raise RuntimeError(f"image processor returned {pixels.shape[0]} tiles for {crops} crops")
        return pixels

    def num_embeds(self, crops: int) -> int:
        """Embedding rows (= image-token positions) of an item with `crops` pan-and-scan crops."""
        return (crops + 1) * self.mm_tokens

    def resolve_kwargs(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults updated by the request's kwargs, each checked; unknown keys are refused; a null one is the
        default (as transformers' processor takes None)."""
        unknown = sorted(set(overrides) - set(_CHECKS))
        if unknown:
            raise InvalidRequestError(f"unknown mm_processor_kwargs {unknown}; "
                                      f"supported: {sorted(_CHECKS)}")
        resolved = self.output_kwargs_defaults
        for name, value in overrides.items():
            if value is not None:
                resolved[name] = _CHECKS[name](name, value)
        if not resolved["do_pan_and_scan"]:  # NOTE: the other pan-and-scan settings change nothing then: one key
            resolved.update((k, v) for k, v in self.defaults if k.startswith("pan_and_scan_"))
        return resolved

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, mm_tokens: int | None = None) -> Gemma3PromptRule:
        """Read the checkpoint's JSON files only (no tokenizer or processor is loaded)."""
        folder = Path(model_dir)
        processor_cfg = _read_json(folder / "processor_config.json")
        image_cfg = image_processor_config(folder)
        tokenizer_cfg = _read_json(folder / "tokenizer_config.json")
        if mm_tokens is None:
            mm_tokens = int(processor_cfg.get("image_seq_length") or image_cfg["image_seq_length"])
        boi = tokenizer_cfg.get("boi_token", BOI_TOKEN)
        return cls(
            mm_tokens=mm_tokens,
            defaults=tuple(_saved_defaults(image_cfg).items()),
            placeholder=boi,
            image_token=tokenizer_cfg.get("image_token", IMAGE_TOKEN),
            boi_token=boi,
            eoi_token=tokenizer_cfg.get("eoi_token", EOI_TOKEN),
        )

    @classmethod
    def from_processor(cls, processor: Any) -> Gemma3PromptRule:
        """Read a loaded `Gemma3Processor`: tokens per image, token strings, saved kwarg defaults.

        NOTE: defaults come from the checkpoint's image-processor config where it sets them (not
        null), else from Gemma3Processor's class defaults, which a plain processor call would use
        even over the saved config. We pass every kwarg explicitly on every call anyway.
        """
        image_processor = processor.image_processor
        saved = {name: getattr(image_processor, name, None) for name in PROCESSOR_DEFAULTS}
        defaults = _saved_defaults(saved)
        tokenizer = processor.tokenizer
        return cls(
            mm_tokens=int(processor.image_seq_length),
            defaults=tuple(defaults.items()),
            placeholder=tokenizer.boi_token,
            image_token=tokenizer.image_token,
            boi_token=tokenizer.boi_token,
            eoi_token=tokenizer.eoi_token,
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _saved_defaults(saved: Mapping[str, Any]) -> dict[str, Any]:
    """Class defaults, overridden by the values a checkpoint saved (null means not saved)."""
    defaults = dict(PROCESSOR_DEFAULTS)
    for name, default in PROCESSOR_DEFAULTS.items():
        if saved.get(name) is not None:
            defaults[name] = type(default)(saved[name])
    return defaults
