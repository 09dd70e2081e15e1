"""Offline builder of a tiny random-weight Gemma 3 checkpoint folder.

Owns: writing a folder that loads with `AutoProcessor` / `AutoModelForImageTextToText` exactly like a
`google/gemma-3-4b-it` download (config, safetensors, generation config; the tokenizer, chat template
and processor configs come from `tiny_tokenizer.py`), and a content-addressed cache of such folders.
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
from typing import Any

from mmserve.models.tiny_tokenizer import build_tokenizer, save_processor_configs, save_tokenizer, special_token_ids

__all__ = ["BUILDER_VERSION", "build_tiny_gemma3", "default_tiny_checkpoint"]

BUILDER_VERSION = 1  # bump whenever the bytes a build writes change; it is part of the cache key


def build_tiny_gemma3(
    out_dir: str | Path,
    *,
    image_size: int = 896,  # px per side, as the real model
    patch_size: int = 14,  # px per SigLIP patch, as the real model
    mm_tokens: int = 256,  # image tokens per image: t*t, with (image_size // patch_size) % t == 0
    seed: int = 0,  # weights are a pure function of the arguments and this seed
    vocab_size: int = 1024,  # upper bound: the BPE stops earlier when the corpus runs out of merges
    model_vocab_size: int | None = None,  # embedding rows (the logits' width) when above the tokenizer's
    text_hidden: int = 64,
    text_layers: int = 4,
    text_heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 32,
    query_pre_attn_scalar: float | None = None,  # the attention's scale is its -1/2 power; None = head_dim
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
    # config.json as Google's releases write it (transformers 4.50: `rope_scaling`, `rope_local_base_freq`,
    # `sliding_window_pattern`, `torch_dtype`), which transformers converts as it reads; None = its own format
    google_format: bool | None = None,
) -> Path:
    """Write a complete Gemma 3 checkpoint with random weights into `out_dir` and return it.

    NOTE: `model_vocab_size` gives the model a real checkpoint's vocabulary width (gemma-3-4b: 262,208 rows,
    its lm_head the largest product of a decode step) with this tokenizer: ids past the tokenizer's are
    rows no prompt holds, decoded as no text, as a real checkpoint's padding rows are.
    Raises ValueError when image_size / patch_size / mm_tokens do not fit together, or when
    `model_vocab_size` is below the tokenizer's vocabulary.
    """
    _check_image_geometry(image_size, patch_size, mm_tokens)
    tokenizer = build_tokenizer(vocab_size)
    if model_vocab_size is not None and model_vocab_size < len(tokenizer):
        raise ValueError(f"model_vocab_size {model_vocab_size} is below the tokenizer's {len(tokenizer)} tokens")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, out)
    save_processor_configs(out, image_size=image_size, mm_tokens=mm_tokens)
    ids = special_token_ids(tokenizer)
    text = _text_config(
        vocab_size=model_vocab_size or len(tokenizer), ids=ids, hidden=text_hidden, layers=text_layers,
        heads=text_heads, kv_heads=kv_heads, head_dim=head_dim, query_scalar=query_pre_attn_scalar or head_dim,
        intermediate=text_intermediate,
        sliding_window=sliding_window, full_every=full_attention_every, max_positions=max_positions,
        theta_global=rope_theta_global, theta_local=rope_theta_local, rope_scaling=global_rope_scaling,
    )
    vision = dict(
        hidden_size=vision_hidden, intermediate_size=vision_intermediate, num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads, image_size=image_size, patch_size=patch_size,
        vision_use_head=False, layer_norm_eps=1e-6,
    )
    _save_model(out, text, vision, ids, mm_tokens, seed)
    if google_format:
        path = out / "config.json"
        path.write_text(json.dumps(as_google_wrote_it(json.loads(path.read_text())), indent=2))
    for path in out.iterdir():
        path.chmod(0o644)  # NOTE: save_pretrained leaves model.safetensors at 0600; a download is 0644
    return out


_BUILD_SIGNATURE = inspect.signature(build_tiny_gemma3)


def as_google_wrote_it(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json of transformers 5 in the older keys of Google's gemma-3-*-it releases (same meaning)."""
    text = dict(config["text_config"])
    ropes = text.pop("rope_parameters")
    full, local = ropes["full_attention"], ropes["sliding_attention"]
    text["rope_theta"], text["rope_local_base_freq"] = full["rope_theta"], local["rope_theta"]
    if full["rope_type"] != "default":
        text["rope_scaling"] = {"factor": full["factor"], "rope_type": full["rope_type"]}
    for key in ("layer_types", "_sliding_window_pattern"):  # NOTE: derived from sliding_window_pattern
        text.pop(key, None)
    older = {k: v for k, v in config.items() if k != "dtype"}
    return {**older, "text_config": text, "torch_dtype": config["dtype"]}


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
    """Every argument of a build, defaults filled in, less those left at a None default.

    NOTE: an argument added with a None default then keeps every existing folder's key (and name)."""
    bound = _BUILD_SIGNATURE.bind("unused", **overrides)
    bound.apply_defaults()
    params = _BUILD_SIGNATURE.parameters
    return {k: v for k, v in bound.arguments.items()
            if k != "out_dir" and not (v is None and params[k].default is None)}


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
                 kv_heads: int, head_dim: int, query_scalar: float, intermediate: int, sliding_window: int,
                 full_every: int,
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
        head_dim=head_dim, query_pre_attn_scalar=query_scalar, sliding_window=sliding_window,
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
    import torch

    # NOTE: built on the meta device, then given memory: every parameter is written by _randomize, so the
    # stock init would be work thrown away (most of a gemma-3-4b-size build's time)
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(config)
    model = model.to_empty(device="cpu").float()
    model.tie_weights()  # NOTE: to_empty gives the tied lm_head a tensor of its own
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
