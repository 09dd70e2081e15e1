"""image_decode.py against hostile and odd images: decompression bombs in every accepted format refused
from the header, every PIL mode and animated images decoded as transformers' processor reads them."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageFile

from mmserve.config import MediaConfig
from mmserve.errors import MediaError
from mmserve.preprocess import image_decode
from mmserve.preprocess.image_decode import decode_image
from mmserve.preprocess.image_structure import jpeg_markers

BOMB_FORMATS = ["PNG", "GIF", "WEBP", "TIFF", "BMP"]
CAP = MediaConfig().max_image_pixels


def encode(image: Image.Image, fmt: str, **save: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture
def no_pixel_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: ImageFile.ImageFile) -> None:
        raise AssertionError("pixels were decoded")
    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


@pytest.mark.parametrize("fmt", BOMB_FORMATS)
def test_over_the_pixel_cap_is_refused_from_the_header_in_every_format(fmt: str, no_pixel_decoding: None) -> None:
    with pytest.raises(MediaError, match="64x64 pixels, more than the 4000-pixel limit"):
        decode_image(encode(noise(64, 64), fmt), max_pixels=4000)


def _png_header_claiming(width: int, height: int) -> bytes:
    data = bytearray(encode(Image.new("L", (8, 8)), "PNG"))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])  # size, then depth, colour, ...
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


def _jpeg_with_a_tag_past_its_file(tag: int, size: int) -> bytes:
    """An 8x8 JPEG whose EXIF has one tag (`tag`, `size` bytes) whose data lies past the end of the file: Pillow
    skips it with a warning that names the tag."""
    ifd = struct.pack("<2sHI", b"II", 42, 8) + struct.pack("<H", 1) + struct.pack("<HHII", tag, 7, size, 26) + \
        struct.pack("<I", 0)
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "JPEG", exif=b"Exif\x00\x00" + ifd)
    return buffer.getvalue()


def test_metadata_pillow_skips_with_a_warning_leaves_nothing_behind() -> None:
    """Pillow warns of each TIFF tag or EXIF entry it skips, with the file's own values in the message: a kept
    warning per tag made up would grow a registry (and print a line) with every such image."""
    def kept() -> int:
        return sum(len(vars(m).get("__warningregistry__", {})) for m in list(sys.modules.values())
                   if m is not None and getattr(m, "__name__", "").startswith("PIL"))

    with warnings.catch_warnings():
        warnings.resetwarnings()  # NOTE: Python's own filters, as a replica has them (pytest records every warning)
        warnings.simplefilter("default")
        image_decode.quiet_pillow_bomb_warnings()  # what importing the module does there
        before = kept()
        for i in range(20):
            assert decode_image(_jpeg_with_a_tag_past_its_file(1000 + i, 100 + i), max_pixels=10_000).size == (8, 8)
    assert kept() <= before + 1


def test_headers_past_pillows_own_limit_leave_nothing_behind(no_pixel_decoding: None) -> None:
    """Pillow warns past its limit with the size in the message; a kept warning per size made up would grow."""
    registry = vars(Image).setdefault("__warningregistry__", {})
    with warnings.catch_warnings():
        warnings.resetwarnings()  # NOTE: Python's own filters, as a replica has them (pytest records every warning)
        warnings.simplefilter("default")
        image_decode.quiet_pillow_bomb_warnings()  # what importing the module does there
        before = len(registry)
        for i in range(20):  # 90-99 M pixels: past Pillow's 89.5 M (a warning there), under twice it (no error)
            with pytest.raises(MediaError, match="pixel limit"):
                decode_image(_png_header_claiming(10_000, 9_000 + 50 * i), max_pixels=64_000_000)
    assert len(registry) <= before + 1
    # and importing the module is what installs it (pytest's own warning capture hides that from this process)
    installed = subprocess.run([sys.executable, "-c", "import warnings; from PIL import Image; "
                                "import mmserve.preprocess.image_decode; print(any(f[0] == 'ignore' and f[2] is "
                                "Image.DecompressionBombWarning for f in warnings.filters))"],
                               capture_output=True, text=True, timeout=60, check=True)
    assert installed.stdout.strip() == "True"


def _patched(fmt: str, offsets: tuple[int, int], pack: str, size: int) -> bytes:
    data = bytearray(encode(Image.new("L" if fmt != "BMP" else "RGB", (8, 8)), fmt))
    for offset in offsets:
        data[offset:offset + struct.calcsize(pack)] = struct.pack(pack, size)
    return bytes(data)


def _tiff_claiming(width: int, height: int) -> bytes:
    """A little-endian TIFF whose one IFD claims `width` x `height` 8-bit grey pixels over 8 bytes of data."""
    tags = [(256, 4, width), (257, 4, height), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 8),
            (278, 4, height), (279, 4, 8)]
    ifd = struct.pack("<H", len(tags)) + b"".join(struct.pack("<HHII", t, k, 1, v) for t, k, v in tags)
    return b"II*\0" + struct.pack("<I", 16) + b"\0" * 8 + ifd + b"\0\0\0\0"


# Headers that claim 8000 x 8000 (or 65535 x 65535) pixels over a few hundred bytes of data
BOMBS = {
    "PNG": lambda: _png_header_claiming(8000, 8000),
    "GIF": lambda: _patched("GIF", (6, 8), "<H", 65535),  # the logical screen
    "BMP": lambda: _patched("BMP", (18, 22), "<i", 8000),
    "TIFF": lambda: _tiff_claiming(8000, 8000),
}


@pytest.mark.parametrize("fmt", list(BOMBS))
def test_a_bomb_header_is_refused_at_the_default_cap_without_allocating(fmt: str, no_pixel_decoding: None) -> None:
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"pixels, more than the \d+-pixel limit|DecompressionBomb"):
        decode_image(BOMBS[fmt](), max_pixels=CAP)
    assert time.monotonic() - start < 1.0  # the header is read, 64 Mpx of RGB (192 MB) never are


# An AC refinement scan of a grey progressive JPEG: libjpeg-turbo passes over every coefficient again for each
REFINEMENT_SCAN = bytes.fromhex("ffda0008010100013f107ffeff00fdff00fbff00f7ff00efff00dfff00bfff0087")


def test_a_jpeg_of_many_scans_is_refused_before_its_scans_are_decoded(no_pixel_decoding: None) -> None:
    base = encode(Image.new("L", (4096, 4096), 128), "JPEG", progressive=True)
    bomb = base[:-2] + REFINEMENT_SCAN * 1000 + b"\xff\xd9"  # ~99 KB, minutes of decoding at this size
    start = time.monotonic()
    with pytest.raises(MediaError, match="more than 100 scans"):
        decode_image(bomb, max_pixels=CAP)
    assert time.monotonic() - start < 1.0


def test_a_stray_byte_between_segments_does_not_end_the_count(no_pixel_decoding: None) -> None:
    """libjpeg skips bytes between segments that are no marker, and decodes every scan after them."""
    base = encode(Image.new("L", (4096, 4096), 128), "JPEG", progressive=True)
    app0_end = 4 + int.from_bytes(base[4:6], "big")  # after SOI and the APP0 segment
    bomb = base[:app0_end] + b"\x00" + base[app0_end:-2] + REFINEMENT_SCAN * 1000 + b"\xff\xd9"
    with pytest.raises(MediaError, match="more than 100 scans"):
        decode_image(bomb, max_pixels=CAP)


def _png_chunk(kind: bytes, body: bytes = b"") -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _tiff_of_strips(strips: int, tile_first: bool = False) -> bytes:
    """A 1-pixel-wide grey TIFF with one row per strip (little-endian, uncompressed); `tile_first`: a
    TileOffsets entry of one tile listed before the strips' (Pillow reads the strips)."""
    n = 6 if tile_first else 5
    offsets_at = 8 + 2 + 12 * n + 4  # after the header and the IFD
    counts_at = offsets_at + 2 * strips
    pixels_at = counts_at + 2 * strips
    entries = [(256, 3, 1, 1), (257, 3, 1, strips), (273, 3, strips, offsets_at),  # width, height, StripOffsets
               (278, 3, 1, 1), (279, 3, strips, counts_at)]  # RowsPerStrip, StripByteCounts
    if tile_first:
        entries.insert(0, (324, 4, 1, pixels_at))
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + b"\0" * 4
    offsets = struct.pack(f"<{strips}H", *[(pixels_at + k) & 0xFFFF for k in range(strips)])
    return b"II*\x00" + struct.pack("<I", 8) + ifd + offsets + struct.pack(f"<{strips}H", *[1] * strips) + \
        b"\x80" * strips


