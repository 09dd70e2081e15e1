"""Image bytes -> an RGB PIL image, refusing what a public endpoint must not decode.

Owns: the accepted formats, the pixel cap checked from the header before any pixel is decoded (a container's
structure checked before it is opened: `image_structure.py`), EXIF orientation, and alpha composited on white. Does not
own: where the bytes come from (`mmserve.preprocess.media`), hashing or the model's image processor. Every
error is a `MediaError`.
"""

from __future__ import annotations

import functools
import io
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from mmserve.errors import MediaError
from mmserve.preprocess.image_structure import check_structure

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")  # JPEG covers MPO


def quiet_pillow_bomb_warnings() -> None:
    """Ignore Pillow's warnings: about a header past its own pixel limit (our cap refuses such an image anyway), and
    about what it skips in a file's metadata (TIFF tags, EXIF) while it decodes.

    NOTE: their messages hold values the file chose (a pixel count, a tag id, a size), and Python's default filter
    keeps each distinct message in a registry for ever (and prints it once): a client could grow it by a few
    hundred bytes with every image it makes up. Ignored ones are not kept.
    """
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
    warnings.filterwarnings("ignore", module=r"PIL\.")


quiet_pillow_bomb_warnings()


@functools.cache
def _openable_formats() -> tuple[str, ...]:
    Image.init()  # registers every plugin; a format this Pillow lacks (AVIF) is skipped
    return tuple(f for f in IMAGE_FORMATS if f in Image.OPEN)


def decode_image(data: bytes, *, max_pixels: int) -> Image.Image:
    """Bytes -> RGB image; checks the pixel count from the header before decoding pixels.

    NOTE: the image may be the opened file's own (its first frame, oriented in place, no copy): read its
    pixels, never seek it (another frame of an animation would not be oriented, nor fit its size)."""
    formats = _openable_formats()
    check_structure(data)  # NOTE: before Pillow opens it: opening is linear in a container's segments too
    try:
        image: Image.Image = Image.open(io.BytesIO(data), formats=formats)
    except UnidentifiedImageError as err:
        raise MediaError(f"bytes are not a decodable image in a supported format {formats}") from err
    except Exception as err:  # DecompressionBombError, struct errors of a broken header, ...
        raise MediaError(f"bytes are not a decodable image ({type(err).__name__}: {err})") from err
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(f"image is {width}x{height} pixels, more than the {max_pixels}-pixel limit")
    try:
        image.load()  # decodes the first frame; raises on truncated or corrupt data
        ImageOps.exif_transpose(image, in_place=True)  # NOTE: in place: else an image with no tag is copied whole
    except Exception as err:
        raise MediaError(f"image data is corrupt or truncated ({err})") from err
    try:
        return to_rgb(image)
    except Exception as err:  # e.g. a mode Pillow cannot convert (a TIFF's premultiplied gray and alpha, "La")
        raise MediaError(f"image mode {image.mode} cannot be converted to RGB ({err})") from err


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited on white (as transformers' `convert_to_rgb` does).

    NOTE: an RGB image may be transparent too (a PNG's tRNS colour key): transparency is looked for first.
    """
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")
