"""Image sources -> decoded RGB PIL images, with the guards a public endpoint needs.

Owns: reading `data:` URLs, `http(s)://` URLs (timeouts, byte cap, domain allowlist, refusal of
private addresses on every redirect hop, max 5 redirects) and `file://` URLs under one allowed
folder, and handing the bytes to `image_decode`. Does not own: decoding (`mmserve.preprocess.image_decode`),
hashing, caching or the model's image processor.

Every error names the item ("image 2: ...") and is a `MediaError` (bytes we cannot use) or an
`UnsupportedURLError` (a source we refuse to read).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from PIL import Image

from mmserve.config import MediaConfig
from mmserve.errors import InvalidRequestError, MediaError, UnsupportedURLError
from mmserve.preprocess.image_decode import decode_image

Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP address strings
Dialer = Callable[..., socket.socket]  # socket.create_connection's signature

MAX_REDIRECTS = 5
MAX_PARALLEL_READS = 8  # reads of one prompt's images at once (the item count is capped by the config)
# NOTE: an allowlist; PIL's other openers (EPS calls Ghostscript, ...) are not for untrusted input.
_CHUNK = 64 * 1024  # bytes per read


def default_resolver(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (IPv4 and IPv6)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def is_public_address(ip: str) -> bool:
    """False for loopback, private, link-local, multicast, reserved, unspecified (and non-global)."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])  # drop an IPv6 scope id
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    blocked = (addr.is_loopback or addr.is_private or addr.is_link_local or addr.is_multicast
               or addr.is_reserved or addr.is_unspecified or not addr.is_global)
    return not blocked


