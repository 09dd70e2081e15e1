"""The engine's accelerator path, checked on a CPU. Its device code runs on PyTorch's `meta` device: a tensor made
on the host and mixed into a step's device work raises there as it would on CUDA ("Expected all tensors to be on
the same device"), so these CPU-only tests catch what would break the first accelerator run. Meta tensors hold no
data: nothing is read back, so the steps stop at the logits (sampling reads tokens back) and the vision tower's
output. The warm-ups that run at start on CUDA run here on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.decoder.decoder import Decoder
from mmserve.decoder.sampler import RowMasks, Sampler, make_generator
from mmserve.decoder.thread_calibration import warm_up
from mmserve.decoder.token_history import TokenHistory
from mmserve.encoder.runner import EncoderRunner
from mmserve.errors import InvalidRequestError
from mmserve.messages import DecodeRequest, MultiModalFeatureSpec, PlaceholderRange, ProcessedItem, SamplingParams
from mmserve.stages import StageFactory

META = torch.device("meta")


@pytest.fixture(scope="module")
def meta_stages(tiny_ckpt_224: Path) -> tuple[Decoder, EncoderRunner]:
    """The Decoder and the vision encoder's runner, built on the meta device as the engine builds them."""
    stages = StageFactory(EngineConfig(model=str(tiny_ckpt_224), device="meta"))
    return stages.decoder().decoder, stages.encoder().stage.runner


def test_decoder_steps_prefill_image_chunks_and_decodes_on_the_device(meta_stages: tuple[Decoder, EncoderRunner]
                                                                       ) -> None:
    decoder, _ = meta_stages
    spec = decoder.spec
    assert decoder.kv.keys.device == META and decoder.runner.layout is None  # the CPU's calibrations skipped
    rows = 16  # the 224-px checkpoint's image rows
    prompt = [2, 5, 6, *[spec.image_token_id] * rows, 7, 8, *range(9, 60)]
    image = MultiModalFeatureSpec("img", "image", PlaceholderRange(3, rows), rows)
    embeddings = np.zeros((rows, spec.hidden_size), dtype=np.float32)  # as they arrive from the object store
    decoder.add(DecodeRequest("with-image", prompt, [image], [embeddings], SamplingParams(max_tokens=4)))
    decoder.add(DecodeRequest("text", list(range(2, 40)), [], [], SamplingParams(max_tokens=4)))
    decoder.add(DecodeRequest("short", [2, 3, 4], [], [], SamplingParams(max_tokens=4)))
    shapes = []
    for _ in range(4):  # prefill chunks (an image's bidirectional mask among them), then decodes together
        plan = decoder.scheduler.schedule()
        scheduled = [(s.seq, s.num_new_tokens) for s in plan.scheduled]
        out = decoder.runner.execute(scheduled)
        assert out.logits.device == META and out.logits.shape == (len(out.seqs), spec.vocab_size)
        shapes.append(tuple(n for _, n in scheduled))
        decoder.scheduler.update(plan, {seq.request_id: 7 for seq in out.seqs})
    assert shapes[0][0] == len(prompt) and shapes[-1] == (1, 1, 1), shapes


def test_a_sliding_layer_far_into_a_sequence_on_the_device(meta_stages: tuple[Decoder, EncoderRunner]) -> None:
    decoder, _ = meta_stages
    window = decoder.spec.attention.sliding_window
    assert window is not None
    decoder.add(DecodeRequest("long", list(range(2, 2 + 2 * window + 3)), [], [], SamplingParams(max_tokens=8)))
    for _ in range(6):
        plan = decoder.scheduler.schedule()
        out = decoder.runner.execute([(s.seq, s.num_new_tokens) for s in plan.scheduled])
        assert out.logits.device == META
        decoder.scheduler.update(plan, {seq.request_id: 7 for seq in out.seqs})


def test_the_vision_tower_runs_on_the_device(meta_stages: tuple[Decoder, EncoderRunner]) -> None:
    decoder, runner = meta_stages
    pixels = np.zeros((2, 3, 224, 224), dtype=np.uint8)  # an image and one crop, resized, as Preprocess hands them on
    (out,) = runner.embed_multimodal([ProcessedItem(pixels)])
    assert out.device == META and out.shape == (2 * 16, decoder.spec.hidden_size)


def test_a_prompt_id_past_the_vocabulary_is_refused_before_any_step(meta_stages: tuple[Decoder, EncoderRunner]) -> None:
    # NOTE: on an accelerator such an id in a step would be a device-side assert that ends the CUDA context
    decoder, _ = meta_stages
    vocab = decoder.spec.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(InvalidRequestError, match=f"prompt token id {bad} is not in the model's vocabulary"):
            decoder.add(DecodeRequest(f"bad{bad}", [2, 3, bad, 4], [], [], SamplingParams(max_tokens=2)))
    assert not {f"bad{vocab}", "bad-1"} & set(decoder.request_ids())


def test_the_sampler_with_penalties_masks_and_draws_stays_on_the_device() -> None:
    """Off the CPU the sampler reads nothing back, so it runs on meta logits whole (test_sampler.py holds its
    results equal to the CPU's)."""
    vocab, n = 50, 4
    logits = torch.empty(n, vocab, device=META)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias=((3, 1.0),)),
              SamplingParams(temperature=0.8, top_p=0.9, seed=1, frequency_penalty=0.5, min_tokens=5),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5, presence_penalty=1.0)]
    masks = RowMasks((0, 2), torch.zeros(2, vocab, dtype=torch.bool, device=META))
    tokens = Sampler((7,), eos_token_ids=(1,)).sample(
        logits, params, [make_generator(p.seed) for p in params], [TokenHistory.of([2, 3], [4, 4, 9])] * n, masks)
    assert tokens.device == META and tokens.shape == (n,) and tokens.dtype == torch.int64


def test_the_accelerators_warm_up_leaves_the_decoder_as_it_found_it(tiny_ckpt_224: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`warm_up` (run at start on CUDA) on a CPU Decoder: it runs and samples a prefill and a decode, and leaves
    no request, no page held and nothing in the prefix cache."""
    decoder = StageFactory(EngineConfig(model=str(tiny_ckpt_224))).decoder().decoder
    sampled: list[list[int]] = []
    real = decoder.sampler.sample

    def counted(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        sampled.append(list(logits.shape))
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(decoder.sampler, "sample", counted)
    before = decoder.stats()
    warm_up(decoder.runner, decoder.scheduler, decoder.spec.eos_token_ids[0], decoder.sampler)
    after = decoder.stats()
    assert sampled == [[2, decoder.spec.vocab_size]] * 2  # a prefill chunk's logits, then a decode's
    assert after.free_blocks == after.total_blocks == before.total_blocks and after.cached_blocks == 0
    assert not decoder.request_ids() and not decoder.has_unfinished()


def test_the_encoders_warm_up_runs_one_uncounted_forward_at_the_towers_size(tiny_ckpt_224: Path) -> None:
    """`EncoderRunner.warm_up` (run at start on CUDA, at the spec's crop size) on the CPU: not in the counts."""
    stages = StageFactory(EngineConfig(model=str(tiny_ckpt_224)))
    runner = stages.encoder().stage.runner
    assert stages.spec.image_size == 224
    real, shapes = runner.encode_images, list[tuple[int, ...]]()

    def watched(pixels: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(pixels.shape))
        return real(pixels)

    runner.encode_images = watched
    runner.warm_up(stages.spec.image_size)
    assert shapes == [(1, 3, 224, 224)]  # one forward, at the tower's crop size
    assert runner.forward_passes == runner.images_encoded == 0
