"""`python -m mmserve [--model DIR] [--device cuda] [--dtype bfloat16]`: run the in-process engine on a sample
image request.

Owns: the first-run demo only. Without --model it builds (once, into the user cache) the tiny
random-weight Gemma 3 checkpoint and serves from it, so the text it prints is gibberish by design.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io

import numpy as np
from PIL import Image

from mmserve.config import DTYPES
from mmserve.engine import Engine, new_request_id
from mmserve.messages import ChatRequest, SamplingParams
from mmserve.models.tiny_checkpoint import default_tiny_checkpoint


def sample_image_url(width: int = 640, height: int = 480) -> str:
    """A synthetic gradient image as a PNG data URL."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _demo(engine: Engine, max_tokens: int) -> None:
    request = ChatRequest(
        request_id=new_request_id(),
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": sample_image_url()}},
            {"type": "text", "text": "Describe this image."},
        ]}],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    async for out in engine.stream(request):
        print(out.new_text, end="", flush=True)
        if out.finished:
            print(f"\n[finish_reason={out.finish_reason} prompt_tokens={out.num_prompt_tokens} "
                  f"completion_tokens={out.num_output_tokens}]")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m mmserve", description=__doc__)
    parser.add_argument("--model", help="local Gemma 3 checkpoint folder (default: the built-in tiny one)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="weights' and activations' dtype; bfloat16 on a GPU (default: float32)")
    args = parser.parse_args()
    model_dir = args.model or str(default_tiny_checkpoint())
    with Engine.from_model_dir(model_dir, device=args.device, dtype=args.dtype) as engine:
        asyncio.run(_demo(engine, args.max_tokens))
        print(engine.stats())


if __name__ == "__main__":
    main()