@pytest.mark.parametrize("bomb", [
    # empty APP1 segments: Pillow keeps each in a list as it opens the file
    pytest.param(lambda: (lambda base: base[:2] + b"\xff\xe1\x00\x02" * 5000 + base[2:])(
        encode(noise(8, 8), "JPEG")), id="jpeg-segments"),
    # empty private chunks before the pixels: Pillow reads each as it opens the file
    pytest.param(lambda: (lambda base: base[:33] + _png_chunk(b"prVt") * 20_000 + base[33:])(
        encode(noise(8, 8), "PNG")), id="png-chunks"),
    # a strip per row of a 1-pixel-wide image: Pillow builds a tile per strip as it opens the file
    pytest.param(lambda: _tiff_of_strips(70_000), id="tiff-strips"),
    pytest.param(lambda: _tiff_of_strips(70_000, tile_first=True), id="tiff-strips-behind-one-tile"),
    # megabytes of fill bytes between segments: Pillow reads them one by one
    pytest.param(lambda: (lambda base: base[:20] + b"\xff" * (2 << 20) + base[20:])(encode(noise(8, 8), "JPEG")),
                 id="jpeg-fill"),
    # empty pixel chunks: read one by one too
    pytest.param(lambda: (lambda base: base[:33] + _png_chunk(b"IDAT") * 250_000 + base[33:])(
        encode(noise(8, 8), "PNG")), id="png-empty-pixel-chunks"),
])
def test_a_container_of_many_empty_parts_is_refused_before_it_is_opened(bomb: Any, no_pixel_decoding: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Pillow opened it")

    data = bomb()
    monkeypatch.setattr(Image, "open", never)
    with pytest.raises(MediaError, match="a cost to open, not a picture"):
        decode_image(data, max_pixels=CAP)


def test_a_byte_pair_that_is_no_marker_does_not_hide_the_scans_after_it(no_pixel_decoding: None) -> None:
    """0xFF 0x00 between segments is skipped as two bytes by libjpeg: read as a marker with a length, it had
    hidden every scan behind it from the count."""
    base = encode(Image.new("L", (1024, 1024), 128), "JPEG", progressive=True)
    body = base[2:-2] + REFINEMENT_SCAN * 150 + b"\xff\xd9"
    assert len(body) < 65_000  # one "length" jumps over it all
    bomb = b"\xff\xd8\xff\x00" + (len(body) + 2).to_bytes(2, "big") + body
    with pytest.raises(MediaError, match="more than 100 scans"):
        decode_image(bomb, max_pixels=CAP)


@pytest.mark.parametrize("header", [b"MM\x00+", b"II\x00*"])
def test_headers_pillow_reads_as_classic_tiff_are_read_so(header: bytes) -> None:
    """Pillow takes a file for a BigTIFF by its third byte only: "MM\\x00+" is a classic TIFF to it."""
    from mmserve.preprocess.image_structure import tiff_strips

    order = ">" if header[:2] == b"MM" else "<"
    entries = [(256, 3, 1, 1), (257, 4, 1, 70_000), (273, 4, 70_000, 4096)]
    ifd = struct.pack(f"{order}H", len(entries)) + b"".join(struct.pack(f"{order}HHII", *e) for e in entries)
    data = header + struct.pack(f"{order}I", 16) + struct.pack(f"{order}Q", 1 << 40) + ifd
    assert tiff_strips(data) == 70_000


def test_a_bigtiff_offset_past_any_file_is_a_4xx() -> None:
    with pytest.raises(MediaError):
        decode_image(b"II+\x00" + struct.pack("<HHQ", 8, 0, 1 << 63) + bytes(64), max_pixels=CAP)


def test_a_bigtiff_is_read_for_its_strips_too() -> None:
    from mmserve.preprocess.image_structure import tiff_strips

    entries = [(256, 3, 1, 1), (257, 4, 1, 70_000), (273, 16, 70_000, 4096)]  # BigTIFF: 8-byte counts, values
    ifd = struct.pack("<Q", len(entries)) + b"".join(struct.pack("<HHQQ", *e) for e in entries)
    data = b"II+\x00" + struct.pack("<HHQ", 8, 0, 16) + ifd
    assert tiff_strips(data) == 70_000
    with pytest.raises(MediaError, match="strips or tiles"):
        decode_image(data, max_pixels=CAP)


def test_an_animation_of_many_frames_counts_its_frames_as_pixels() -> None:
    """An APNG's frames are an fcTL and fdAT chunks each: past the cap on other chunks, not refused for it."""
    from mmserve.preprocess.image_structure import MAX_PNG_CHUNKS, png_chunks

    frames = b"".join(_png_chunk(b"fcTL", bytes(26)) + _png_chunk(b"fdAT", bytes(8)) for _ in range(MAX_PNG_CHUNKS))
    data = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", bytes(13)) + _png_chunk(b"acTL", bytes(8)) + frames
    other, every = png_chunks(data + _png_chunk(b"IEND"), 10**6, 10**6)
    assert other == 3 and every == 2 * MAX_PNG_CHUNKS + 3


def test_pictures_are_far_from_the_structure_caps() -> None:
    """What encoders write passes: a PNG whose pixels are split in many small chunks, a TIFF of a strip per row."""
    raw = zlib.compress(b"".join(b"\x00" + bytes(3 * 64) for _ in range(64)))
    head = struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", head) + b"".join(
        _png_chunk(b"IDAT", raw[k:k + 16]) for k in range(0, len(raw), 16)) + _png_chunk(b"IEND")
    assert decode_image(png, max_pixels=CAP).size == (64, 64)
    assert decode_image(_tiff_of_strips(4096), max_pixels=CAP).size == (1, 4096)


