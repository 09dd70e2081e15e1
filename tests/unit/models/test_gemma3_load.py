"""Loading Gemma 3's text model: transformers' layers go to the device one at a time and are dropped as the
paged model takes each, so a load never holds a second copy of the text weights; a checkpoint whose text
config asks for arithmetic the paged model does not do is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.models.gemma3 import Gemma3Family, gemma3_spec, one_at_a_time


def test_each_layer_is_moved_when_asked_for_and_dropped_when_the_next_is() -> None:
    layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
    dropped = []
    for layer in one_at_a_time(layers, torch.device("meta")):
        assert layer.weight.device.type == "meta"
        dropped.append([isinstance(m, torch.nn.Identity) for m in layers])
    assert dropped == [[False, False, False], [True, False, False], [True, True, False]]
    assert all(isinstance(m, torch.nn.Identity) for m in layers)  # the last one too, once the loop ends


def test_a_loaded_text_model_keeps_none_of_transformers_layers(tiny_ckpt_224: Path) -> None:
    family = Gemma3Family(tiny_ckpt_224, EngineConfig(model=str(tiny_ckpt_224)))
    text = family.load_text()
    language_model = family._load().model.language_model
    assert len(text.layers) == len(language_model.layers) > 0
    assert all(isinstance(m, torch.nn.Identity) for m in language_model.layers)


@pytest.mark.parametrize("key, value", [("hidden_activation", "gelu"), ("use_bidirectional_attention", True)])
def test_a_checkpoint_asking_for_other_arithmetic_is_refused_at_load(tiny_ckpt_224: Path, key: str,
                                                                     value: Any) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_ckpt_224)
    engine = EngineConfig(model=str(tiny_ckpt_224))
    assert gemma3_spec(tiny_ckpt_224, config, engine).family == "gemma3"  # as saved: served
    setattr(config.text_config, key, value)
    with pytest.raises(ValueError, match=f"text_config.{key}"):
        gemma3_spec(tiny_ckpt_224, config, engine)


def test_a_quantized_checkpoint_is_refused_before_its_weights_load(tiny_ckpt_224: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_ckpt_224)
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}  # as config.json holds it
    with pytest.raises(ValueError, match=r"quantized .*'bitsandbytes'.*unquantized weights only"):
        gemma3_spec(tiny_ckpt_224, config, EngineConfig(model=str(tiny_ckpt_224)))


def test_the_stop_tokens_of_config_json_count_without_a_generation_config(tiny_ckpt_224: Path,
                                                                         tmp_path: Path) -> None:
    """google's releases list `<eos>` and `<end_of_turn>` in config.json too; a copy that lost its
    generation_config.json must still stop at the end of the model's turn."""
    import json
    import shutil

    from transformers import AutoConfig

    for name in ("config.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(tiny_ckpt_224 / name, tmp_path / name)
    config = AutoConfig.from_pretrained(tmp_path)
    top = json.loads((tmp_path / "config.json").read_text())["eos_token_id"]
    assert isinstance(top, list) and len(top) > 1 and config.text_config.eos_token_id == top[0]
    spec = gemma3_spec(tmp_path, config, EngineConfig(model=str(tmp_path)))
    assert spec.eos_token_ids == tuple(top)


def test_dtype_names_are_checked_auto_takes_the_checkpoints_and_float16_is_refused(tiny_ckpt_224: Path,
                                                                                   tmp_path: Path) -> None:
    import json

    from transformers import AutoConfig

    from mmserve.models.gemma3 import served_dtype

    with pytest.raises(ValueError, match=r"EngineConfig\.dtype must be one of"):
        EngineConfig(dtype="int8")
    saved = json.loads((tiny_ckpt_224 / "config.json").read_text())
    saved.pop("dtype", None)
    for key, on_disk, served in [("torch_dtype", "bfloat16", torch.bfloat16), (None, None, torch.float32)]:
        saved.pop("torch_dtype", None)
        if key is not None:  # google's releases say `torch_dtype`; transformers 5 reads it as `dtype`
            saved[key] = on_disk
        (tmp_path / "config.json").write_text(json.dumps(saved))
        config = AutoConfig.from_pretrained(tmp_path)
        assert served_dtype("auto", config) == served and served_dtype("float32", config) == torch.float32
    with pytest.raises(ValueError, match="overflow float16"):
        served_dtype("float16", config)
    family = Gemma3Family(tiny_ckpt_224, EngineConfig(model=str(tiny_ckpt_224), dtype="auto"))
    assert family.dtype == torch.float32  # the tiny checkpoint's own


@pytest.mark.parametrize("sharded", [False, True])
def test_auto_without_a_dtype_in_the_config_takes_the_weights_as_transformers_does(tmp_path: Path,
                                                                                    sharded: bool) -> None:
    import json

    from safetensors.torch import save_file
    from transformers import Gemma3Config

    from mmserve.models.gemma3 import served_dtype, weights_dtype

    tensors = {"a.steps": torch.zeros(2, dtype=torch.int64), "b.weight": torch.zeros(2, dtype=torch.bfloat16)}
    name = "model-00001-of-00002.safetensors" if sharded else "model.safetensors"
    save_file(tensors, str(tmp_path / name))
    if sharded:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a.steps": name, "b.weight": name, "c.weight": "model-00002-of-00002.safetensors"}}))
    config = Gemma3Config()
    config.dtype = None
    assert weights_dtype(tmp_path) == torch.bfloat16
    assert served_dtype("auto", config, tmp_path) == torch.bfloat16  # before: float32
    assert served_dtype("auto", config) == torch.float32 and weights_dtype(tmp_path / "none") is None


def test_a_checkpoint_served_wider_than_saved_on_an_accelerator_is_warned_of(tiny_ckpt_224: Path, tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    import json
    import shutil

    folder = Path(shutil.copytree(tiny_ckpt_224, tmp_path / "bf16-checkpoint"))
    saved = json.loads((folder / "config.json").read_text())
    saved["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(saved))
    with caplog.at_level("WARNING", logger="mmserve.models.gemma3"):
        Gemma3Family(folder, EngineConfig(model=str(folder), device="cpu"))
        assert not caplog.records  # on a CPU float32 is the default on purpose (bfloat16 matmuls are slow there)
        Gemma3Family(folder, EngineConfig(model=str(folder), device="cuda"))  # NOTE: nothing is moved yet
    assert "2x their memory; dtype=auto serves them as saved" in caplog.text
    saved["dtype"] = "float16"  # refused itself; another dtype serves it (community fine-tunes save it)
    (folder / "config.json").write_text(json.dumps(saved))
    assert Gemma3Family(folder, EngineConfig(model=str(folder), dtype="bfloat16", device="cuda")).dtype == \
        torch.bfloat16
    with caplog.at_level("WARNING", logger="mmserve.models.gemma3"):
        Gemma3Family(folder, EngineConfig(model=str(folder), device="cuda"))
    assert "dtype=bfloat16 serves them in half" in caplog.records[-1].getMessage()  # auto would be refused


def test_a_hugging_face_cache_snapshot_is_served_under_its_repo_id(tmp_path: Path) -> None:
    from mmserve.models.base import checkpoint_name

    snapshot = tmp_path / "hub" / "models--google--gemma-3-4b-it" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    (tmp_path / "gemma").symlink_to(snapshot)  # a link to the snapshot: the same checkpoint
    assert checkpoint_name(snapshot) == checkpoint_name(tmp_path / "gemma") == "google/gemma-3-4b-it"
    assert checkpoint_name(tmp_path / "my-gemma") == "my-gemma"  # any other folder: its name


@pytest.mark.parametrize("layout", ["google", "transformers-4", "transformers-5"])
def test_the_vision_parts_load_alone_from_every_layout_as_the_whole_model_has_them(tiny_ckpt_224: Path,
                                                                                   tmp_path: Path, layout: str) -> None:
    """An Encoder reads the vision tower and projector only (the text model's tensors are skipped as keys the
    parts do not expect), under each layout a user's download may have: google's original key names, older
    transformers' and the current ones."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import Gemma3ForConditionalGeneration

    renames = {"google": [(r"^vision_tower\.", "vision_tower.vision_model.")],
               "transformers-4": [(r"^vision_tower\.", "model.vision_tower.vision_model."),
                                  (r"^language_model\.model\.", "model.language_model."),
                                  (r"^multi_modal_projector\.", "model.multi_modal_projector.")],
               "transformers-5": []}[layout]
    shutil.copytree(tiny_ckpt_224, tmp_path / "ckpt")
    saved = load_file(str(tiny_ckpt_224 / "model.safetensors"))  # the current layout
    for pattern, to in renames:
        saved = {re.sub(pattern, to, key): value for key, value in saved.items()}
    save_file(saved, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    family = Gemma3Family(tmp_path / "ckpt", EngineConfig(model=str(tmp_path / "ckpt")))
    parts = family._load_vision(alone=True)
    assert {name.split(".")[1] for name, _ in parts.named_parameters()} == {"vision_tower", "multi_modal_projector"}
    whole = Gemma3ForConditionalGeneration.from_pretrained(tiny_ckpt_224).state_dict()
    assert all(torch.equal(whole[name], value) for name, value in parts.state_dict().items())
    assert family._hf_model is None  # the whole model was never loaded for them


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_a_rope_type_that_follows_the_sequence_length_is_refused_at_load(tiny_ckpt_224: Path,
                                                                        rope_type: str) -> None:
    """One table of every position serves all sequences: frequencies that change with a call's longest
    position (transformers' `dynamic_rope_update`) would be one sequence's for all."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_ckpt_224)
    engine = EngineConfig(model=str(tiny_ckpt_224))
    config.text_config.rope_parameters["full_attention"]["rope_type"] = rope_type
    with pytest.raises(ValueError, match=f"'full_attention'.*{rope_type}"):
        gemma3_spec(tiny_ckpt_224, config, engine)
    config.text_config.rope_parameters["rope_type"] = "default"  # NOTE: beside the per-type sets, read by none
    with pytest.raises(ValueError, match=f"'full_attention'.*{rope_type}"):
        gemma3_spec(tiny_ckpt_224, config, engine)
    config.text_config.rope_parameters["full_attention"]["rope_type"] = "default"
    config.text_config.rope_parameters["rope_type"] = rope_type  # the per-type sets are what the rotary reads
    gemma3_spec(tiny_ckpt_224, config, engine)


def test_attention_logits_are_not_capped_whatever_the_config_says_as_in_transformers(tiny_ckpt_224: Path) -> None:
    """transformers' Gemma 3 attention keeps `attn_logit_softcapping` but never applies it (the oracle)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_ckpt_224)
    config.text_config.attn_logit_softcapping = 50.0
    assert gemma3_spec(tiny_ckpt_224, config, EngineConfig(model=str(tiny_ckpt_224))).attention.softcap is None
