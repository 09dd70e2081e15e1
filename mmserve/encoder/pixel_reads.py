"""Reading the pixels of an encoder step's misses.

Owns: reading each missed item through its request's resolver (`Resolver`: `ray.get` in the Ray app, the
item itself in process), else through another waiting request's reference to the same item, and saying which
items could not be read, with why; where the resolver can (`Prefetcher`), the step's items are brought at
once, under one deadline, before any is read. Does not own: the encoder cache's books, the vision forward, nor what a
failure does to the requests (stage.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Protocol

from mmserve.encoder.outputs import Prefetcher, Resolver
from mmserve.messages import MultiModalFeatureSpec, ProcessedItem


class Reader(Protocol):
    """A request waiting in the encoder stage, as far as reading its items goes."""

    @property
    def request_id(self) -> str: ...

    @property
    def features(self) -> list[MultiModalFeatureSpec]: ...

    @property
    def resolve(self) -> Resolver: ...


Read = tuple[list[tuple[MultiModalFeatureSpec, ProcessedItem]], list[tuple[MultiModalFeatureSpec, BaseException]]]


def read_misses(misses: Sequence[tuple[Reader, MultiModalFeatureSpec]], waiting: Iterable[Reader]) -> Read:
    """(the misses read, in order; those that could not be, each with the first error met)."""
    read: list[tuple[MultiModalFeatureSpec, ProcessedItem]] = []
    failed: list[tuple[MultiModalFeatureSpec, BaseException]] = []
    others = list(waiting)
    late = _prefetch(misses)
    for k, (req, spec) in enumerate(misses):
        if k in late:
            failed.append((spec, TimeoutError(f"the pixels of item {spec.identifier} did not arrive in time")))
            continue
        try:
            read.append((spec, _read_any(req, spec, others)))
        except Exception as exc:  # e.g. its pixels' owner died and the store has no copy
            failed.append((spec, exc))
    return read, failed


def _prefetch(misses: Sequence[tuple[Reader, MultiModalFeatureSpec]]) -> set[int]:
    """The misses (by index) whose pixels did not arrive in time, after each prefetching resolver has brought
    its items' pixels together.

    NOTE: read one after another, N items on a stuck or far object store would hold the step N times a
    read's timeout, and their transfers would not overlap.
    """
    by_resolver: dict[int, tuple[Prefetcher, list[int]]] = {}
    for k, (req, spec) in enumerate(misses):
        if isinstance(req.resolve, Prefetcher) and spec.data is not None:
            by_resolver.setdefault(id(req.resolve), (req.resolve, []))[1].append(k)
    late: set[int] = set()
    for resolver, indices in by_resolver.values():
        arrived = resolver.prefetch([misses[k][1] for k in indices])
        late.update(k for k, ok in zip(indices, arrived, strict=True) if not ok)
    return late


def _read_any(req: Reader, spec: MultiModalFeatureSpec, waiting: list[Reader]) -> ProcessedItem:
    """The item's pixels through `req`'s spec, else through another waiting request's spec of the same item.

    NOTE: requests that share an item (the same content hash) may carry pixels of different makers, and the
    stage books the item for the first of them only: when that one's maker is gone, another's pixels still
    serve, and no request fails for another's lost pixels. The first error is raised if none serves.
    """
    try:
        return _read(req, spec)
    except Exception as first:
        for other in waiting:
            for alt in other.features:
                if other is not req and alt.identifier == spec.identifier and alt.data is not None \
                        and not _same(alt.data, spec.data):
                    with contextlib.suppress(Exception):
                        return _read(other, alt)
        raise first


def _read(req: Reader, spec: MultiModalFeatureSpec) -> ProcessedItem:
    if spec.data is None:
        raise RuntimeError(
            f"request {req.request_id}: item {spec.identifier} missed the encoder cache but carries no data"
        )
    return req.resolve(spec)


def _same(a: object, b: object) -> bool:
    """Whether two items' data are the same reference to pixels (the same object, or equal refs)."""
    try:
        return a is b or bool(a == b)
    except Exception:  # NOTE: a dataclass of numpy arrays has no single truth value; inline pixels differ
        return False
