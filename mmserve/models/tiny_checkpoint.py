"""Offline builder of a tiny random-weight Gemma 3 checkpoint folder.

Owns: writing a folder that loads with `AutoProcessor` / `AutoModelForImageTextToText` exactly like a
`google/gemma-3-4b-it` download (config, safetensors, a locally trained Gemma-style tokenizer, the real
chat template, processor configs, generation config), and a content-addressed cache of such folders.
Does not own: loading checkpoints for serving, nor any Ray code. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

__all__ = [
    "BUILDER_VERSION", "CHAT_TEMPLATE", "MAX_NEWLINE_RUN", "SPECIAL_TOKENS",
    "build_tiny_gemma3", "default_tiny_checkpoint",
]

BUILDER_VERSION = 1  # bump whenever the bytes a build writes change; it is part of the cache key


def build_tiny_gemma3(
    out_dir: str | Path,
    *,
    image_size: int = 896,  # px per side, as the real model
    patch_size: int = 14,  # px per SigLIP patch, as the real model
    mm_tokens: int = 256,  # image tokens per image: t*t, with (image_size // patch_size) % t == 0
    seed: int = 0,  # weights are a pure function of the arguments and this seed
    vocab_size: int = 1024,  # upper bound: the BPE stops earlier when the corpus runs out of merges
    text_hidden: int = 64,
    text_layers: int = 4,
    text_heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 32,
    text_intermediate: int = 128,
    sliding_window: int = 64,  # tokens: small, so that tests can reach past it
    full_attention_every: int = 2,  # every n-th layer is global (the real model: 6)
    max_positions: int = 8192,
    rope_theta_global: float = 1_000_000.0,
    rope_theta_local: float = 10_000.0,
    global_rope_scaling: float | None = 8.0,  # linear factor on the global layers, as gemma-3-4b; None = off
    vision_hidden: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 2,
    vision_intermediate: int = 64,
) -> Path:
    """Write a complete Gemma 3 checkpoint with random weights into `out_dir` and return it.

    Raises ValueError when image_size / patch_size / mm_tokens do not fit together.
    """
    _check_image_geometry(image_size, patch_size, mm_tokens)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(vocab_size)
    _save_tokenizer(tokenizer, out)
    _save_processor_configs(out, image_size=image_size, mm_tokens=mm_tokens)
    ids = _special_token_ids(tokenizer)
    text = _text_config(
        vocab_size=len(tokenizer), ids=ids, hidden=text_hidden, layers=text_layers, heads=text_heads,
        kv_heads=kv_heads, head_dim=head_dim, intermediate=text_intermediate,
        sliding_window=sliding_window, full_every=full_attention_every, max_positions=max_positions,
        theta_global=rope_theta_global, theta_local=rope_theta_local, rope_scaling=global_rope_scaling,
    )
    vision = dict(
        hidden_size=vision_hidden, intermediate_size=vision_intermediate, num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads, image_size=image_size, patch_size=patch_size,
        vision_use_head=False, layer_norm_eps=1e-6,
    )
    _save_model(out, text, vision, ids, mm_tokens, seed)
    for path in out.iterdir():
        path.chmod(0o644)  # NOTE: save_pretrained leaves model.safetensors at 0600; a download is 0644
    return out


_BUILD_SIGNATURE = inspect.signature(build_tiny_gemma3)


def default_tiny_checkpoint(**overrides: Any) -> Path:
    """Return a cached tiny checkpoint built with `overrides`, building it once if needed.

    The cache lives in `$MMSERVE_CACHE_DIR` (default `~/.cache/mmserve`), one folder per argument hash.
    Safe when several processes race: each builds in its own temp folder and renames it into place.
    """
    args = _bound_args(overrides)
    key = json.dumps({"builder": BUILDER_VERSION, **args}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(os.environ.get("MMSERVE_CACHE_DIR", "~/.cache/mmserve")).expanduser()
    final = root / f"tiny-gemma3-{args['image_size']}px-{args['mm_tokens']}t-{digest}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    print(f"mmserve: building tiny Gemma 3 checkpoint into {final}", file=sys.stderr)
    try:
        build_tiny_gemma3(tmp, **args)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        os.rename(tmp, final)  # NOTE: atomic; fails if another process renamed its build in first
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _bound_args(overrides: dict[str, Any]) -> dict[str, Any]:
    bound = _BUILD_SIGNATURE.bind("unused", **overrides)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items() if k != "out_dir"}


def _check_image_geometry(image_size: int, patch_size: int, mm_tokens: int) -> None:
    if patch_size <= 0 or image_size % patch_size:
        raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
    per_side = math.isqrt(mm_tokens) if mm_tokens > 0 else 0
    patches = image_size // patch_size
    if per_side * per_side != mm_tokens or mm_tokens == 0:
        raise ValueError(f"mm_tokens {mm_tokens} must be a positive perfect square")
    if patches % per_side:
        raise ValueError(f"{patches} patches per side are not divisible by {per_side} tokens per side")


def _text_config(*, vocab_size: int, ids: dict[str, int], hidden: int, layers: int, heads: int,
                 kv_heads: int, head_dim: int, intermediate: int, sliding_window: int, full_every: int,
                 max_positions: int, theta_global: float, theta_local: float,
                 rope_scaling: float | None) -> dict[str, Any]:
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta_global}
    if rope_scaling is not None:
        full = {"rope_type": "linear", "factor": rope_scaling, "rope_theta": theta_global}
    layer_types = [
        "full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(layers)
    ]
    return dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=sliding_window,
        layer_types=layer_types, sliding_window_pattern=full_every, max_position_embeddings=max_positions,
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default", "rope_theta": theta_local}},
        pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=ids["eos"],
    )


def _save_model(out: Path, text: dict[str, Any], vision: dict[str, Any], ids: dict[str, int],
                mm_tokens: int, seed: int) -> None:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GenerationConfig

    config = Gemma3Config(
        text_config=text, vision_config={"model_type": "siglip_vision_model", **vision},
        mm_tokens_per_image=mm_tokens, boi_token_index=ids["boi"], eoi_token_index=ids["eoi"],
        image_token_index=ids["image"],
    )
    config.eos_token_id = [ids["eos"], ids["end_of_turn"]]  # as the real config.json: <eos>, <end_of_turn>
    config.architectures = ["Gemma3ForConditionalGeneration"]
    model = Gemma3ForConditionalGeneration(config).float()
    _randomize(model, seed)
    model.generation_config = GenerationConfig(  # NOTE: the real file samples by default; so does ours
        bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["end_of_turn"]], pad_token_id=ids["pad"],
        do_sample=True, top_k=64, top_p=0.95, cache_implementation="hybrid",
    )
    model.save_pretrained(out)


def _randomize(model: Any, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, scaled so that each part matters.

    NOTE: the stock init (std 0.02, norms at identity, projector at zero) leaves the residual stream
    dominated by the token embedding: with tied embeddings greedy decoding then repeats the last
    token whatever the image. Fan-in scaling, a gain of ~2 on the post-attention / post-MLP norms and
    on the q/k norms (sharper attention) give varied greedy continuations that depend on the image.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)  # NOTE: a private generator leaves torch's global RNG alone
    seen: set[int] = set()
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if id(param) not in seen:  # the tied lm_head shares the embedding tensor
                    seen.add(id(param))
                    param.copy_(_random_like(module_name, type(module).__name__, name, param, gen))


_GAIN_2_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm", "q_norm", "k_norm")


def _random_like(module_name: str, kind: str, name: str, param: Any, gen: Any) -> Any:
    import torch

    noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
    if name == "mm_input_projection_weight":
        return noise / math.sqrt(param.shape[0])  # (vision_hidden, text_hidden): fan-in is dim 0
    if "RMSNorm" in kind:  # Gemma RMSNorm scales by (1 + weight)
        return noise * 0.1 + (1.0 if module_name.endswith(_GAIN_2_NORMS) else 0.0)
    if name == "bias":
        return noise * 0.02
    if "LayerNorm" in kind:
        return 1.0 + noise * 0.1  # SigLIP LayerNorm: the weight is the scale itself
    fan_in = param.shape[1] if "Embedding" in kind else param[0].numel()
    return noise / math.sqrt(fan_in)


# ---- tokenizer ---------------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>")
MAX_NEWLINE_RUN = 31  # the real vocabulary has "\n" * 1..31 as ordinary tokens

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small cat sat on the warm mat by the door.
What is in this image? Describe the picture in one sentence. The photo shows a red car parked on a street.
There are two people walking along the beach at sunset, and the sky is orange, pink and purple.
Please answer the question about the image. How many apples are on the table? I can see three green apples.
The chart compares sales in January, February and March; the blue bar is the highest of all.
A large white building stands behind a row of tall trees, with mountains far away in the background.
Hello! How can I help you today? Thank you for your question, here is a short and helpful answer.
You are a helpful assistant. Answer briefly and clearly, and say when you are not sure about something.
The model reads text and images, then writes an answer one token at a time until it reaches the end.
In the kitchen there is a wooden table, four chairs, a bowl of fruit and a cup of hot coffee.
A dog with brown fur is running through the green grass in a park, chasing a yellow ball.
This document explains how to install the software, start the server and send a first request.
The user and the model take turns; the system prompt goes in the first user turn of the chat.
Letters: A B C D E F G H I J K L M N O P Q R S T U V W X Y Z and a b c d e f g h i j k l m n o p q r s t u v w x y z.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 100 224 256 896 1000 2024 2025.
Questions like "where", "when", "which", "who" and "why" ask for different kinds of information.
The weather today is sunny with a few clouds, and tomorrow it will rain in the morning.
"""


