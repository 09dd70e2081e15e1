"""Where a decoder request's image embeddings come from: the decoder service's cache of recent ones, else the
encoder, in calls that each fit the encoder cache.

Owns: looking items up in the service's EmbeddingCache, asking the encoder for the rest (one call, or several
one after another where their rows pass the encoder cache's capacity: a call's items are held there together
until handed back), keeping what came in the cache, timing each call, and telling the steps' thread policy
that an encode runs on this host. Does not own: which items a request needs (service.py), the encoder itself.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from mmserve.decoder.embedding_cache import EmbeddingCache
from mmserve.messages import EncoderOutput, MultiModalFeatureSpec, PreprocessedRequest
from mmserve.runtime.shared_cores import SharedCores
from mmserve.runtime.timeline import Timeline

EncodeFn = Callable[[PreprocessedRequest], Awaitable[EncoderOutput]]  # -> per-feature embeddings, the encoder's phases


class EmbeddingSource:
    def __init__(self, cache: EmbeddingCache, shared_cores: SharedCores, encode_rows: int | None = None) -> None:
        self.cache, self.shared_cores = cache, shared_cores
        self.encode_rows = encode_rows  # the most embedding rows one encoder call asks for; None: one call

    async def get(self, pre: PreprocessedRequest, encode: EncodeFn, encoder_id: str, indices: list[int],
                  timeline: Timeline, call: str) -> list[Any]:
        """Embeddings of `pre`'s features at `indices` (None elsewhere): the cache's, then the encoder's under
        `encoder_id` (and `<encoder_id>/part-<k>` for later calls), which the cache then keeps; each encoder
        call timed on `timeline` as `call`."""
        features = pre.features
        embeddings: list[Any] = [None] * len(features)
        for i in indices:
            embeddings[i] = self.cache.get(features[i].identifier)
        missing = [i for i in indices if embeddings[i] is None]
        for k, part in enumerate(parts(missing, features, self.encode_rows)):
            sub = replace(pre, request_id=encoder_id if not k else f"{encoder_id}/part-{k}",
                          features=[features[i] for i in part])
            started = time.perf_counter()
            with self.shared_cores.waiting():
                out = await encode(sub)
            self.shared_cores.answered(out.host)
            # NOTE: the call's round trip and, inside it, the encoder's own phases (the rest is the hop)
            timeline.add(((call, (time.perf_counter() - started) * 1e3), *out.timings))
            for i, emb in zip(part, out.embeddings, strict=True):
                embeddings[i] = emb
                self.cache.put(features[i].identifier, emb)
        return embeddings


def parts(indices: list[int], features: list[MultiModalFeatureSpec], rows: int | None) -> list[list[int]]:
    """`indices` in order, cut into runs whose features' embedding rows add up to at most `rows` (an item with
    more goes alone: the encoder names it in its refusal); one run when `rows` is None; none when empty."""
    runs: list[list[int]] = []
    total = 0
    for i in indices:
        n = features[i].num_embeds
        if not runs or (rows is not None and total + n > rows):
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += n
    return runs
