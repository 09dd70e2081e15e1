"""Turns one scheduler step into one batched model forward and the logits to sample from.

Owns: assembling the step's flat inputs (token ids, positions, KV slots, image runs), merging image
embeddings into the token embeddings at the placeholder positions (`masked_scatter_`), and
picking the rows to sample. Does not own: what runs (scheduler), model internals (model module),
sampling (sampler).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmserve.decoder.attention import SeqChunk, build_metadata
from mmserve.decoder.kv_cache import KVCache
from mmserve.decoder.sequence import Sequence
from mmserve.models.base import ModelSpec, TextDecoder
from mmserve.preprocess.image_runs import image_run_ids
from mmserve.runtime.step_threads import StepThreads


@dataclass(frozen=True)
class StepLogits:
    seqs: list[Sequence]  # sequences whose step reached their last token: they get a new token
    logits: torch.Tensor  # (len(seqs), vocab) float32


class ModelRunner:
    def __init__(self, model: TextDecoder, spec: ModelSpec, kv: KVCache, *, dtype: torch.dtype, device: torch.device,
                 threads: StepThreads):
        self.model, self.spec, self.kv = model, spec, kv
        self.dtype, self.device = dtype, device
        self.threads = threads

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> StepLogits:
        """Run the step where each (seq, n) computes tokens [seq.num_computed_tokens, +n)."""
        self.threads.apply(sum(n for _, n in scheduled))
        chunks, ids, images = [], [], []
        for seq, n in scheduled:
            chunk, chunk_ids, rows = self._prepare(seq, n)
            chunks.append(chunk)
            ids.append(chunk_ids)
            images.extend(rows)
        input_ids = torch.from_numpy(np.concatenate(ids)).to(self.device)  # (T,)
        positions = torch.from_numpy(
            np.concatenate([np.arange(c.start, c.start + c.num_new) for c in chunks])
        ).to(self.device)  # (T,)
        embeds = self.model.embed(input_ids)  # (T, hidden)
        if images:
            self._merge_images(embeds, input_ids, images)
        meta = build_metadata(chunks, self.spec.attention, self.device)
        hidden = self.model.forward(embeds, positions, meta, self.kv)  # (T, hidden)
        ends = np.cumsum([n for _, n in scheduled]) - 1
        sample = [(seq, end) for (seq, n), end in zip(scheduled, ends, strict=True)
                  if seq.num_computed_tokens + n == seq.num_tokens]
        picked = torch.tensor([end for _, end in sample], dtype=torch.long, device=self.device)
        logits = self.model.logits(hidden[picked]) if sample else hidden.new_zeros((0, self.spec.vocab_size))
        return StepLogits(seqs=[seq for seq, _ in sample], logits=logits)

    def _prepare(self, seq: Sequence, n: int) -> tuple[SeqChunk, np.ndarray, list[torch.Tensor]]:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        chunk_ids = np.asarray(seq.token_ids[start:end], dtype=np.int64)
        has_image = bool((chunk_ids == self.spec.image_token_id).any())
        context = np.asarray(seq.token_ids[:end], dtype=np.int64) if has_image else None
        chunk = SeqChunk(
            start=start,
            num_new=n,
            slots=self._slots(seq.block_table, end),
            image_groups=image_run_ids(context, self.spec.image_token_id) if context is not None else None,
        )
        rows = self._image_rows(seq, context, start, end) if context is not None else []
        return chunk, chunk_ids, rows

    def _slots(self, block_table: list[int], length: int) -> np.ndarray:
        bs = self.kv.block_size
        pos = np.arange(length)
        return np.asarray(block_table, dtype=np.int64)[pos // bs] * bs + pos % bs  # (length,)

    def _image_rows(self, seq: Sequence, context: np.ndarray, start: int, end: int) -> list[torch.Tensor]:
        """Embedding rows of every image token in [start, end), in prompt order."""
        is_image = context == self.spec.image_token_id
        rows = []
        for feature, emb in zip(seq.features, seq.embeddings, strict=True):
            lo, hi = feature.placeholder.offset, feature.placeholder.offset + feature.placeholder.length
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            first = int(is_image[lo:a].sum())  # rows of this item already consumed by earlier chunks
            count = int(is_image[a:b].sum())
            rows.append(torch.as_tensor(emb)[first : first + count])  # (count, hidden)
        return rows

    def _merge_images(self, embeds: torch.Tensor, input_ids: torch.Tensor, rows: list[torch.Tensor]) -> None:
        mask = input_ids == self.spec.image_token_id  # (T,)
        gathered = torch.cat(rows).to(device=self.device, dtype=embeds.dtype)  # (n_image_tokens, hidden)
        if gathered.shape[0] != int(mask.sum()):
            raise RuntimeError(f"{int(mask.sum())} image tokens in the step but {gathered.shape[0]} embedding rows")
        embeds.masked_scatter_(mask[:, None], gathered)
