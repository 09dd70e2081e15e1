"""On a GPU: a decoder step waits for the device once, to read its sampled tokens (issue 16's lean step).

Runs only where `MMSERVE_TEST_DEVICE` names a CUDA device that is there (scripts/device_check.sh on a lent
GPU); skipped on the CPU, where nothing waits for a device. PyTorch's sync debug mode warns at every
operation that makes the host wait for the device (a blocking copy, `.item()`, `.tolist()`, a size known
only on the device); the steps here mix what a step can hold: prefill chunks, an image's rows from the host,
decodes together, a seeded top-p draw with penalties and log-probs, and a row under a JSON schema.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mmserve.config import DecoderConfig, EngineConfig
from mmserve.messages import DecodeRequest, MultiModalFeatureSpec, PlaceholderRange, SamplingParams, StructuredOutput
from mmserve.stages import StageFactory
from tests.device import TEST_DEVICE

pytestmark = pytest.mark.skipif(not TEST_DEVICE.startswith("cuda") or not torch.cuda.is_available(),
                                reason="needs MMSERVE_TEST_DEVICE=cuda on a GPU (scripts/device_check.sh)")


def test_every_step_waits_for_the_device_once(tiny_ckpt_224: Path) -> None:
    config = EngineConfig(model=str(tiny_ckpt_224), device=TEST_DEVICE,
                          decoder=DecoderConfig(max_num_batched_tokens=48, kept_gathers_min_bytes=0))
    decoder = StageFactory(config).decoder().decoder
    spec, rows = decoder.spec, 16  # the 224-px checkpoint's image rows
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [2, 5, 6, *[spec.image_token_id] * rows, 7, 8, *range(9, 80)]
    image = MultiModalFeatureSpec("img", "image", PlaceholderRange(3, rows), rows)
    decoder.add(DecodeRequest("image", prompt, [image], [np.zeros((rows, spec.hidden_size), np.float32)], greedy))
    decoder.add(DecodeRequest("drawn", list(range(2, 40)), [], [], replace(
        greedy, temperature=0.8, top_p=0.9, seed=1, repetition_penalty=1.2, frequency_penalty=0.5, logprobs=3)))
    schema = StructuredOutput("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    decoder.add(DecodeRequest("json", list(range(2, 20)), [], [], replace(greedy, structured=schema)))
    decoder.step()  # NOTE: the first step pays the CUDA libraries' start, outside the count
    per_step = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while decoder.has_unfinished():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                decoder.step()
            per_step.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(per_step) >= 10 and max(per_step) <= 1 and sum(per_step) >= 10, per_step
