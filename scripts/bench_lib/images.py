"""Photo-like test images, synthesized with numpy from a seed, and their data URLs.

Owns: turning (seed, size, format) into bytes that compress like a photograph (smooth colour fields,
edges, texture and sensor noise: a 1024x768 JPEG at quality 90 is a few hundred KB, a PNG ~1-2 MB),
not flat colours that compress to nothing. Memoized: the same key gives the same bytes, built once.
"""

from __future__ import annotations

import base64
import io
from functools import lru_cache

import numpy as np
from PIL import Image


def _smooth_noise(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    """Value noise: a coarse random grid bilinearly upsampled to (h, w), in [0, 1]."""
    gh, gw = max(2, cells * h // max(h, w)), max(2, cells * w // max(h, w))
    grid = rng.random((gh + 1, gw + 1), dtype=np.float32)
    ys, xs = np.linspace(0, gh, h, dtype=np.float32), np.linspace(0, gw, w, dtype=np.float32)
    y0, x0 = np.minimum(ys.astype(int), gh - 1), np.minimum(xs.astype(int), gw - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    fy, fx = fy * fy * (3 - 2 * fy), fx * fx * (3 - 2 * fx)  # smoothstep: no grid artefacts
    a, b = grid[y0][:, x0], grid[y0][:, x0 + 1]
    c, d = grid[y0 + 1][:, x0], grid[y0 + 1][:, x0 + 1]
    return (a * (1 - fx) + b * fx) * (1 - fy) + (c * (1 - fx) + d * fx) * fy


def photo_like(seed: int, width: int = 1024, height: int = 768) -> Image.Image:
    """A deterministic RGB image with photo statistics: fractal luminance, a few colour regions with
    hard edges (objects), fine texture, and per-pixel noise at full resolution."""
    rng = np.random.default_rng(seed)
    h, w = height // 2, width // 2  # NOTE: the smooth fields at half size (4x faster), noise at full size
    lum = sum(_smooth_noise(rng, h, w, cells) * amp for cells, amp in ((3, 0.5), (9, 0.25), (27, 0.15), (81, 0.1)))
    base = rng.random(3, dtype=np.float32)
    rgb = np.stack([0.55 * lum + 0.3 * _smooth_noise(rng, h, w, 4) + 0.15 * base[ch] for ch in range(3)], axis=-1)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for _ in range(int(rng.integers(3, 7))):  # "objects": ellipses of another colour and texture
        cy, cx = rng.random() * h, rng.random() * w
        ry, rx = (0.05 + rng.random() * 0.25) * h, (0.05 + rng.random() * 0.25) * w
        inside = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1.0
        shade = _smooth_noise(rng, h, w, 40)
        rgb[inside] = 0.6 * rng.random(3, dtype=np.float32) + 0.4 * shade[inside, None]
    small = Image.fromarray((np.clip(rgb, 0.0, 1.0) * 255).astype(np.uint8), "RGB")
    full = np.asarray(small.resize((width, height), Image.Resampling.BILINEAR), dtype=np.int16)
    full = full + rng.integers(-7, 8, full.shape, dtype=np.int16)  # sensor noise
    return Image.fromarray(np.clip(full, 0, 255).astype(np.uint8), "RGB")


@lru_cache(maxsize=1024)
def image_bytes(seed: int, width: int = 1024, height: int = 768, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    image = photo_like(seed, width, height)
    if fmt == "JPEG":
        image.save(buf, "JPEG", quality=90)
    else:
        image.save(buf, fmt)
    return buf.getvalue()


@lru_cache(maxsize=1024)
def data_url(seed: int, width: int = 1024, height: int = 768, fmt: str = "JPEG") -> str:
    mime = {"JPEG": "image/jpeg", "PNG": "image/png"}[fmt]
    return f"data:{mime};base64," + base64.b64encode(image_bytes(seed, width, height, fmt)).decode("ascii")