def test_a_progressive_jpeg_as_encoders_write_it_is_decoded() -> None:
    data = encode(noise(64, 48), "JPEG", progressive=True)
    assert jpeg_markers(data, 1000, 1000)[0] >= 2  # progressive: several scans
    assert decode_image(data, max_pixels=CAP).size == (64, 48)


def test_a_jpeg_with_a_video_appended_counts_its_own_scans_only() -> None:
    """A phone's motion photo appends an MP4 after the image's end: random bytes hold 0xFF 0xDA once per 64 KiB."""
    data = encode(noise(64, 48), "JPEG") + np.random.default_rng(1).bytes(8 << 20)
    assert data.count(b"\xff\xda") > 100 and jpeg_markers(data, 1000, 1000)[0] == 1
    assert decode_image(data, max_pixels=CAP).size == (64, 48)


def test_the_cap_is_settable_from_the_config() -> None:
    assert MediaConfig(max_image_pixels=10).max_image_pixels == 10
    with pytest.raises(ValueError):
        MediaConfig(max_image_pixels=0)


# --- modes and animations, as transformers' processor reads them ---------------------------------


def _modes() -> dict[str, tuple[Image.Image, str]]:
    base = noise(45, 30, seed=1)
    rgba = np.array(base.convert("RGBA"))
    rgba[..., 3] = np.random.default_rng(2).integers(0, 256, rgba.shape[:2])  # partial transparency
    grey16 = np.random.default_rng(3).integers(0, 65535, (30, 45)).astype(np.uint16)
    palette = base.convert("P")
    palette.info["transparency"] = 0
    keyed = base.copy()  # an RGB PNG whose tRNS chunk names one colour transparent (a colour key)
    keyed.info["transparency"] = keyed.getpixel((0, 0))
    return {"RGBA": (Image.fromarray(rgba), "PNG"), "LA": (Image.fromarray(rgba).convert("LA"), "PNG"),
            "RGB-colour-key": (keyed, "PNG"),
            "P": (base.convert("P"), "PNG"), "P-transparent": (palette, "PNG"),
            "CMYK": (base.convert("CMYK"), "JPEG"), "I;16": (Image.fromarray(grey16), "PNG"),
            "1": (base.convert("1"), "PNG"), "L": (base.convert("L"), "GIF"), "I": (base.convert("I"), "TIFF"),
            "F": (base.convert("F"), "TIFF")}


