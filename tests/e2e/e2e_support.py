"""Helpers of the e2e tests (no fixtures): pictures, data URLs, plain HTTP on 127.0.0.1, server settings."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

MAX_IMAGES = 2  # media.max_images_per_prompt on the server
MAX_MODEL_LEN = 1024  # max_model_len on the server
E2E_MAX_BODY_BYTES = 4 << 20  # ingress.max_body_bytes on the server


def make_image(seed: int, size: tuple[int, int] = (160, 120)) -> Image.Image:
    """A smooth random RGB picture (8x8 noise upscaled), distinct per seed."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(12, 16, 3), dtype=np.uint8)
    return Image.fromarray(base).resize(size, Image.Resampling.BILINEAR)


def encode_image(image: Image.Image, fmt: str = "PNG", **save_kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save_kwargs)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def http_get(url: str, timeout: float = 10.0, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def http_post_json(url: str, body: dict, timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@dataclass
class Server:
    base_url: str  # http://127.0.0.1:PORT
    port: int
    model_dir: Path
    model_name: str
    log_path: Path

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return "(no log)"


@dataclass
class ImageHost:
    base_url: str  # http://127.0.0.1:PORT
    files: dict[str, tuple[bytes, str]] = field(default_factory=dict)  # path -> (body, content type)
    requests: list[str] = field(default_factory=list)  # paths asked for, in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, path: str, body: bytes, content_type: str = "image/png") -> str:
        with self.lock:
            self.files[path] = (body, content_type)
        return self.base_url + path

    def hits(self, path: str) -> int:
        with self.lock:
            return self.requests.count(path)
