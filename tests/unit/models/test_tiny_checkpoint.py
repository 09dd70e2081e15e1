"""Sanity of the offline tiny Gemma 3 checkpoint: it loads and behaves like a real download.

Owns: checks of mmserve.models.tiny_checkpoint (with tiny_tokenizer) and scripts/make_tiny_gemma3.py.
Does not own: the serving engine's use of the checkpoint (its own tests do that).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from mmserve.models import tiny_checkpoint as tc
from mmserve.models import tiny_tokenizer as tt

REPO = Path(__file__).resolve().parents[3]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}]},
]


def _image(seed: int, width: int = 400, height: int = 300) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def loaded(tiny_ckpt: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoProcessor.from_pretrained(tiny_ckpt), AutoModelForImageTextToText.from_pretrained(tiny_ckpt)


def _prompt(processor: Any) -> str:
    return processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def test_loads_like_a_real_download(tiny_ckpt: Path, loaded: tuple[Any, Any]) -> None:
    processor, model = loaded
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert type(processor).__name__ == "Gemma3Processor"
    assert type(processor.tokenizer).__name__ == "GemmaTokenizer"
    config = json.loads((tiny_ckpt / "config.json").read_text())
    assert config["model_type"] == "gemma3"
    assert config["vision_config"]["model_type"] == "siglip_vision_model"
    text = model.config.text_config
    assert {"sliding_attention", "full_attention"} == set(text.layer_types)
    assert text.sliding_window == 64 and text.max_position_embeddings >= 4096
    rope = text.rope_parameters
    assert rope["full_attention"]["rope_theta"] != rope["sliding_attention"]["rope_theta"]
    assert model.config.mm_tokens_per_image == processor.image_seq_length == 256
    generation = json.loads((tiny_ckpt / "generation_config.json").read_text())
    tok = processor.tokenizer
    assert {tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")} <= set(generation["eos_token_id"])


def test_weights_are_nontrivial(tiny_ckpt: Path) -> None:
    weights = load_file(tiny_ckpt / "model.safetensors")
    assert all(w.dtype == np.float32 for w in weights.values())
    projector = next(w for k, w in weights.items() if k.endswith("mm_input_projection_weight"))
    assert np.abs(projector).min() > 0
    flat = [k for k, w in weights.items() if w.std() == 0 or not np.abs(w).any()]
    assert flat == []
    assert (tiny_ckpt / "model.safetensors").stat().st_size < 3_000_000


def test_special_tokens_match_config(tiny_ckpt: Path, loaded: tuple[Any, Any]) -> None:
    processor, model = loaded
    tok = processor.tokenizer
    for name in tt.SPECIAL_TOKENS:
        assert tok.tokenize(name) == [name]
    assert tok.boi_token == "<start_of_image>" and tok.eoi_token == "<end_of_image>"
    assert model.config.boi_token_id == tok.boi_token_id
    assert model.config.eoi_token_id == tok.eoi_token_id
    assert model.config.image_token_id == tok.image_token_id == tok.convert_tokens_to_ids("<image_soft_token>")
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert 300 < len(tok) <= 1024 and model.config.text_config.vocab_size == len(tok)


def test_chat_template(tiny_ckpt: Path, loaded: tuple[Any, Any]) -> None:
    processor, _ = loaded
    prompt = _prompt(processor)
    assert prompt.startswith("<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>What is in")
    assert prompt.endswith("<end_of_turn>\n<start_of_turn>model\n")
    assert processor.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == prompt
    saved = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == tt.CHAT_TEMPLATE == processor.chat_template


def test_tokenizer_round_trips_and_merges_newlines(loaded: tuple[Any, Any]) -> None:
    tok = loaded[0].tokenizer
    text = "héllo wörld ✓ 日本"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    for run in range(1, tt.MAX_NEWLINE_RUN + 1):
        assert len(tok("\n" * run, add_special_tokens=False).input_ids) == 1, run
    assert tok.convert_tokens_to_ids("<0x0A>") != tok.convert_tokens_to_ids("\n")


def test_processor_expands_images(loaded: tuple[Any, Any]) -> None:
    processor, _ = loaded
    tok = processor.tokenizer
    out = processor(text=_prompt(processor), images=[_image(0)], add_special_tokens=False, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert tuple(out["pixel_values"].shape) == (1, 3, 896, 896)
    assert ids.count(tok.image_token_id) == 256 == int(out["token_type_ids"].sum())
    assert ids.count(tok.bos_token_id) == 1
    before_boi = tok.convert_ids_to_tokens(ids[ids.index(tok.boi_token_id) - 1])
    assert before_boi == "\n\n\n\n"  # the system's "\n\n" merged with the processor's "\n\n"


def test_pan_and_scan_is_per_call(loaded: tuple[Any, Any]) -> None:
    processor, _ = loaded
    wide = _image(1, width=1200, height=300)
    plain = processor(text=_prompt(processor), images=[wide], return_tensors="pt")
    out = processor(text=_prompt(processor), images=[wide], do_pan_and_scan=True, return_tensors="pt")
    crops = out["pixel_values"].shape[0]
    assert plain["pixel_values"].shape[0] == 1 and crops > 1
    assert int((out["input_ids"] == processor.tokenizer.image_token_id).sum()) == 256 * crops


def test_greedy_generation_depends_on_the_image(loaded: tuple[Any, Any]) -> None:
    processor, model = loaded

    def generate(image: Image.Image) -> list[int]:
        inputs = processor(text=_prompt(processor), images=[image], add_special_tokens=False,
                           return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    first, second = generate(_image(0)), generate(Image.new("RGB", (500, 500), (200, 30, 30)))
    assert first != second
    assert len(set(first) | set(second)) > 2


def test_224_variant(tiny_ckpt_224: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_ckpt_224)
    model = AutoModelForImageTextToText.from_pretrained(tiny_ckpt_224)
    out = processor(text=_prompt(processor), images=[_image(2)], add_special_tokens=False, return_tensors="pt")
    assert tuple(out["pixel_values"].shape) == (1, 3, 224, 224)
    assert int((out["input_ids"] == processor.tokenizer.image_token_id).sum()) == 16
    features = model.get_image_features(out["pixel_values"]).pooler_output  # type: ignore[operator]
    assert tuple(features.shape) == (1, 16, model.config.text_config.hidden_size)


def test_same_seed_same_bytes(tiny_ckpt: Path, tmp_path: Path) -> None:
    again = tc.build_tiny_gemma3(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_ckpt / name).read_bytes(), name


@pytest.mark.parametrize(("image_size", "patch_size", "mm_tokens"),
                         [(896, 14, 255), (896, 14, 100), (896, 14, 0), (900, 14, 256), (224, 14, 9)])
def test_bad_geometry_raises(tmp_path: Path, image_size: int, patch_size: int, mm_tokens: int) -> None:
    with pytest.raises(ValueError):
        tc.build_tiny_gemma3(tmp_path, image_size=image_size, patch_size=patch_size, mm_tokens=mm_tokens)
    assert list(tmp_path.iterdir()) == []


def _fake_build(out_dir: Any, **kwargs: Any) -> Path:
    out = Path(out_dir)
    (out / "config.json").write_text(json.dumps(kwargs, sort_keys=True))
    return out


def test_default_checkpoint_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tc, "build_tiny_gemma3", _fake_build)
    first = tc.default_tiny_checkpoint(seed=3)
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert tc.default_tiny_checkpoint(seed=3) == first and capsys.readouterr().err == ""
    assert json.loads((first / "config.json").read_text())["seed"] == 3
    assert tc.default_tiny_checkpoint(seed=4) != first
    assert sorted(p.name.startswith(".") for p in tmp_path.iterdir()) == [False, False]


def test_default_checkpoint_survives_a_lost_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path))

    def build_then_lose(out_dir: Any, **kwargs: Any) -> Path:
        winner = tmp_path / next(tmp_path.glob(".tiny-gemma3-*")).name.split(".")[1]
        winner.mkdir()  # another process renamed its build in first
        _fake_build(winner, winner=True)
        return _fake_build(out_dir, **kwargs)

    monkeypatch.setattr(tc, "build_tiny_gemma3", build_then_lose)
    path = tc.default_tiny_checkpoint()
    assert json.loads((path / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_cli_builds_a_folder(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_tiny_gemma3", REPO / "scripts" / "make_tiny_gemma3.py")
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = cli.parser().parse_args(["--out", str(tmp_path), "--image-size", "224", "--mm-tokens", "16",
                                    "--global-rope-scaling", "none", "--seed", "7", "--model-vocab-size", "2048"])
    assert (args.image_size, args.mm_tokens, args.global_rope_scaling, args.seed) == (224, 16, None, 7)
    assert args.model_vocab_size == 2048 and isinstance(args.model_vocab_size, int)
    assert cli.main(["--out", str(tmp_path / "x"), "--image-size", "64", "--patch-size", "16",
                     "--mm-tokens", "4"]) == 0
    assert json.loads((tmp_path / "x" / "config.json").read_text())["mm_tokens_per_image"] == 4


def test_model_vocabulary_padded_past_the_tokenizers(tmp_path: Path) -> None:
    """A real checkpoint's vocabulary width with the tiny tokenizer: the embeddings (tied lm_head) have the rows,
    the tokenizer stays as it is, and the ids past it decode as no text."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    out = tc.build_tiny_gemma3(tmp_path / "padded", image_size=224, mm_tokens=16, model_vocab_size=1200)
    model: Any = AutoModelForImageTextToText.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.text_config.vocab_size == 1200 and len(tokenizer) < 1200
    assert model.get_input_embeddings().weight.shape[0] == 1200
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tokenizer.decode([len(tokenizer) + 10]) == ""
    with pytest.raises(ValueError, match="below the tokenizer"):
        tc.build_tiny_gemma3(tmp_path / "short", image_size=224, mm_tokens=16, model_vocab_size=100)


