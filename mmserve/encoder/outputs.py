"""What the encoder stage hands out and reports: a request's embeddings, the stage's stats, a step's failure,
and how an item's pixels are found (`Resolver`).

Owns these types only. Does not own the stage that makes them (stage.py) nor how they travel between
deployments (messages.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from mmserve.messages import MultiModalFeatureSpec, PhaseTimes, ProcessedItem

Resolver = Callable[[MultiModalFeatureSpec], ProcessedItem]  # an item's pixels (ray.get in the Ray app)


@runtime_checkable
class Prefetcher(Protocol):
    """A resolver that can bring several items' pixels at once (the Ray app's: their transfers run together,
    under one deadline), before it is called for each."""

    def prefetch(self, specs: Sequence[MultiModalFeatureSpec]) -> list[bool]:
        """Whether each item's pixels arrived in time (a False one is not read: it fails its requests)."""
        ...


def inline_pixels(spec: MultiModalFeatureSpec) -> ProcessedItem:
    """The resolver of the in-process engine: the spec carries the item itself."""
    return spec.data


@dataclass(frozen=True)
class EncodedRequest:
    request_id: str
    embeddings: list[torch.Tensor]  # per feature, in feature order: (num_embeds, hidden)
    timings: PhaseTimes = ()  # the stage's own time on it (phase, ms): the steps that encoded its items, its stay

    @property
    def finished(self) -> bool:
        """Always True: this is the only output a request gets from the encoder stage."""
        return True


@dataclass(frozen=True)
class EncoderStats:
    queries: int  # item lookups decided (hits + encoded misses)
    hits: int  # lookups served by the encoder cache
    forward_passes: int  # vision forwards run
    items_encoded: int  # items (images) encoded
    images_encoded: int  # crops encoded
    cached_tokens: int  # embedding rows booked in the cache, referenced or not
    peak_cached_tokens: int  # the most rows ever booked at once
    capacity_tokens: int  # embedding rows the cache may hold
    num_cached: int  # entries in the cache
    num_pending: int  # requests still waiting for embeddings
    batch_sizes: dict[int, int] = field(default_factory=dict)  # crops per forward -> forwards
    early_found: int = 0  # lookups that found their item encoded early for them (misses run ahead)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class EncoderStepError(RuntimeError):
    """An encoder step failed (resolve or vision forward) for some requests, which the stage dropped; each
    request's own cause (`causes`: its item's error) tells a caller whether to retry it elsewhere (its pixels
    lost with their maker) or to report it.

    NOTE: it crosses Ray in a replica's error, so it pickles with its causes (an exception whose `__init__`
    takes other arguments than its message does not, and reached the caller as Ray's UnserializableException).
    """

    def __init__(self, causes: dict[str, BaseException]) -> None:
        first = next(iter(causes.values()), None)
        super().__init__(f"encoder step failed for requests {list(causes)}: {first!r}")
        self.causes = causes  # request id -> the error of the item that failed it, in arrival order
        # what the same step finished for other requests (the step loop hands them out; not pickled)
        self.outputs: list[EncodedRequest] = []

    @property
    def request_ids(self) -> list[str]:
        """The requests dropped (the step loop fails these only)."""
        return list(self.causes)

    def cause_of(self, request_id: str) -> BaseException | None:
        return self.causes.get(request_id)

    def __reduce__(self) -> tuple[type[EncoderStepError], tuple[dict[str, BaseException]]]:
        return (type(self), (self.causes,))
