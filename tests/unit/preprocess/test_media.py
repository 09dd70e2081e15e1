"""media.py and image_decode.py: data/file sources, decoding to RGB (http(s) fetches: test_fetch.py)."""

from __future__ import annotations

import base64
import io
import os
import time
from pathlib import Path

import pytest
from PIL import Image

from mmserve.config import MediaConfig
from mmserve.errors import MediaError, UnsupportedURLError
from mmserve.preprocess.image_decode import decode_image
from mmserve.preprocess.media import MediaLoader


def encode(image: Image.Image, fmt: str = "PNG", **save: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = encode(Image.new("RGB", (12, 8), (10, 200, 30)))


# --- data: URLs and decoding ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_data_url_formats_decode_to_rgb(fmt: str) -> None:
    image = MediaLoader(MediaConfig()).load(data_url(encode(Image.new("RGB", (12, 8), "red"), fmt)))
    assert image.mode == "RGB" and image.size == (12, 8)


def test_bad_base64_names_the_item() -> None:
    with pytest.raises(MediaError, match=r"^image 2: data URL is not valid base64"):
        MediaLoader(MediaConfig()).load("data:image/png;base64,@@@not*base64", index=2)


def test_base64_with_line_breaks_is_accepted() -> None:
    encoded = base64.encodebytes(PNG).decode()  # wrapped at 76 characters
    assert MediaLoader(MediaConfig()).load(f"data:image/png;base64,{encoded}").size == (12, 8)


@pytest.mark.parametrize("payload", [b"hello, I am text", PNG[: len(PNG) // 2]])
def test_non_image_and_truncated_bytes_are_media_errors(payload: bytes) -> None:
    with pytest.raises(MediaError, match="image 1: "):
        MediaLoader(MediaConfig()).load(data_url(payload))


@pytest.mark.parametrize("fmt", ["EPS", "PPM", "ICO"])
def test_formats_outside_the_allowlist_are_refused(fmt: str) -> None:
    with pytest.raises(MediaError, match="supported format"):
        MediaLoader(MediaConfig()).load(data_url(encode(Image.new("RGB", (4, 4)), fmt), "image/x"))


def test_non_image_media_type_is_refused() -> None:
    with pytest.raises(MediaError, match="not an image"):
        MediaLoader(MediaConfig()).load(data_url(PNG, "text/plain"))


def test_byte_cap_applies_to_data_urls() -> None:
    with pytest.raises(MediaError, match="byte limit"):
        MediaLoader(MediaConfig(max_image_bytes=len(PNG) - 1)).load(data_url(PNG))


def test_pixel_cap_is_checked_before_decoding() -> None:
    with pytest.raises(MediaError, match="12x8 pixels"):
        decode_image(PNG, max_pixels=95)
    assert decode_image(PNG, max_pixels=96).size == (12, 8)


@pytest.mark.parametrize("scheme_url", ["ftp://example.com/a.png", "gopher://x/y", "c:/images/a.png", "a.png"])
def test_unsupported_schemes(scheme_url: str) -> None:
    with pytest.raises(UnsupportedURLError, match="image 3: URL scheme"):
        MediaLoader(MediaConfig()).load(scheme_url, index=3)


@pytest.mark.parametrize("url, message", [
    ("http://[::1/a.png", "malformed URL"), ("http://example.com:99999/a.png", "malformed URL"),
    ("http:///a.png", "has no host"), ("file:///tmp/a%00b.png", "NUL byte"),
])
def test_malformed_urls(url: str, message: str) -> None:
    with pytest.raises(UnsupportedURLError, match=message):
        MediaLoader(MediaConfig(allowed_local_media_path="/tmp")).load(url)


def test_alpha_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (2, 1), (0, 0, 0, 0))
    rgba.putpixel((1, 0), (255, 0, 0, 255))
    image = decode_image(encode(rgba), max_pixels=100)
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 255, 255) and image.getpixel((1, 0)) == (255, 0, 0)


@pytest.mark.parametrize(("mode", "color", "rgb"), [
    ("L", 90, (90, 90, 90)),
    ("LA", (90, 0), (255, 255, 255)),  # fully transparent: on white, as an RGBA image
    ("LA", (90, 255), (90, 90, 90)),
    ("P", 0, (0, 0, 0)),  # PIL's default palette: entry 0 black
    ("CMYK", (0, 0, 0, 0), (255, 255, 255)),  # no ink: white (JPEG, lossy, checked loosely below)
    ("I;16", 0, (0, 0, 0)),
])
def test_other_modes_become_rgb(mode: str, color: object, rgb: tuple[int, int, int]) -> None:
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    image = decode_image(encode(Image.new(mode, (5, 4), color), fmt), max_pixels=100)  # type: ignore[arg-type]
    assert image.mode == "RGB" and image.size == (5, 4)
    pixel = image.getpixel((2, 1))
    assert isinstance(pixel, tuple) and all(abs(a - b) <= 2 for a, b in zip(pixel, rgb, strict=True)), pixel


def test_palette_transparency_is_composited() -> None:
    pal = Image.new("P", (2, 1), 0)
    pal.putpalette([0, 0, 0, 0, 0, 255])
    pal.putpixel((1, 0), 1)
    pal.info["transparency"] = 0
    image = decode_image(encode(pal), max_pixels=100)
    assert image.getpixel((0, 0)) == (255, 255, 255) and image.getpixel((1, 0)) == (0, 0, 255)


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(Image.new("RGB", (20, 10)), "JPEG", exif=exif.tobytes())
    assert decode_image(data, max_pixels=1000).size == (10, 20)


# --- file: URLs ---------------------------------------------------------------------------


def test_file_urls_only_under_the_allowed_folder(tmp_path: Path) -> None:
    root, outside = tmp_path / "media", tmp_path / "secret.png"
    root.mkdir()
    (root / "a.png").write_bytes(PNG)
    outside.write_bytes(PNG)
    (root / "link.png").symlink_to(outside)
    loader = MediaLoader(MediaConfig(allowed_local_media_path=str(root)))
    assert loader.load(f"file://{root}/a.png").size == (12, 8)
    for url in (f"file://{outside}", f"file://{root}/../secret.png", f"file://{root}/link.png"):
        with pytest.raises(UnsupportedURLError, match="outside the allowed media folder"):
            loader.load(url)
    with pytest.raises(MediaError, match="cannot read file"):
        loader.load(f"file://{root}/missing.png")
    with pytest.raises(UnsupportedURLError, match="disabled"):
        MediaLoader(MediaConfig()).load(f"file://{root}/a.png")


def test_a_fifo_a_device_or_a_symlink_loop_in_the_folder_is_a_4xx_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # NOTE: opening it to read would block until a writer came, for ever
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    loader = MediaLoader(MediaConfig(allowed_local_media_path=str(tmp_path)))
    for name in ("fifo", "loop1"):
        start = time.monotonic()
        with pytest.raises(MediaError, match="cannot read file"):
            loader.load(f"file://{tmp_path}/{name}")
        assert time.monotonic() - start < 1.0
    with pytest.raises(UnsupportedURLError):  # a device is outside the folder, as any other file there is
        loader.load("file:///dev/zero")


def test_a_folder_in_the_media_folder_is_a_4xx_and_leaves_no_descriptor_open(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    loader = MediaLoader(MediaConfig(allowed_local_media_path=str(tmp_path)))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        for url in (f"file://{tmp_path}/", f"file://{tmp_path}/sub"):
            with pytest.raises(MediaError, match="cannot read file"):
                loader.load(url)
    assert len(os.listdir("/proc/self/fd")) <= before  # NOTE: each leaked one before: a replica ran out


@pytest.mark.parametrize("folder", ["", " ", "images", "./images"])
def test_an_empty_or_relative_media_folder_is_refused_not_read_from_a_replicas_working_directory(folder: str) -> None:
    with pytest.raises(ValueError, match="allowed_local_media_path must be an absolute folder"):
        MediaConfig(allowed_local_media_path=folder)


@pytest.mark.parametrize("domain", ["*.example.com", "https://example.com", "example.com:443", "example.com/img", "",
                                    "exa mple.com"])
def test_an_allowed_domain_that_could_match_no_url_is_refused(domain: str) -> None:
    with pytest.raises(ValueError, match="allowed_domains holds"):
        MediaConfig(allowed_domains=(domain,))
    fine = ("example.com", ".cdn.example.com", "example.com.", "_img.example.com", "127.0.0.1", "::1", "localhost")
    assert MediaConfig(allowed_domains=fine).allowed_domains == fine
