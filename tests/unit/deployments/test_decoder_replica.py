"""The Decoder replica's call to the Encoder: an answer made with other vision weights than the Decoder's checkpoint
holds is refused before its embeddings reach anything that caches them; one made with the same, or that does not
say, is taken."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from deployments.decoder import Decoder
from mmserve.errors import OverloadedError
from mmserve.messages import EncoderOutput, PreprocessedRequest, SamplingParams

OURS = "w1:" + "a" * 32


def encode_with(theirs: str) -> Any:
    """`_encode` of a replica (only what it reads of one) whose Encoder answers with embeddings of `theirs`."""
    async def answer(request_id: str, features: list[Any]) -> EncoderOutput:
        return EncoderOutput(request_id, [np.ones((2, 4), np.float32)], vision_weights=theirs)

    encoder = SimpleNamespace(encode=SimpleNamespace(remote=answer))
    replica = SimpleNamespace(encoder=encoder, replica_loss_retries=0, vision_weights=OURS)
    request = PreprocessedRequest("r", [1, 2], [], SamplingParams())
    encode = Decoder.func_or_class._encode  # type: ignore[attr-defined]  # the class Serve's decorator wraps
    return asyncio.run(encode(replica, request))


def test_embeddings_made_with_the_same_weights_or_unsaid_are_taken_and_others_refused() -> None:
    for theirs in (OURS, ""):  # "": an Encoder of a version that does not say
        out = encode_with(theirs)
        assert isinstance(out.embeddings[0], torch.Tensor) and out.embeddings[0].shape == (2, 4)
    with pytest.raises(OverloadedError, match="other vision weights"):
        encode_with("w1:" + "b" * 32)
