"""Turns one scheduler step into one batched model forward and the logits to sample from.

Owns: assembling the step's flat inputs (token ids, positions, the attention metadata), merging image
embeddings into the token embeddings at their placeholder positions (`masked_scatter_`), and picking
the rows to sample. Everything is built on the host from the sequences' state and moved in a few
copies; nothing here reads a device value back (the one sync of a step is the sampler's tokens).
Does not own: what runs (scheduler), model internals (model module), sampling (sampler).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.decoder.attention import SeqStep, build_metadata
from mmserve.decoder.kept_gather import KeptGathers
from mmserve.decoder.kv_blocks import LayerKind
from mmserve.decoder.kv_cache import KVCache
from mmserve.decoder.sequence import Sequence
from mmserve.models.base import ModelSpec, TextDecoder
from mmserve.runtime.host_copy import ints_to_device, to_device
from mmserve.runtime.step_threads import StepThreads
from mmserve.runtime.weight_layout import WeightLayout


@dataclass(frozen=True)
class StepLogits:
    seqs: list[Sequence]  # sequences whose step reached their last token: they get a new token
    logits: torch.Tensor  # (len(seqs), vocab) float32


def step_size(scheduled: list[tuple[Sequence, int]]) -> tuple[int, int]:
    """(new tokens, context rows attended: the sequences' lengths after the step, summed) of a step."""
    return sum(n for _, n in scheduled), sum(seq.num_computed_tokens + n for seq, n in scheduled)


class ModelRunner:
    def __init__(self, model: TextDecoder, spec: ModelSpec, kv: KVCache, kinds: tuple[LayerKind, ...], *,
                 device: torch.device, threads: StepThreads, kept: KeptGathers | None = None):
        self.model, self.spec, self.kv, self.kinds = model, spec, kv, kinds
        self.device = device
        self.threads = threads
        self.kept = kept  # the decode group's gathers kept from step to step; None = gathered whole each step
        self.layout: WeightLayout | None = None  # the weights' layout chosen again while serving (the decoder
        # re-lays them between steps); None = as at start-up

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> StepLogits:
        """Run the step where each (seq, n) computes tokens [seq.num_computed_tokens, +n)."""
        num_new, attended = step_size(scheduled)
        count = self.threads.apply(num_new, attended)
        self.model.matmul.use(count)
        started = time.perf_counter()
        try:
            out = self._forward(scheduled)
        except BaseException:
            if self.kept is not None:
                self.kept.forget()  # NOTE: some layers' refreshes may not have run
            raise
        self.threads.observe(num_new, time.perf_counter() - started, count, attended)
        if self.layout is not None:
            self.layout.observe(num_new, count)
        return out

    def _forward(self, scheduled: list[tuple[Sequence, int]]) -> StepLogits:
        steps = [SeqStep(seq.num_computed_tokens, n, seq.blocks.tables,
                         seq.images.runs if seq.images is not None else None) for seq, n in scheduled]
        ids = np.concatenate([seq.token_ids[s.start : s.start + s.num_new] for seq, s in
                              zip((seq for seq, _ in scheduled), steps, strict=True)])
        positions = np.concatenate([np.arange(s.start, s.start + s.num_new) for s in steps])
        ends = np.cumsum([s.num_new for s in steps]) - 1
        sample = [(seq, int(end)) for (seq, n), end in zip(scheduled, ends, strict=True)
                  if seq.num_computed_tokens + n == seq.num_tokens]
        # NOTE: every host-to-device copy of the step goes before the forward is queued
        picked = ints_to_device([e for _, e in sample], self.device) if len(sample) < len(ids) else None
        embeds = self.model.embed(to_device(ids, self.device))  # (T, hidden)
        self._merge_images(embeds, scheduled, steps)
        meta = build_metadata(steps, self.kinds, self.kv.block_size, self.spec.attention, self.device,
                              self.kv.keys.dtype, self.kept)
        hidden = self.model.forward(embeds, to_device(positions, self.device), meta, self.kv)  # (T, hidden)
        if not sample:
            return StepLogits([], hidden.new_zeros((0, self.spec.vocab_size)))
        rows = hidden if picked is None else hidden.index_select(0, picked)
        return StepLogits([seq for seq, _ in sample], self.model.logits(rows))

    def _merge_images(self, embeds: torch.Tensor, scheduled: list[tuple[Sequence, int]],
                      steps: list[SeqStep]) -> None:
        """Put the embedding rows of this step's image positions into `embeds` (host-known positions)."""
        mask = np.zeros(embeds.shape[0], dtype=bool)  # (T,)
        rows: list[torch.Tensor] = []
        offset = 0
        for (seq, _), s in zip(scheduled, steps, strict=True):
            images = seq.images
            stop = min(s.start + s.num_new, seq.num_prompt_tokens)
            if images is not None and stop > s.start:
                feature, row = images.feature[s.start : stop], images.row[s.start : stop]
                at = np.flatnonzero(feature >= 0)  # image positions of this chunk, in order
                mask[offset + at] = True
                for f in np.unique(feature[at]):  # NOTE: sorted = prompt order; an item's rows are contiguous
                    mine = row[feature == f]
                    rows.append(torch.as_tensor(seq.embeddings[f])[int(mine[0]) : int(mine[-1]) + 1])
            offset += s.num_new
        if rows:
            gathered = to_device(torch.cat(rows), self.device).to(embeds.dtype)  # (n_image_tokens, hidden)
            if gathered.shape[0] != int(mask.sum()):
                raise RuntimeError(f"{int(mask.sum())} image positions in the step, {gathered.shape[0]} rows")
            embeds.masked_scatter_(to_device(mask, self.device)[:, None], gathered)
