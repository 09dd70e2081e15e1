"""The benchmark checkpoint: a random-weight Gemma 3 wide enough that the work is real on a CPU.

Owns: its sizes (one place), building it into mmserve's checkpoint cache, and measuring the two
numbers that say how heavy it is on this machine (vision encoder per 896-px image, decoder step at
batch 1) plus a ~300-token prefill. Does not own serving it.
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


def bench_checkpoint() -> Path:
    """The checkpoint folder, built once into `$MMSERVE_CACHE_DIR` (default ~/.cache/mmserve)."""
    from mmserve.models.tiny_checkpoint import default_tiny_checkpoint

    return default_tiny_checkpoint(**BENCH_SIZES)


def calibrate(model_dir: Path, repeats: int = 3) -> dict[str, float]:
    """Median ms of: one image through the vision tower + projector, a decoder step at batch 1
    (with a 300-token context), a 296-token text prefill; and the parameter count."""
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
            "parameters_millions": params / 1e6}