class MediaLoader:
    """Loads images for one engine; `resolver` and `dial` are injectable for tests."""

    def __init__(self, config: MediaConfig, *, resolver: Resolver = default_resolver,
                 dial: Dialer = socket.create_connection) -> None:
        self.config = config
        self._resolver = resolver
        self._dial = dial

    def load(self, url: str, *, index: int = 1) -> Image.Image:
        """Decoded RGB image of item `index` (1-based, used in error messages)."""
        return self._decode(lambda: self.read_bytes(url), index)

    def load_all(self, urls: list[str]) -> Iterator[Image.Image]:
        """A prompt's images decoded in order, their bytes read in parallel: a prompt waits for its
        slowest image, not for the sum. NOTE: only the reading is parallel; each image is decoded when
        the caller takes it, so at most one decoded image is held beside the caller's."""
        if len(urls) <= 1:
            yield from (self.load(url, index=i) for i, url in enumerate(urls, start=1))
            return
        pool = ThreadPoolExecutor(max_workers=min(len(urls), MAX_PARALLEL_READS), thread_name_prefix="media")
        try:
            reads = [pool.submit(self.read_bytes, url) for url in urls]
            for index, read in enumerate(reads, start=1):
                yield self._decode(read.result, index)
        finally:  # NOTE: after a refusal the other reads are not waited for (each has its own deadline)
            pool.shutdown(wait=False, cancel_futures=True)

    def _decode(self, read: Callable[[], bytes], index: int) -> Image.Image:
        try:
            return decode_image(read(), max_pixels=self.config.max_image_pixels)
        except InvalidRequestError as err:
            raise type(err)(f"image {index}: {err}") from err

    def read_bytes(self, url: str) -> bytes:
        if not isinstance(url, str) or not url:
            raise MediaError("image URL must be a non-empty string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return _read_data_url(url, self.config.max_image_bytes)
        if scheme in ("http", "https"):
            return self._fetch(url)
        if scheme == "file":
            return _read_file_url(url, self.config)
        raise UnsupportedURLError(f"URL scheme {scheme or '(none)'!r} is not supported; "
                                  "use data:, http(s): or an allowed file:")

    # --- http(s) ---------------------------------------------------------------------------

    def check_url(self, url: str) -> None:
        """Scheme and domain allowlist; the address check happens when connecting."""
        parts = _split(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise UnsupportedURLError(f"redirect to scheme {parts.scheme!r} is not allowed")
        host = (parts.hostname or "").rstrip(".").lower()
        if not host:
            raise UnsupportedURLError(f"URL {url!r} has no host")
        allowed = self.config.allowed_domains
        if allowed is not None and not any(_host_matches(host, d) for d in allowed):
            raise UnsupportedURLError(f"host {host!r} is not in the allowed domains")

    def connect(self, address: tuple[str, int], timeout: float | None = None,
                source_address: tuple[str, int] | None = None) -> socket.socket:
        """Resolve, refuse non-public addresses, then dial the checked address itself.

        NOTE: dialing the checked IP (not the host name again) closes the DNS-rebinding gap
        between the check and the connection; TLS still verifies the certificate against the host.
        """
        host, port = address
        try:
            ips = self._resolver(host, port)
        except OSError as err:
            raise MediaError(f"cannot resolve host {host!r}: {err}") from err
        if not ips:
            raise MediaError(f"host {host!r} has no address")
        if not self.config.allow_private_addresses:
            for ip in ips:
                if not is_public_address(ip):
                    raise UnsupportedURLError(f"host {host!r} resolves to non-public address {ip}")
        last: OSError | None = None
        for ip in ips:
            try:
                return self._dial((ip, port), timeout, source_address)
            except OSError as err:
                last = err
        raise last or OSError(f"cannot connect to {host!r}")

    def _fetch(self, url: str) -> bytes:
        self.check_url(url)
        cap, timeout = self.config.max_image_bytes, self.config.fetch_timeout_s
        request = urllib.request.Request(url, headers={"User-Agent": "mmserve", "Accept": "image/*"})
        deadline = time.monotonic() + timeout
        try:
            with _build_opener(self).open(request, timeout=timeout) as response:
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > cap:
                    raise MediaError(f"image is {int(length)} bytes, more than the {cap}-byte limit")
                return _read_capped(response, cap, deadline)
        except urllib.error.HTTPError as err:
            if 300 <= err.code < 400:
                raise MediaError(f"fetching {url} failed: more than {MAX_REDIRECTS} redirects") from err
            raise MediaError(f"fetching {url} failed: HTTP {err.code}") from err
        except urllib.error.URLError as err:
            raise MediaError(f"fetching {url} failed: {err.reason}") from err
        except (OSError, http.client.HTTPException) as err:  # timeouts, resets, bad responses
            raise MediaError(f"fetching {url} failed: {err!r}") from err


def _split(url: str) -> urllib.parse.SplitResult:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as err:
        raise UnsupportedURLError(f"malformed URL: {err}") from err
    return parts


def _host_matches(host: str, domain: str) -> bool:
    domain = domain.strip(".").lower()
    return host == domain or host.endswith("." + domain)


def _read_capped(stream: io.BufferedIOBase | http.client.HTTPResponse, cap: int, deadline: float) -> bytes:
    """Read until EOF; stop past `cap` bytes or past the overall deadline (slow drips)."""
    chunks: list[bytes] = []
    total = 0
    while chunk := stream.read(_CHUNK):
        total += len(chunk)
        if total > cap:
            raise MediaError(f"image is more than the {cap}-byte limit")
        if time.monotonic() > deadline:
            raise MediaError("fetch timed out")
        chunks.append(chunk)
    return b"".join(chunks)


class _GuardedRedirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def __init__(self, loader: MediaLoader) -> None:
        self._loader = loader

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self._loader.check_url(newurl)  # newurl is absolute here
        return super().redirect_request(req, fp, code, msg, headers, newurl)

    def http_error_302(self, req, fp, code, msg, headers):
        # NOTE: check before urllib's own scheme test, so file:/ftp: targets raise UnsupportedURLError.
        target = headers.get("location") or headers.get("uri")
        if target:
            self._loader.check_url(urllib.parse.urljoin(req.full_url, target))
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _guarded(base: type[http.client.HTTPConnection], loader: MediaLoader) -> Any:
    """A connection factory whose sockets come from `loader.connect` (resolve, check, dial)."""
    def make(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
        conn = base(*args, **kwargs)
        conn._create_connection = loader.connect  # type: ignore[attr-defined]
        return conn
    return make


class _GuardedHTTP(urllib.request.HTTPHandler):
    def __init__(self, loader: MediaLoader) -> None:
        super().__init__()
        self._make = _guarded(http.client.HTTPConnection, loader)

    def http_open(self, req):
        return self.do_open(self._make, req)


class _GuardedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, loader: MediaLoader) -> None:
        super().__init__()
        self._make = _guarded(http.client.HTTPSConnection, loader)

    def https_open(self, req):
        return self.do_open(self._make, req)


def _build_opener(loader: MediaLoader) -> urllib.request.OpenerDirector:
    """Only the handlers we need. NOTE: no ProxyHandler, so environment proxies are ignored."""
    opener = urllib.request.OpenerDirector()
    for handler in (_GuardedHTTP(loader), _GuardedHTTPS(loader), _GuardedRedirects(loader),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor(),
                    urllib.request.UnknownHandler()):
        opener.add_handler(handler)
    return opener


# --- data: and file: ----------------------------------------------------------------------


def _read_data_url(url: str, cap: int) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise MediaError("data URL has no ',' before its payload")
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0]
    if media_type and not media_type.startswith("image/"):
        raise MediaError(f"data URL media type {media_type!r} is not an image")
    if "base64" not in params[1:]:
        data = urllib.parse.unquote_to_bytes(payload)
    else:
        payload = "".join(payload.split())  # clients wrap long base64 lines
        if len(payload) // 4 * 3 > cap + 2:
            raise MediaError(f"data URL is more than the {cap}-byte limit")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise MediaError("data URL is not valid base64") from err
    if len(data) > cap:
        raise MediaError(f"data URL is more than the {cap}-byte limit")
    return data


def _read_file_url(url: str, config: MediaConfig) -> bytes:
    if config.allowed_local_media_path is None:
        raise UnsupportedURLError("file:// URLs are disabled (no allowed_local_media_path)")
    parts = _split(url)
    if parts.netloc not in ("", "localhost"):
        raise UnsupportedURLError(f"file URL host {parts.netloc!r} is not allowed")
    root = Path(config.allowed_local_media_path).resolve()
    raw = urllib.parse.unquote(parts.path)
    if "\0" in raw:
        raise UnsupportedURLError("file URL path contains a NUL byte")
    path = Path(raw).resolve()  # follows symlinks before the check
    if not path.is_relative_to(root):
        raise UnsupportedURLError(f"file {parts.path!r} is outside the allowed media folder")
    try:
        with path.open("rb") as f:
            data = f.read(config.max_image_bytes + 1)
    except OSError as err:
        raise MediaError(f"cannot read file {parts.path!r}: {err.strerror}") from err
    if len(data) > config.max_image_bytes:
        raise MediaError(f"file is more than the {config.max_image_bytes}-byte limit")
    return data
