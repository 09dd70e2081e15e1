"""Gemma 3's prompt rule: the placeholder expansion is transformers' own, the rule read from the checkpoint's
files equals the one a loaded Gemma3Processor implies, and saved kwarg defaults are honoured."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mmserve.models.gemma3_prompt import Gemma3PromptRule
from mmserve.preprocess.preprocessor import Preprocessor
from tests.unit.preprocess.test_preprocessor import WIDE, make, one_image


@pytest.fixture(scope="module")
def pre(tiny_ckpt: Path) -> Preprocessor:
    return make(tiny_ckpt)


def test_rule_expansion_is_transformers_replacement(pre: Preprocessor) -> None:
    text = "a<start_of_image>b<start_of_image>c"
    expected = text.split("<start_of_image>")
    replacements = [pre.processor.replace_image_token({"num_crops": [c]}, 0) for c in (0, 2)]
    assert pre.rule.expand(text, [0, 2]) == (expected[0] + replacements[0] + expected[1]
                                             + replacements[1] + expected[2])
    with pytest.raises(ValueError, match="2 <start_of_image> placeholders for 1 items"):
        pre.rule.expand(text, [0])


def test_rule_from_checkpoint_matches_processor_and_reads_saved_defaults(tiny_ckpt_224: Path,
                                                                         tmp_path: Path) -> None:
    rule = Gemma3PromptRule.from_checkpoint(tiny_ckpt_224)
    assert rule == Gemma3PromptRule.from_processor(make(tiny_ckpt_224).processor)
    assert rule.output_kwargs_defaults["do_pan_and_scan"] is False  # null in the saved config
    ckpt = Path(shutil.copytree(tiny_ckpt_224, tmp_path / "pas"))
    config_path = ckpt / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config.update(do_pan_and_scan=True, pan_and_scan_max_num_crops=2)
    config_path.write_text(json.dumps(config))
    saved, rule = make(ckpt), Gemma3PromptRule.from_checkpoint(ckpt)
    assert rule == Gemma3PromptRule.from_processor(saved.processor)
    assert rule.output_kwargs_defaults["pan_and_scan_max_num_crops"] == 2
    assert saved.process(one_image(WIDE)).features[0].data.pixel_values.shape[0] == 3  # 2 crops + whole


def test_an_items_tiles_are_the_image_then_its_crops_or_the_output_is_refused() -> None:
    rule = Gemma3PromptRule(mm_tokens=4)
    pixels = np.zeros((3, 3, 8, 8), dtype=np.uint8)  # (1 + 2 crops, 3, H, W)
    assert rule.tiles({"pixel_values": pixels, "num_crops": np.array([2])}) is pixels
    with pytest.raises(RuntimeError, match="3 tiles for 1 crops"):
        rule.tiles({"pixel_values": pixels, "num_crops": np.array([1])})


def test_a_ratio_past_a_floats_range_is_a_4xx_naming_it() -> None:
    from mmserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="pan_and_scan_min_ratio_to_activate must be a finite number"):
        Gemma3PromptRule(mm_tokens=4).resolve_kwargs({"pan_and_scan_min_ratio_to_activate": 10**400})


def test_a_crop_size_below_the_crop_cap_is_a_4xx_naming_it() -> None:
    """A 5x1 image with min crop size 1 would get 4 crops 2 wide, the last past its edge, empty (a 500 or a
    blank tile before): the crop size must be at least the most crops a request may ask."""
    from mmserve.errors import InvalidRequestError
    from mmserve.models.gemma3_prompt import MAX_CROPS_CAP

    rule = Gemma3PromptRule(mm_tokens=4)
    with pytest.raises(InvalidRequestError, match=f"pan_and_scan_min_crop_size must be an integer >= {MAX_CROPS_CAP}"):
        rule.resolve_kwargs({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 1})
    assert rule.resolve_kwargs({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": MAX_CROPS_CAP})[
        "pan_and_scan_min_crop_size"] == MAX_CROPS_CAP


def test_a_null_setting_is_its_default_as_transformers_takes_none() -> None:
    rule = Gemma3PromptRule(mm_tokens=4)
    nulls = {"do_pan_and_scan": None, "pan_and_scan_min_crop_size": None, "pan_and_scan_max_num_crops": None,
             "pan_and_scan_min_ratio_to_activate": None}
    assert rule.resolve_kwargs(nulls) == rule.resolve_kwargs({})
    assert rule.resolve_kwargs({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": None}) == \
        rule.resolve_kwargs({"do_pan_and_scan": True})


def test_pan_and_scan_settings_without_pan_and_scan_resolve_as_the_defaults() -> None:
    """They change nothing then: one cache key for the image, whatever a client sends with them."""
    rule = Gemma3PromptRule(mm_tokens=4)
    odd = {"pan_and_scan_max_num_crops": 9, "pan_and_scan_min_crop_size": 32}
    assert rule.resolve_kwargs(odd) == rule.resolve_kwargs({}) == rule.resolve_kwargs({"do_pan_and_scan": False})
    assert rule.resolve_kwargs({"do_pan_and_scan": True, **odd})["pan_and_scan_max_num_crops"] == 9
