"""Which weights a stage computes with: a fingerprint that every node holding the same checkpoint agrees on.

Owns: which safetensors files hold a checkpoint's weights (`safetensors_files`, as transformers picks them);
`weights_fingerprint`, a digest over the checkpoint's safetensors tensors a predicate selects (each one's
dtype, shape and bytes sampled at its start, middle and end), read through a memory map: a few pages per tensor,
not the weights; and `check_same_weights`, the refusal of embeddings computed with other vision weights. Does not
own which tensors a stage reads (the model family says) nor where the check is made (the Decoder's replica, on each
Encoder answer).

NOTE: why. While an `args` edit that changes `model` rolls out, replicas of both versions serve each other: a new
Decoder may be answered by an old Encoder, and would cache those embeddings under the image's key (and in its
prefix cache) and reuse them after the rollout. Sampled bytes tell two checkpoints apart wherever a tensor was
trained (its values all move), not a change confined to bytes between the samples. NOTE: the tensors' digests are
combined in sorted order, without their names or files, so the same weights give the same fingerprint on every
node however they were saved (sharded or not, google's key names or transformers'); paths and file times are not
read. A checkpoint this cannot read (no safetensors, a shard missing) is "": unknown, not checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import struct
from collections.abc import Callable
from pathlib import Path

from mmserve.errors import OverloadedError

log = logging.getLogger(__name__)
SAMPLE_BYTES = 64  # bytes read at each of a tensor's three places
# NOTE: the fingerprint's form, its prefix: replicas of versions that compute it otherwise do not compare theirs
FORM = "w1"


def weights_fingerprint(model_dir: Path, reads: Callable[[str], bool]) -> str:
    """A hex digest of the tensors named by `reads` in `model_dir`'s safetensors files; "" where they cannot be
    read (other formats; a file the index names is missing)."""
    try:
        tensors = sorted(d for path in safetensors_files(model_dir) for d in _tensor_digests(path, reads))
    except (OSError, ValueError, KeyError, struct.error) as exc:  # NOTE: transformers, loading them, says what is wrong
        return _unknown(model_dir, repr(exc))
    if not tensors:
        return _unknown(model_dir, "no safetensors tensor of the stage's")
    return f"{FORM}:{hashlib.blake2b(b''.join(tensors), digest_size=16).hexdigest()}"


def _unknown(model_dir: Path, why: str) -> str:
    log.warning("the vision weights of %s are not fingerprinted (%s): Encoder answers are not checked", model_dir, why)
    return ""


def _tensor_digests(path: Path, reads: Callable[[str], bool]) -> list[bytes]:
    """One digest per tensor `reads` selects in a safetensors file: its dtype, shape and sampled bytes."""
    digests = []
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        base = 8 + size
        for name, tensor in header.items():
            if name == "__metadata__" or not reads(name):
                continue
            lo, hi = (base + offset for offset in tensor["data_offsets"])
            digest = hashlib.blake2b(json.dumps([tensor["dtype"], tensor["shape"]]).encode(), digest_size=16)
            for start in dict.fromkeys((lo, (lo + hi) // 2, max(lo, hi - SAMPLE_BYTES))):
                digest.update(data[start : min(start + SAMPLE_BYTES, hi)])
            digests.append(digest.digest())
    return digests


def check_same_weights(theirs: str, ours: str) -> None:
    """Refuse embeddings an encoder computed with other vision weights than this decoder's checkpoint holds (a
    503, retried by clients: it lasts while a new `model` rolls out); "" on either side is unknown, and fingerprints
    of another form (a version that computes them otherwise) are not compared."""
    if theirs and ours and theirs != ours and theirs.split(":")[0] == ours.split(":")[0]:
        if (theirs, ours) not in _WARNED:  # NOTE: once per pair: a rollout meets it on many requests
            _WARNED.add((theirs, ours))
            log.warning("an Encoder answered with vision weights %s, this Decoder holds %s: refused (a new model "
                        "rolling out; if it lasts, the nodes hold different checkpoints)", theirs, ours)
        raise OverloadedError("an encoder with other vision weights answered (a new model rolling out?); retry")


_WARNED: set[tuple[str, str]] = set()  # (theirs, ours) pairs logged


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files as transformers picks them: one `model.safetensors` first, else the shards its index names
    (which may be missing); [] for neither."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return []
