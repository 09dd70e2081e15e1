"""hashing.py: the key follows the decoded pixels, the model and the output-changing kwargs."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmserve.models.gemma3_prompt import PROCESSOR_DEFAULTS
from mmserve.preprocess.hashing import hash_image, hash_source
from mmserve.preprocess.image_decode import decode_image

RNG = np.random.default_rng(0)
PIXELS = Image.fromarray(RNG.integers(0, 256, (24, 32, 3), dtype=np.uint8))


def roundtrip(fmt: str, **save: object) -> Image.Image:
    buf = io.BytesIO()
    PIXELS.save(buf, fmt, **save)
    return decode_image(buf.getvalue(), max_pixels=10_000)


def key(image: Image.Image, model_id: str = "m", **kwargs: object) -> str:
    return hash_image(image, model_id=model_id, kwargs=kwargs, defaults=PROCESSOR_DEFAULTS)


def test_shape_of_the_key() -> None:
    digest = key(PIXELS)
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_byte_different_encodings_of_the_same_pixels_share_a_key() -> None:
    encodings = [roundtrip("PNG", compress_level=0), roundtrip("PNG", compress_level=9, optimize=True),
                 roundtrip("WEBP", lossless=True), roundtrip("BMP"), roundtrip("TIFF")]
    assert {key(image) for image in encodings} == {key(PIXELS)}


def test_lossy_encoding_changes_the_key() -> None:
    assert key(roundtrip("JPEG", quality=90)) != key(PIXELS)


def test_explicit_defaults_hash_like_omitted_ones() -> None:
    explicit = dict(PROCESSOR_DEFAULTS)
    assert key(PIXELS, **explicit) == key(PIXELS) == key(PIXELS, do_pan_and_scan=False)
    assert key(PIXELS, pan_and_scan_min_ratio_to_activate=2) == key(
        PIXELS, pan_and_scan_min_ratio_to_activate=2.0)  # 2 and 2.0 process alike
    # without defaults, the caller's resolved kwargs are hashed as given
    assert hash_image(PIXELS, model_id="m", kwargs=explicit) == key(PIXELS)


@pytest.mark.parametrize("change", [
    {"do_pan_and_scan": True}, {"pan_and_scan_max_num_crops": 3}, {"pan_and_scan_min_crop_size": 128},
    {"pan_and_scan_min_ratio_to_activate": 1.5},
])
def test_output_changing_kwargs_change_the_key(change: dict[str, Any]) -> None:
    assert key(PIXELS, **change) != key(PIXELS)


def test_model_pixels_mode_and_size_change_the_key() -> None:
    base = key(PIXELS)
    assert key(PIXELS, model_id="other") != base
    edited = PIXELS.copy()
    edited.putpixel((0, 0), (0, 0, 0) if PIXELS.getpixel((0, 0)) != (0, 0, 0) else (1, 1, 1))
    assert key(edited) != base
    # same bytes, other layout: 32x24 vs 24x32 share tobytes() but not the key
    assert key(Image.frombytes("RGB", (24, 32), PIXELS.tobytes())) != base
    gray = Image.new("L", (3, 2))
    assert key(gray) != key(Image.frombytes("P", (3, 2), gray.tobytes()))


def test_palette_is_part_of_a_paletted_image() -> None:
    a = Image.new("P", (2, 2), 1)
    b = a.copy()
    a.putpalette([0, 0, 0, 255, 0, 0])
    b.putpalette([0, 0, 0, 0, 255, 0])
    assert a.tobytes() == b.tobytes() and key(a) != key(b)


def test_a_cache_salt_gives_keys_of_its_own() -> None:
    def both(salt: str | None) -> tuple[str, str]:
        return (hash_image(PIXELS, model_id="m", kwargs={}, salt=salt),
                hash_source(b"bytes", model_id="m", kwargs={}, salt=salt))

    plain = both(None)
    assert plain == (hash_image(PIXELS, model_id="m", kwargs={}), hash_source(b"bytes", model_id="m", kwargs={}))
    salted = {salt: both(salt) for salt in ("a", "b")}
    assert salted["a"] == both("a")  # the same salt: the same keys
    assert len({plain[0], salted["a"][0], salted["b"][0]}) == 3
    assert len({plain[1], salted["a"][1], salted["b"][1]}) == 3


def test_an_items_key_follows_the_checkpoints_image_processor_files_under_one_served_name(
        tiny_ckpt_224: Path, tmp_path: Path) -> None:
    """A rolling upgrade to a checkpoint that processes otherwise, under the same name, shares the processor
    cache with the old replicas: its items must not be found under the old keys."""
    from mmserve.preprocess.hashing import processor_fingerprint
    from tests.unit.preprocess.test_preprocessor import CAT, make, one_image

    copy = Path(shutil.copytree(tiny_ckpt_224, tmp_path / "same-name"))
    assert processor_fingerprint(copy) == processor_fingerprint(tiny_ckpt_224)
    config = json.loads((copy / "preprocessor_config.json").read_text())
    config["resample"] = 3 if config.get("resample") != 3 else 2  # another resampling filter
    (copy / "preprocessor_config.json").write_text(json.dumps(config))
    assert processor_fingerprint(copy) != processor_fingerprint(tiny_ckpt_224)
    keys = [make(ckpt).process(one_image(CAT)).features[0].identifier for ckpt in (tiny_ckpt_224, copy)]
    assert keys[0] != keys[1]


@pytest.mark.parametrize("name", ["preprocessor_config.json", "processor_config.json"])
def test_the_fingerprint_reads_every_file_the_image_processor_reads(tiny_ckpt_224: Path, tmp_path: Path,
                                                                     name: str) -> None:
    """Either file changed (or written where there was none) is another fingerprint."""
    from mmserve.preprocess.hashing import processor_fingerprint

    copy = Path(shutil.copytree(tiny_ckpt_224, tmp_path / "copy"))
    path = copy / name
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, "do_pan_and_scan": not config.get("do_pan_and_scan", False)}))
    assert processor_fingerprint(copy) != processor_fingerprint(tiny_ckpt_224)


# NOTE: named here, not read from hashing.PROCESSING_LIBRARIES: a library dropped from it must fail this test
@pytest.mark.parametrize("library", ["transformers", "numpy", "torch", "torchvision", "PIL"])
def test_an_items_key_follows_the_version_of_the_libraries_that_process_it(
        tiny_ckpt_224: Path, library: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rolling upgrade to an image with another transformers, torchvision (installed or not) or Pillow may
    resample otherwise; a library that is not installed counts as such, not as an error."""
    import importlib.metadata

    import PIL

    from mmserve.preprocess import hashing

    before = hashing.processor_fingerprint(tiny_ckpt_224)
    if library == "PIL":
        monkeypatch.setattr(PIL, "__version__", "0.0.1")
    else:
        real = importlib.metadata.version
        monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == library else real(name))
    assert hashing.processor_fingerprint(tiny_ckpt_224) != before
