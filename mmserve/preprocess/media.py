"""Image sources -> decoded RGB PIL images, with the guards a public endpoint needs.

Owns: reading `data:` URLs and `file://` URLs under one allowed folder, sending `http(s)://` URLs to
the guarded fetcher (`mmserve.preprocess.fetch`), reading a prompt's images in parallel, and handing
the bytes to `image_decode` when asked (a repeat found by its bytes is never decoded). Does not own:
the fetch rules, decoding, hashing, caching or the model's image processor.

Every error names the item ("image 2: ...") and is a `MediaError` (bytes we cannot use) or an
`UnsupportedURLError` (a source we refuse to read).
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
import socket
import stat
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TypeVar

from PIL import Image

from mmserve.config import MediaConfig
from mmserve.errors import InvalidRequestError, MediaError, UnsupportedURLError
from mmserve.preprocess.fetch import Dialer, HttpFetcher, Resolver, default_resolver, split_url
from mmserve.preprocess.fetch_lifetime import FetchGroup
from mmserve.preprocess.image_decode import decode_image

T = TypeVar("T")
MAX_PARALLEL_READS = 8  # reads of one prompt's images at once (the item count is capped by the config)
POLL_S = 0.1  # how often a prompt's reader asks whether its caller left while a fetch is awaited (s)


class MediaLoader:
    """Loads images for one engine; `resolver` and `dial` are injectable for tests."""

    def __init__(self, config: MediaConfig, *, resolver: Resolver = default_resolver,
                 dial: Dialer = socket.create_connection) -> None:
        self.config = config
        self.http = HttpFetcher(config, resolver=resolver, dial=dial)

    def load(self, url: str, *, index: int = 1) -> Image.Image:
        """Decoded RGB image of item `index` (1-based, used in error messages)."""
        return self.decode(self._read(url, index), index)

    def read_all(self, urls: list[str], cancelled: Callable[[], bool] = lambda: False) -> Iterator[bytes]:
        """A prompt's images' bytes in order, read in parallel: a prompt waits for its slowest image, not
        for the sum. NOTE: after a refusal, once the reader leaves, or once `cancelled()` (asked every
        POLL_S while a fetch is awaited), the other reads are not waited for, and their fetches are ended at
        once: a cheap 400, or a caller gone, must leave no reads running to their deadline."""
        if not any(fetched(url) for url in urls):  # NOTE: data: and file: reads end by themselves, at once
            yield from (self._read(url, i) for i, url in enumerate(urls, start=1))
            return
        pool = ThreadPoolExecutor(max_workers=min(len(urls), MAX_PARALLEL_READS), thread_name_prefix="media")
        group = FetchGroup()

        def read(url: str, index: int) -> bytes:
            with group.joined():
                return self._read(url, index)

        try:
            reads = [pool.submit(read, url, i) for i, url in enumerate(urls, start=1)]
            for index, one in enumerate(reads, start=1):
                while not wait([one], timeout=POLL_S).done:
                    if cancelled():
                        raise CancelledError(f"the caller left while image {index} was being read")
                yield one.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            group.abandon()  # NOTE: after a full read this ends nothing: every fetch is done

    def decode(self, data: bytes, index: int = 1) -> Image.Image:
        """The bytes of item `index` as an RGB image (the caller decodes each when it needs the pixels)."""
        return _named(index, lambda: decode_image(data, max_pixels=self.config.max_image_pixels))

    def _read(self, url: str, index: int) -> bytes:
        return _named(index, lambda: self.read_bytes(url))

    def read_bytes(self, url: str) -> bytes:
        if not isinstance(url, str) or not url:
            raise MediaError("image URL must be a non-empty string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return _read_data_url(url, self.config.max_image_bytes)
        if scheme in ("http", "https"):
            return self.http.fetch(url)
        if scheme == "file":
            return _read_file_url(url, self.config)
        raise UnsupportedURLError(f"URL scheme {scheme or '(none)'!r} is not supported; "
                                  "use data:, http(s): or an allowed file:")


def fetched(url: object) -> bool:
    """Whether `url` is read from the network (its read may last up to the fetch deadline)."""
    return isinstance(url, str) and url.split(":", 1)[0].lower() in ("http", "https")


def _named(index: int, work: Callable[[], T]) -> T:
    """`work()`, its refusal naming the item ("image 2: ...")."""
    try:
        return work()
    except InvalidRequestError as err:
        raise type(err)(f"image {index}: {err}") from err


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


def _read_regular_file(path: Path, most: int) -> bytes:
    """Up to `most` bytes of a regular file. NOTE: opened without blocking, then refused unless regular: a FIFO or
    a device in the media folder would block the reading thread for ever (a file read has no deadline)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:  # NOTE: checked on the bare descriptor: `fdopen` of a directory raises, and leaves it open
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read(most)


def _read_file_url(url: str, config: MediaConfig) -> bytes:
    if config.allowed_local_media_path is None:
        raise UnsupportedURLError("file:// URLs are disabled (no allowed_local_media_path)")
    parts = split_url(url)
    if parts.netloc not in ("", "localhost"):
        raise UnsupportedURLError(f"file URL host {parts.netloc!r} is not allowed")
    root = Path(config.allowed_local_media_path).resolve()
    raw = urllib.parse.unquote(parts.path)
    if "\0" in raw:
        raise UnsupportedURLError("file URL path contains a NUL byte")
    try:
        path = Path(raw).resolve()  # follows symlinks before the check
    except RuntimeError as err:  # NOTE: a symlink loop (Python 3.11 raises RuntimeError for it)
        raise MediaError(f"cannot read file {parts.path!r}: {err}") from None
    if not path.is_relative_to(root):
        raise UnsupportedURLError(f"file {parts.path!r} is outside the allowed media folder")
    try:
        data = _read_regular_file(path, config.max_image_bytes + 1)
    except OSError as err:
        raise MediaError(f"cannot read file {parts.path!r}: {err.strerror}") from err
    if len(data) > config.max_image_bytes:
        raise MediaError(f"file is more than the {config.max_image_bytes}-byte limit")
    return data
