"""The benchmark checkpoints: random-weight Gemma 3s, one wide enough that the work is real on a CPU, one at
gemma-3-4b's own sizes for a GPU.

Owns: their sizes (one place), building them into mmserve's checkpoint cache, and measuring the two
numbers that say how heavy the CPU one is on this machine (vision encoder per 896-px image, decoder step at
batch 1) plus a ~300-token prefill. Does not own serving them.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

# NOTE: SigLIP at the real model's geometry (896 px, 14-px patches, 256 tokens per image) but 192 wide,
# and a 512-wide 6-layer text model with Gemma 3's 5:1 sliding/global pattern: ~26 M parameters.
BENCH_SIZES: dict[str, Any] = dict(
    image_size=896, patch_size=14, mm_tokens=256,
    text_hidden=512, text_layers=6, text_heads=4, kv_heads=1, head_dim=128, text_intermediate=2048,
    sliding_window=512, full_attention_every=6,
    vision_hidden=192, vision_layers=2, vision_heads=3, vision_intermediate=768,
)


# gemma-3-4b-it's config.json: every size but the tokenizer's (ours is tiny; the model's vocabulary is padded to
# the real width instead). ~4.3 G parameters: 17 GB in float32, built in minutes; for a GPU's host.
GEMMA3_4B_SIZES: dict[str, Any] = dict(
    image_size=896, patch_size=14, mm_tokens=256, model_vocab_size=262_208,
    text_hidden=2560, text_layers=34, text_heads=8, kv_heads=4, head_dim=256, text_intermediate=10_240,
    sliding_window=1024, full_attention_every=6, max_positions=131_072,
    rope_theta_global=1_000_000.0, rope_theta_local=10_000.0, global_rope_scaling=8.0,
    vision_hidden=1152, vision_layers=27, vision_heads=16, vision_intermediate=4304,
)

SIZES: dict[str, dict[str, Any]] = {"bench": BENCH_SIZES, "gemma-3-4b": GEMMA3_4B_SIZES}


def bench_checkpoint(sizes: str = "bench", **overrides: Any) -> Path:
    """The checkpoint folder of `SIZES[sizes]` (with `overrides`, e.g. fewer layers for a dry run on a CPU),
    built once into `$MMSERVE_CACHE_DIR` (default ~/.cache/mmserve)."""
    from mmserve.models.tiny_checkpoint import default_tiny_checkpoint

    return default_tiny_checkpoint(**{**SIZES[sizes], **overrides})


def calibrate(model_dir: Path, repeats: int = 3) -> dict[str, float]:
    """Median ms of: one image through the vision tower + projector, a decoder step at batch 1
    (with a 300-token context), a 296-token text prefill; the parameter count and the crop size (px)."""
    import torch
    from transformers import Gemma3ForConditionalGeneration
    from transformers.cache_utils import DynamicCache

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    size = model.config.vision_config.image_size
    pixels = torch.randn(1, 3, size, size)
    ids = torch.randint(300, 900, (1, 296))

    def timed(fn) -> float:
        fn()  # warm-up
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t) * 1e3)
        return statistics.median(runs)

    with torch.inference_mode():
        encoder_ms = timed(lambda: model.model.get_image_features(pixel_values=pixels))
        prefill_ms = timed(lambda: model(input_ids=ids, use_cache=True, cache=DynamicCache(config=model.config)))
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, use_cache=True, cache=cache)
        token = out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(8 + repeats * 4):
            t = time.perf_counter()
            out = model(input_ids=token, use_cache=True, cache=cache)
            token = out.logits[:, -1:].argmax(-1)
            steps.append((time.perf_counter() - t) * 1e3)
        step_ms = statistics.median(steps[4:])
    params = sum(p.numel() for p in model.parameters())
    return {"encoder_ms_per_image": encoder_ms, "decoder_step_ms_b1": step_ms, "prefill_ms_296_tokens": prefill_ms,
            "parameters_millions": params / 1e6, "image_size": size}