def test_optional_arguments_left_at_none_stay_out_of_the_cache_key() -> None:
    """So an argument added with a None default keeps the name of every folder built before it; an argument
    whose default is not None keeps None in the key (global_rope_scaling=None is another checkpoint)."""
    assert "model_vocab_size" not in tc._bound_args({})
    assert tc._bound_args({"model_vocab_size": 4096})["model_vocab_size"] == 4096
    assert tc._bound_args({"global_rope_scaling": None})["global_rope_scaling"] is None
    assert tc._bound_args({})["global_rope_scaling"] == 8.0


def test_a_config_in_googles_keys_reads_as_the_same_model(tiny_ckpt_gqa: Path, tiny_ckpt_224: Path) -> None:
    """The older keys Google's releases write (`rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`,
    `torch_dtype`) mean what transformers 5's own do: the parity checkpoint written that way is one of them."""
    import json

    from transformers import AutoConfig

    from mmserve.models.tiny_checkpoint import as_google_wrote_it

    saved = json.loads((tiny_ckpt_gqa / "config.json").read_text())
    text = saved["text_config"]
    assert "rope_parameters" not in text and "layer_types" not in text and "dtype" not in saved
    assert text["rope_scaling"] == {"factor": 8.0, "rope_type": "linear"} and saved["torch_dtype"] == "float32"
    assert text["num_attention_heads"] * text["head_dim"] != text["hidden_size"]  # heads wider, as gemma-3-4b's
    native = AutoConfig.from_pretrained(tiny_ckpt_224)
    older = AutoConfig.for_model(**as_google_wrote_it(native.to_dict()))
    assert older.text_config.to_dict() == native.text_config.to_dict() and older.dtype == native.dtype
