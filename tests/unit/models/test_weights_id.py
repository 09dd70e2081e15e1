"""The vision weights' fingerprint: the same for the same weights wherever they lie, another for trained ones, and
the Decoder's refusal of embeddings made with other weights."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve.config import EngineConfig
from mmserve.errors import OverloadedError
from mmserve.models.gemma3 import TEXT_WEIGHTS
from mmserve.models.registry import load_family
from mmserve.models.weights_id import check_same_weights, weights_fingerprint


def vision(name: str) -> bool:
    return TEXT_WEIGHTS.search(name) is None


def copy_with(ckpt: Path, folder: Path, change: str | None = None) -> Path:
    """A copy of the checkpoint in `folder`; the tensor named `change` (if any) trained, i.e. every value moved."""
    shutil.copytree(ckpt, folder)
    if change is not None:
        tensors = load_file(folder / "model.safetensors")
        tensors[change] = tensors[change] * 1.01 + 1e-3
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_the_same_weights_in_another_folder_have_the_same_id(tiny_ckpt: Path, tmp_path: Path) -> None:
    elsewhere = copy_with(tiny_ckpt, tmp_path / "elsewhere")
    os.utime(elsewhere / "model.safetensors", (1e9, 1e9))  # another node's copy: other times, another path
    ids = {load_family(str(folder), EngineConfig()).vision_weights_id() for folder in (tiny_ckpt, elsewhere)}
    assert len(ids) == 1 and next(iter(ids)) != ""


def test_trained_vision_weights_change_it_and_text_weights_do_not(tiny_ckpt: Path, tmp_path: Path) -> None:
    names = list(load_file(tiny_ckpt / "model.safetensors"))
    projector = next(n for n in names if "multi_modal_projector" in n)
    tower = next(n for n in names if "vision_tower" in n and n.endswith("weight"))
    text = next(n for n in names if not vision(n))
    base = weights_fingerprint(tiny_ckpt, vision)
    assert weights_fingerprint(copy_with(tiny_ckpt, tmp_path / "p", projector), vision) != base
    assert weights_fingerprint(copy_with(tiny_ckpt, tmp_path / "t", tower), vision) != base
    assert weights_fingerprint(copy_with(tiny_ckpt, tmp_path / "x", text), vision) == base


def save_sharded(tensors: dict[str, torch.Tensor], folder: Path) -> Path:
    """`tensors` saved as transformers saves a big checkpoint: two shards and their index."""
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[1::2], "model-00002-of-00002.safetensors": names[::2]}
    folder.mkdir()
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, folder / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in shards.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_the_same_weights_saved_another_way_have_the_same_id(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Sharded, or under google's key names instead of transformers' (the same tensors), they are the same."""
    tensors = load_file(tiny_ckpt / "model.safetensors")
    base = weights_fingerprint(tiny_ckpt, vision)
    assert weights_fingerprint(save_sharded(tensors, tmp_path / "sharded"), vision) == base
    renamed = {(n.removeprefix("model.") if n.startswith("model.") else "model." + n): t for n, t in tensors.items()}
    assert renamed.keys() != tensors.keys()
    assert weights_fingerprint(save_sharded(renamed, tmp_path / "renamed"), vision) == base


def test_the_single_file_is_read_first_as_transformers_reads_it(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A folder re-saved as one file over a sharded download keeps the old index, naming shards gone."""
    sharded = save_sharded(load_file(tiny_ckpt / "model.safetensors"), tmp_path / "sharded")
    (sharded / "model-00002-of-00002.safetensors").unlink()
    shutil.copy(tiny_ckpt / "model.safetensors", sharded / "model.safetensors")
    assert weights_fingerprint(sharded, vision) == weights_fingerprint(tiny_ckpt, vision) != ""


def test_weights_it_cannot_read_are_unknown_not_a_failed_start(tiny_ckpt: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    sharded = save_sharded(load_file(tiny_ckpt / "model.safetensors"), tmp_path / "sharded")
    (sharded / "model-00002-of-00002.safetensors").unlink()  # an index naming a shard that is gone
    assert weights_fingerprint(sharded, vision) == ""
    (sharded / "model.safetensors").write_bytes(b"short")  # not a safetensors file
    assert weights_fingerprint(sharded, vision) == ""
    bare = tmp_path / "bare"
    bare.mkdir()
    torch.save({}, bare / "pytorch_model.bin")  # no safetensors at all
    assert weights_fingerprint(bare, vision) == ""
    assert sum("not fingerprinted" in r.getMessage() for r in caplog.records) == 3  # each said, none silent


def test_embeddings_made_with_other_weights_are_refused_and_unknown_ones_taken(
        caplog: pytest.LogCaptureFixture) -> None:
    check_same_weights("w1:a1", "w1:a1")
    check_same_weights("", "w1:a1")  # an encoder that does not say (an older version): not checked
    check_same_weights("w1:a1", "")
    check_same_weights("w0:b2", "w1:a1")  # a fingerprint of another form: not compared
    theirs = f"w1:{uuid.uuid4().hex}"  # NOTE: a pair of its own: pairs are logged once per process
    for _ in range(3):
        with pytest.raises(OverloadedError, match="other vision weights") as refused:
            check_same_weights(theirs, "w1:a1")
        assert refused.value.status == 503
    assert sum(theirs in r.getMessage() for r in caplog.records) == 1  # said once per pair
