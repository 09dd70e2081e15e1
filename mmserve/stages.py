"""Builds each stage from one `EngineConfig`: the single wiring of the pipeline.

Owns: what each stage is made of (the model family's parts, the device and dtype, the by-device
defaults) and how the config reaches them. The in-process `Engine` and every Ray deployment build
their stage here, so the two can never be wired differently. Does not own any stage's logic, how
stages talk (direct calls or Ray handles), nor the processor cache's storage (the caller's choice).
"""

from __future__ import annotations

from typing import Any

import torch

from mmserve.config import EngineConfig
from mmserve.decoder.decoder import Decoder, LogitsObserver
from mmserve.decoder.prefix_cache import BlockHasher
from mmserve.decoder.service import DecoderService
from mmserve.decoder.stream_pacing import StreamPacing
from mmserve.encoder.outputs import Resolver, inline_pixels
from mmserve.encoder.runner import batch_wait_s
from mmserve.encoder.service import EncoderService
from mmserve.encoder.stage import EncoderStage
from mmserve.models.base import ModelFamily, ModelSpec
from mmserve.models.registry import checkpoint_dir, load_family
from mmserve.preprocess.image_slots import ImageSlots
from mmserve.preprocess.preprocessor import Preprocessor
from mmserve.preprocess.processor_cache import ItemCache
from mmserve.runtime.passing_thread import in_passing_thread


class StageFactory:
    """One checkpoint's stages; the weights are read on the first `encoder` / `decoder` call only."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = checkpoint_dir(config.model)
        self.family: ModelFamily = load_family(self.model_dir, config)
        self.device = torch.device(config.device)
        self.dtype: torch.dtype = self.family.dtype

    @property
    def spec(self) -> ModelSpec:
        return self.family.spec

    def preprocessor(self, cache: ItemCache, *, stamp_block_hashes: bool = False,
                     image_slots: ImageSlots | None = None, fetch_slots: ImageSlots | None = None) -> Preprocessor:
        """`stamp_block_hashes`: put the prompt's prefix-cache block hashes in each request, for a router
        that keys on them (the decoder computes its own, so nobody else needs them). `image_slots`, `fetch_slots`:
        the images its callers' threads may work on at once, and the requests that may fetch images at once
        (None: as many as there are threads)."""
        spec = self.spec
        stamp = stamp_block_hashes and self.config.decoder.enable_prefix_caching
        return Preprocessor(self.model_dir, media=self.config.media, cache=cache, rule=self.family.prompt_rule,
                            model_id=spec.model_id, max_model_len=spec.max_model_len, vocab_size=spec.vocab_size,
                            limits=self.config.limits, block_hashes=self._block_hasher().prompt if stamp else None,
                            image_slots=image_slots, fetch_slots=fetch_slots)

    def encoder(self, resolve: Resolver = inline_pixels, alone: bool = False) -> EncoderService:
        """`alone`: no other torch stage runs in this process (a Ray replica), so the vision forwards need not
        leave their OpenMP pool behind (EncoderRunner's `passing_forwards`), and no text model is loaded beside
        the vision weights (read alone)."""
        rows, capacity = self.spec.mm_tokens_per_image, self.config.encoder.cache_capacity_tokens
        if rows and capacity < rows:  # NOTE: at start, not as a 400 for every request with an image
            raise ValueError(f"encoder.cache_capacity_tokens={capacity} is below one image's {rows} embedding rows: "
                             "no image could be encoded")
        stage = in_passing_thread(  # NOTE: loading and timing kernels leave no OpenMP pool behind (passing_thread.py)
            lambda: EncoderStage.build(self.family.load_vision(alone=alone), self.config.encoder, device=self.device,
                                       passing_forwards=not alone))
        if self.device.type == "cuda" and self.spec.image_size:  # NOTE: its kernels loaded now, not on the first image
            stage.runner.warm_up(self.spec.image_size)
        return EncoderService(stage, batch_wait_s=batch_wait_s(self.config.encoder.batch_wait_ms, self.device),
                              resolve=resolve)

    def decoder(self, tokenizer: Any = None, on_logits: LogitsObserver | None = None) -> DecoderService:
        """`tokenizer`: one already loaded (the preprocessor's, in one process), else the checkpoint's."""
        if tokenizer is None:
            from transformers import AutoTokenizer  # NOTE: deferred; importing transformers takes seconds

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        decoder = in_passing_thread(  # NOTE: loading and timing kernels leave no OpenMP pool behind (passing_thread.py)
            lambda: Decoder(self.family.load_text(), self.spec, tokenizer, self.config.decoder, dtype=self.dtype,
                            device=self.device, on_logits=on_logits))
        config = self.config.decoder
        pacing = StreamPacing(config.stream_interval_ms / 1000, config.stream_messages_per_s,
                              config.stream_interval_max_ms / 1000)
        return DecoderService(decoder, pacing=pacing, max_waiting=config.max_waiting_requests,
                              embedding_cache_bytes=config.embedding_cache_bytes,
                              encode_rows=self.config.encoder.cache_capacity_tokens)

    def _block_hasher(self) -> BlockHasher:
        """The prefix cache's hashing, as the decoder builds it (decoder.Decoder)."""
        return BlockHasher(self.spec.model_id, str(self.dtype), self.config.decoder.block_size)

    def release_unused(self) -> None:
        """Drop what loading kept beyond the parts handed out (call once every stage is built)."""
        self.family.release_unused()
