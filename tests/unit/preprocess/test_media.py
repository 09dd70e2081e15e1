"""media.py: data/file/http(s) sources, the fetch guards (also on redirects), decoding to RGB."""

from __future__ import annotations

import base64
import io
import threading
import time
import typing
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from mmserve.config import MediaConfig
from mmserve.errors import MediaError, UnsupportedURLError
from mmserve.preprocess.image_decode import decode_image
from mmserve.preprocess.media import MediaLoader, is_public_address


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


@pytest.mark.parametrize("mode", ["L", "LA", "P", "CMYK", "I;16"])
def test_other_modes_become_rgb(mode: str) -> None:
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    image = decode_image(encode(Image.new(mode, (5, 4)), fmt), max_pixels=100)
    assert image.mode == "RGB" and image.size == (5, 4)


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


# --- http(s) --------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # no keep-alive; a body without Content-Length ends at close

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path, port = self.path, typing.cast(tuple[str, int], self.server.server_address)[1]
        if path == "/img.png":
            self._send(200, PNG)
        elif path.startswith("/redirect/"):
            hops = int(path.rsplit("/", 1)[1])
            self._redirect("/img.png" if hops == 0 else f"/redirect/{hops - 1}")
        elif path == "/to-internal":
            self._redirect(f"http://internal.test:{port}/img.png")
        elif path == "/to-loopback":
            self._redirect(f"http://127.0.0.1:{port}/img.png")
        elif path == "/to-file":
            self._redirect("file:///etc/passwd")
        elif path == "/big":
            self._send(200, b"\0" * 50_000)
        elif path == "/big-no-length":
            self._send(200, b"\0" * 50_000, length=False)
        elif path == "/slow":
            time.sleep(1.0)
            self._send(200, PNG)
        else:
            self._send(404, b"no")

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.end_headers()

    def _send(self, code: int, body: bytes, length: bool = True) -> None:
        self.send_response(code)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def local(**kw: object) -> MediaLoader:
    return MediaLoader(MediaConfig(allow_private_addresses=True, **kw))  # type: ignore[arg-type]


def test_fetch_from_local_server(port: int) -> None:
    assert local().load(f"http://127.0.0.1:{port}/img.png").size == (12, 8)


def test_loopback_is_refused_without_the_test_flag(port: int) -> None:
    for host in ("127.0.0.1", "localhost"):
        with pytest.raises(UnsupportedURLError, match="non-public address"):
            MediaLoader(MediaConfig()).load(f"http://{host}:{port}/img.png")


def test_domain_allowlist(port: int) -> None:
    with pytest.raises(UnsupportedURLError, match="not in the allowed domains"):
        local(allowed_domains=("example.com",)).load(f"http://127.0.0.1:{port}/img.png")
    with pytest.raises(UnsupportedURLError, match="not in the allowed domains"):
        local(allowed_domains=("example.com",)).load("http://evilexample.com/img.png")


def _fake_public(allowed: tuple[str, ...] | None = None) -> MediaLoader:
    """public.test 'resolves' to 8.8.8.8 (dialled to our server); internal.test to loopback."""
    table = {"public.test": ["8.8.8.8"], "internal.test": ["127.0.0.1"]}

    def resolve(host: str, port: int) -> list[str]:
        return table.get(host, [host])  # IP literals resolve to themselves

    def dial(address: tuple[str, int], *args: object) -> object:
        assert address[0] == "8.8.8.8", f"dialled a refused address {address}"
        import socket
        return socket.create_connection(("127.0.0.1", address[1]), *args)  # type: ignore[arg-type]

    return MediaLoader(MediaConfig(allowed_domains=allowed), resolver=resolve, dial=dial)  # type: ignore[arg-type]


def test_public_to_private_redirect_is_refused(port: int) -> None:
    loader = _fake_public()
    assert loader.load(f"http://public.test:{port}/img.png").size == (12, 8)  # control
    with pytest.raises(UnsupportedURLError, match=r"internal\.test.*non-public address 127\.0\.0\.1"):
        loader.load(f"http://public.test:{port}/to-internal")
    with pytest.raises(UnsupportedURLError, match=r"non-public address 127\.0\.0\.1"):
        loader.load(f"http://public.test:{port}/to-loopback")
    with pytest.raises(UnsupportedURLError, match="not in the allowed domains"):
        _fake_public(("public.test",)).load(f"http://public.test:{port}/to-loopback")


def test_redirect_limit_and_scheme(port: int) -> None:
    assert local().load(f"http://127.0.0.1:{port}/redirect/4").size == (12, 8)  # 5 redirects
    with pytest.raises(MediaError, match="redirects"):
        local().load(f"http://127.0.0.1:{port}/redirect/5")  # 6 redirects
    with pytest.raises(UnsupportedURLError, match="scheme 'file'"):
        local().load(f"http://127.0.0.1:{port}/to-file")


@pytest.mark.parametrize("path", ["/big", "/big-no-length"])
def test_byte_cap_on_fetch(port: int, path: str) -> None:
    with pytest.raises(MediaError, match="byte limit"):
        local(max_image_bytes=10_000).load(f"http://127.0.0.1:{port}{path}")


def test_http_errors_and_timeouts(port: int) -> None:
    with pytest.raises(MediaError, match="HTTP 404"):
        local().load(f"http://127.0.0.1:{port}/nothing")
    start = time.monotonic()
    with pytest.raises(MediaError, match="image 1: fetching"):
        local(fetch_timeout_s=0.2).load(f"http://127.0.0.1:{port}/slow")
    assert time.monotonic() - start < 0.9


def test_a_prompts_images_are_read_in_parallel_and_decoded_in_order(port: int) -> None:
    slow, fast = f"http://127.0.0.1:{port}/slow", f"http://127.0.0.1:{port}/img.png"  # /slow: 1 s
    start = time.monotonic()
    images = list(local().load_all([slow, fast, slow, slow]))
    assert [im.size for im in images] == [(12, 8)] * 4
    assert time.monotonic() - start < 2.0  # three 1 s reads at once, not one after another (3 s)
    with pytest.raises(MediaError, match=r"image 2: .*HTTP 404"):  # the first refusal in prompt order
        list(local().load_all([fast, f"http://127.0.0.1:{port}/nothing", f"http://127.0.0.1:{port}/nope"]))


@pytest.mark.parametrize("ip", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                "0.0.0.0", "224.0.0.1", "100.64.0.1", "240.0.0.1", "::1", "fe80::1%eth0",
                                "fc00::1", "::ffff:127.0.0.1", "::"])
def test_non_public_addresses(ip: str) -> None:
    assert not is_public_address(ip)


@pytest.mark.parametrize("ip", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses(ip: str) -> None:
    assert is_public_address(ip)
