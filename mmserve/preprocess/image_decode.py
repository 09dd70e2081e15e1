"""Image bytes -> an RGB PIL image, refusing what a public endpoint must not decode.

Owns: the accepted formats, the pixel cap checked from the header before any pixel is decoded, a JPEG's
scan count checked before its scans are decoded, EXIF orientation, and alpha composited on white. Does not
own: where the bytes come from (`mmserve.preprocess.media`), hashing or the model's image processor. Every
error is a `MediaError`.
"""

from __future__ import annotations

import functools
import io
import re

from PIL import Image, ImageOps, UnidentifiedImageError

from mmserve.errors import MediaError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")  # JPEG covers MPO
# NOTE: a progressive JPEG is decoded scan by scan, each a pass over every coefficient of the image, so a few
# bytes of extra scans cost seconds of CPU that no deadline can stop (docs/reliability.md has the figures).
# Encoders write about 10; libjpeg-turbo's djpeg has -maxscans for this.
MAX_JPEG_SCANS = 100
# The next marker after entropy-coded data: 0xFF then neither a stuffed 0x00 nor a restart marker (RST0-7)
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


@functools.cache
def _openable_formats() -> tuple[str, ...]:
    Image.init()  # registers every plugin; a format this Pillow lacks (AVIF) is skipped
    return tuple(f for f in IMAGE_FORMATS if f in Image.OPEN)


def decode_image(data: bytes, *, max_pixels: int) -> Image.Image:
    """Bytes -> RGB image; checks the pixel count from the header before decoding pixels."""
    formats = _openable_formats()
    try:
        image: Image.Image = Image.open(io.BytesIO(data), formats=formats)
    except UnidentifiedImageError as err:
        raise MediaError(f"bytes are not a decodable image in a supported format {formats}") from err
    except Exception as err:  # DecompressionBombError, struct errors of a broken header, ...
        raise MediaError(f"bytes are not a decodable image ({type(err).__name__}: {err})") from err
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(f"image is {width}x{height} pixels, more than the {max_pixels}-pixel limit")
    if image.format in ("JPEG", "MPO") and jpeg_scans(data, MAX_JPEG_SCANS + 1) > MAX_JPEG_SCANS:
        raise MediaError(f"the JPEG has more than {MAX_JPEG_SCANS} scans: a cost to decode, not a picture")
    try:
        image.load()  # decodes the first frame; raises on truncated or corrupt data
        image = ImageOps.exif_transpose(image)
    except Exception as err:
        raise MediaError(f"image data is corrupt or truncated ({err})") from err
    try:
        return to_rgb(image)
    except Exception as err:  # e.g. a mode Pillow cannot convert (a TIFF's premultiplied gray and alpha, "La")
        raise MediaError(f"image mode {image.mode} cannot be converted to RGB ({err})") from err


def jpeg_scans(data: bytes, most: int) -> int:
    """The scans (start-of-scan markers) of the first image in JPEG `data`, counted up to `most`.

    NOTE: the markers are walked (segments skipped by their length, entropy-coded data to the next marker) up to
    the first image's end: a byte pair 0xFF 0xDA may also sit inside an EXIF segment or in data appended after
    the image (a phone's motion photo appends a video).
    """
    scans, i = 0, 2  # after the start-of-image marker
    while scans < most and i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xD9:  # end of image
            break
        length = int.from_bytes(data[i + 2:i + 4], "big")
        i += 2 + length
        if marker == 0xDA:  # a scan: its header, then entropy-coded data up to the next marker
            scans += 1
            found = _NEXT_MARKER.search(data, i)
            i = found.start() if found else len(data)
    return scans


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited on white (as transformers' `convert_to_rgb` does).

    NOTE: an RGB image may be transparent too (a PNG's tRNS colour key): transparency is looked for first.
    """
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")
