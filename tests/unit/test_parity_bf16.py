"""Parity with the oracle in bfloat16, the dtype gemma-3 is served in on GPUs: transformers'
Gemma3ForConditionalGeneration loaded in bfloat16 against the engine at `dtype="bfloat16"`, same checkpoint and
inputs (test_parity.py's cases and reference), on the CPU.

The engine must compute in bfloat16 (its KV cache's dtype), each step's logits must be within BF16_ULPS units in the
last place of the step's largest |logit| (both sides round every op to bfloat16, where transformers does: a moved
rounding step, a norm or a rotary product in the wrong dtype, moves them by tens of ulps), and the greedy tokens
must be identical, except at a near-tie: where the engine's token is the best of its own logits (the image token
excluded, as both sides never pick it), every logit being within that bound of the reference's makes the two tokens'
reference logits at most twice the bound apart, so the rounding allowed has flipped them; the comparison ends there
(the two generations then go on from different tokens).
Five of test_parity.py's cases on two of its checkpoints, on the CPU (a device machine runs the float32 suite).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.engine import Engine
from tests.unit.test_parity import Recorder, build_request, reference

# bfloat16 has 8 bits of mantissa: an ulp is 2^-7 of the value's power of two. Measured here (Intel Xeon) the two
# sides agreed bit for bit on most cases and by one ulp on a long prompt with an image; 8 leaves room for another
# CPU's kernels (a fused projection's sum blocked otherwise) without hiding a rounding step moved through a layer.
BF16_ULPS = 8
CASES = ("text", "one_image", "two_images", "long_with_image", "long_generation")


def bf16_bound(reference_logits: torch.Tensor) -> float:
    return BF16_ULPS * torch.finfo(torch.bfloat16).eps * float(reference_logits.float().abs().max())


@pytest.fixture(scope="module", params=["tiny_ckpt_224", "tiny_ckpt_gqa"])
def bf16_run(request: pytest.FixtureRequest) -> Iterator[tuple[dict[str, Any], dict[str, Any], Recorder, int,
                                                                torch.dtype]]:
    """(the oracle's (tokens, logits, prompt length) per case, the engine's outputs per case, its logits, the image
    token the engine never samples, the dtype its KV cache holds)."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model_dir = Path(request.getfixturevalue(request.param))
    processor = AutoProcessor.from_pretrained(model_dir)
    model: Any = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    refs = {case: reference(model_dir, processor, model, case) for case in CASES}
    never = int(model.config.image_token_id)  # `reference` suppresses it, as the engine never samples it
    del model
    rec = Recorder()
    with Engine(EngineConfig(model=str(model_dir), dtype="bfloat16"), on_logits=rec) as engine:
        outs = {case: engine.generate([build_request(case)[0]])[0] for case in CASES}
        kv_dtype = engine.decoder_service.decoder.runner.kv.keys.dtype
    yield refs, outs, rec, never, kv_dtype


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_matches_transformers_in_bfloat16(bf16_run, case: str) -> None:
    refs, outs, rec, never, kv_dtype = bf16_run
    ref_tokens, ref_logits, ref_prompt = refs[case]
    out = outs[case]
    assert kv_dtype is torch.bfloat16  # the engine computed in bfloat16, not float32 under that name
    assert out.num_prompt_tokens == ref_prompt
    assert len(rec.logits[case]) == len(ref_logits) == len(out.token_ids) == len(ref_tokens)
    for step, (ours, theirs) in enumerate(zip(rec.logits[case], ref_logits, strict=True)):
        bound = bf16_bound(theirs)
        diff = float((ours - theirs.float()).abs().max())
        assert diff <= bound, f"step {step}: max |logit diff| {diff:.4g} past {BF16_ULPS} bf16 ulps ({bound:.4g})"
        if out.token_ids[step] != ref_tokens[step]:
            mine = ours.clone()
            mine[never] = float("-inf")
            assert int(mine.argmax()) == out.token_ids[step], (
                f"step {step}: token {out.token_ids[step]} is not the best of the engine's own logits (transformers "
                f"chose {ref_tokens[step]})")
            return  # NOTE: a near-tie flipped (the logit bound above makes it one); from here the texts differ
