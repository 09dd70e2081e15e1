"""Content hash of one multimodal item: the key of the ProcessorCache and the encoder cache; and the
source key of the request's bytes, by which a byte-identical repeat is found before it is decoded.

Owns: what goes into the key (decoded pixels, mode, size, palette, model id with a fingerprint of the
checkpoint's image-processor files and of the processing libraries' versions, and the output-changing processor
kwargs with their defaults resolved) and its
canonical byte form. Does not own: which
kwargs change the output or what their defaults are (the model's prompt rule says so), nor caching.

Hashing decoded pixels, not the request's bytes, makes a PNG and a lossless WebP of one picture
share a key, while any change to the pixels, the model or the processing gives a new one.

NOTE: both keys are BLAKE3-256 (vLLM's multimodal hasher's choice): a new image's pixels are hashed on its
request's path, megabytes of them, and BLAKE3 reads them several times faster than blake2b or SHA-256 on one
core (docs/benchmarks.md); the small digests elsewhere (fingerprints, prefix blocks) stay blake2b.

A request's `cache_salt` goes into both keys: every cache keyed by them (the ProcessorCache, the encoder
cache, the decoder's embedding cache, the prefix cache's item keys) then shares an item only between
requests with the same salt (or none), so no timing tells one salt whether another sent an image.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import PIL
from blake3 import blake3
from PIL import Image

DIGEST_BYTES = 32  # an item key's digest (bytes)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # what the image processor reads
# whose code makes the tiles from the pixels (transformers resizes with torchvision where it is installed, else Pillow)
PROCESSING_LIBRARIES = ("transformers", "numpy", "torch", "torchvision")


def processor_fingerprint(model_dir: str | Path) -> str:
    """A digest of the checkpoint's image-processor files (absent ones count as empty) and of the versions of
    the libraries that run them, for the keys' model id.

    NOTE: the served name alone does not pin the processing: a rolling upgrade to a checkpoint that resizes
    otherwise, or to an image with another transformers, Pillow or torchvision (whose resampling may change),
    under the same name, would be served the old tiles by the processor cache that its replicas share.
    """
    digest = hashlib.blake2b(digest_size=8)
    versions = {name: _version(name) for name in PROCESSING_LIBRARIES} | {"PIL": PIL.__version__}
    for library, version in sorted(versions.items()):
        digest.update(f"{library}=={version}".encode() + b"\x00")
    for name in PROCESSOR_FILES:
        path = Path(model_dir) / name
        digest.update(name.encode() + b"\x00" + (path.read_bytes() if path.is_file() else b"") + b"\x00")
    return digest.hexdigest()


def _version(distribution: str) -> str:
    """The installed version of `distribution`, "absent" where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def hash_image(image: Image.Image, *, model_id: str, kwargs: Mapping[str, Any],
               defaults: Mapping[str, Any] | None = None, salt: str | None = None) -> str:
    """Hex BLAKE3-256 of the image's pixels and everything that changes its processed form.

    `kwargs` are the request's output-changing processor kwargs; `defaults` (if given) fills the
    ones left out, so passing a default explicitly hashes the same as leaving it out. `salt`: the
    request's cache salt (None: unsalted keys, as without this argument).
    """
    resolved = {**(defaults or {}), **kwargs}
    header = _salted({
        "model_id": model_id,
        "mode": image.mode,
        "size": list(image.size),  # (width, height)
        "kwargs": {k: _canonical(v) for k, v in resolved.items()},
    }, salt)
    digest = blake3()
    digest.update(canonical_json(header).encode())
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    if palette is not None:  # NOTE: "P" pixels are palette indices; the palette is part of the picture
        digest.update(b"\x00palette\x00" + bytes(palette))
    digest.update(b"\x00pixels\x00")
    digest.update(image.tobytes())
    return digest.hexdigest(DIGEST_BYTES)


def hash_source(data: bytes, *, model_id: str, kwargs: Mapping[str, Any], salt: str | None = None) -> str:
    """Hex BLAKE3-256 of an item's encoded bytes (as the request sent them), the model id, the
    output-changing kwargs and the cache salt: equal bytes decode to equal pixels, so this key may stand for
    the content hash of what they decode to. Never equal to a `hash_image` key (another header)."""
    header = _salted({"source": "bytes", "model_id": model_id,
                      "kwargs": {k: _canonical(v) for k, v in kwargs.items()}}, salt)
    digest = blake3()
    digest.update(canonical_json(header).encode())
    digest.update(b"\x00bytes\x00")
    digest.update(data)
    return digest.hexdigest(DIGEST_BYTES)


def _salted(header: dict[str, Any], salt: str | None) -> dict[str, Any]:
    """NOTE: an unsalted header stays as it was, so unsalted keys do not change with this field."""
    return header if salt is None else {**header, "cache_salt": salt}


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, no NaN: one string per value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _canonical(value: Any) -> Any:
    """Integral floats as ints (2.0 and 2 process alike); numpy scalars as Python numbers."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        value = value.item()
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    return value
