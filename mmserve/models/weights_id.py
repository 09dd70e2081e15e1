"""Which weights a stage computes with: a fingerprint that every node holding the same checkpoint agrees on.

Owns: `weights_fingerprint`, a digest over the checkpoint's safetensors tensors a predicate selects (each one's
name, dtype, shape and bytes sampled at its start, middle and end), read through a memory map: a few pages per
tensor, not the weights; and `check_same_weights`, the refusal of embeddings computed with other vision weights.
Does not own which tensors a stage reads (the model family says) nor where the check is made (the Decoder's
replica, on each Encoder answer).

NOTE: why. While an `args` edit that changes `model` rolls out, replicas of both versions serve each other: a new
Decoder may be answered by an old Encoder, and would cache those embeddings under the image's key (and in its
prefix cache) and reuse them after the rollout. Sampled bytes tell two checkpoints apart wherever a tensor was
trained (its values all move), not a change confined to bytes between the samples; paths and file times are not
used, so that the fingerprint is the same on every node.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

from mmserve.errors import OverloadedError

SAMPLE_BYTES = 64  # bytes read at each of a tensor's three places


def weights_fingerprint(model_dir: Path, reads: Callable[[str], bool]) -> str:
    """A hex digest of the tensors named by `reads` in `model_dir`'s safetensors files; "" where the checkpoint
    has none (other formats are not fingerprinted: their answers are not checked)."""
    files = _safetensors_files(model_dir)
    if not files:
        return ""
    digest = hashlib.blake2b(digest_size=16)
    for path in files:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            (size,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8 : 8 + size])
            base = 8 + size
            for name in sorted(k for k in header if k != "__metadata__" and reads(k)):
                tensor = header[name]
                lo, hi = (base + offset for offset in tensor["data_offsets"])
                digest.update(json.dumps([name, tensor["dtype"], tensor["shape"]]).encode())
                for start in dict.fromkeys((lo, (lo + hi) // 2, max(lo, hi - SAMPLE_BYTES))):
                    digest.update(data[start : min(start + SAMPLE_BYTES, hi)])
    return digest.hexdigest()


def check_same_weights(theirs: str, ours: str) -> None:
    """Refuse embeddings an encoder computed with other vision weights than this decoder's checkpoint holds (a
    503, retried by clients: it lasts while a new `model` rolls out); "" on either side is unknown, not checked."""
    if theirs and ours and theirs != ours:
        raise OverloadedError("an encoder with other vision weights answered (a new model rolling out?); retry")


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    return [single] if single.exists() else []