MODES = _modes()


@pytest.fixture(scope="module")
def image_processor(tiny_ckpt_224: Path) -> Any:
    from transformers import AutoImageProcessor
    return AutoImageProcessor.from_pretrained(tiny_ckpt_224)


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_gives_the_pixels_transformers_gives(image_processor: Any, mode: str) -> None:
    image, fmt = MODES[mode]
    data = encode(image, fmt)
    ours = image_processor(decode_image(data, max_pixels=CAP), return_tensors="np")["pixel_values"]
    # transformers' own reading of the file: its processor converts to RGB (alpha on white)
    ref = image_processor(Image.open(io.BytesIO(data)), do_convert_rgb=True, return_tensors="np")["pixel_values"]
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_an_animated_image_is_its_first_frame(fmt: str) -> None:
    frames = [Image.new("RGB", (16, 16), colour) for colour in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0,
                  **({"lossless": True} if fmt == "WEBP" else {}))
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 3  # the file really is animated
    assert decode_image(data, max_pixels=CAP).getpixel((8, 8)) == (255, 0, 0)


def test_a_mode_pillow_cannot_convert_to_rgb_is_a_4xx() -> None:
    """A TIFF of gray with premultiplied alpha (ExtraSamples 1) opens as mode "La", which Pillow cannot make RGB."""
    data = bytearray(encode(Image.new("LA", (4, 4), (100, 200)), "TIFF"))
    order = "<" if data[:2] == b"II" else ">"
    ifd = struct.unpack(order + "I", data[4:8])[0]
    for k in range(struct.unpack(order + "H", data[ifd:ifd + 2])[0]):
        entry = ifd + 2 + 12 * k
        if struct.unpack(order + "H", data[entry:entry + 2])[0] == 338:  # ExtraSamples: 2 (straight) -> 1
            data[entry + 8:entry + 10] = struct.pack(order + "H", 1)
    assert Image.open(io.BytesIO(bytes(data))).mode == "La"
    with pytest.raises(MediaError, match="mode La cannot be converted"):
        decode_image(bytes(data), max_pixels=MediaConfig().max_image_pixels)