def _corpus() -> list[str]:
    runs = ["\n" * n for n in range(1, MAX_NEWLINE_RUN + 1)]
    return _CORPUS.splitlines(keepends=True) * 3 + runs * 2 + ["\n\n".join(_CORPUS.split(". "))]


def _train_bpe(n_tokens: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Train a byte-fallback BPE over the corpus; return its vocabulary (in id order) and merges."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # NOTE: training splits words at "▁" and isolates newline runs, so no merge crosses a word or a
    # newline run; GemmaTokenizer then encodes whole strings with these merges and segments the same way.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("▁", "merged_with_next"), pre_tokenizers.Split(Regex("\n+"), "isolated"),
    ])
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=n_tokens, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    return list(model["vocab"]), [tuple(m) for m in model["merges"]]


def _build_tokenizer(vocab_size: int) -> Any:
    """A GemmaTokenizer: Gemma's special tokens, 256 byte tokens, then the trained BPE pieces."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces, merges = _train_bpe(vocab_size - len(SPECIAL_TOKENS) - len(byte_tokens))
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *byte_tokens, *pieces):
        vocab.setdefault(token, len(vocab))
    # NOTE: the hint says list[str], but the BPE backend takes (left, right) tuples
    tok = GemmaTokenizer(vocab=vocab, merges=cast(Any, merges), add_bos_token=True, add_eos_token=False)
    tok.add_special_tokens({"extra_special_tokens": list(SPECIAL_TOKENS[5:])})
    return tok


def _special_token_ids(tok: Any) -> dict[str, int]:
    names = ("pad", "eos", "bos", "unk", "mask", "start_of_turn", "end_of_turn", "boi", "eoi", "image")
    return {n: tok.convert_tokens_to_ids(t) for n, t in zip(names, SPECIAL_TOKENS, strict=True)}


def _save_tokenizer(tok: Any, out: Path) -> None:
    """Write tokenizer.json and a tokenizer_config.json laid out like the real Gemma 3 one."""
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tok.convert_tokens_to_ids(t)): {"content": t, "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": added,
        "boi_token": "<start_of_image>", "bos_token": "<bos>", "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "eoi_token": "<end_of_image>", "eos_token": "<eos>",
        # NOTE: Gemma3Processor reads tokenizer.boi_token / eoi_token / image_token (+ _id); the dict
        # form of extra_special_tokens is what turns them into tokenizer attributes on load.
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
        "image_token": "<image_soft_token>", "mask_token": "<mask>", "model_max_length": int(1e30),
        "pad_token": "<pad>", "processor_class": "Gemma3Processor",
        "spaces_between_special_tokens": False, "tokenizer_class": "GemmaTokenizer", "unk_token": "<unk>",
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", {
        "boi_token": "<start_of_image>", "bos_token": "<bos>", "eoi_token": "<end_of_image>",
        "eos_token": "<eos>", "image_token": "<image_soft_token>", "pad_token": "<pad>", "unk_token": "<unk>",
    })


def _save_processor_configs(out: Path, *, image_size: int, mm_tokens: int) -> None:
    """processor_config.json, preprocessor_config.json and chat_template.json, as in the real repo."""
    _write_json(out / "processor_config.json", {"image_seq_length": mm_tokens,
                                                "processor_class": "Gemma3Processor"})
    _write_json(out / "preprocessor_config.json", {
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
        "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": mm_tokens, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": image_size, "width": image_size},
    })
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# NOTE: the verbatim chat template of google/gemma-3-*-it (newlines inside the string literals are real
# newline characters there too). The system message is folded into the first user turn.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
