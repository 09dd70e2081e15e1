"""Reading the pixels of an encoder step's misses.

Owns: reading each missed item through its request's resolver (`Resolver`: `ray.get` in the Ray app, the
item itself in process), else through another waiting request's reference to the same item, and saying which
items could not be read, with why; where the resolver can (`Prefetcher`), the misses' own copies are brought
at once, under one deadline, before any is read (and other requests' copies of those late or unreadable, under
a second).
Does not own: the encoder cache's books, the vision forward, nor what a failure does to the requests
(stage.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

from mmserve.encoder.outputs import Prefetcher, Resolver
from mmserve.messages import MultiModalFeatureSpec, ProcessedItem

log = logging.getLogger(__name__)


class Reader(Protocol):
    """A request waiting in the encoder stage, as far as reading its items goes."""

    @property
    def request_id(self) -> str: ...

    @property
    def features(self) -> list[MultiModalFeatureSpec]: ...

    @property
    def resolve(self) -> Resolver: ...


Copy = tuple[Reader, MultiModalFeatureSpec]  # a waiting request and its spec of an item (the pixels it carries)
Read = tuple[list[tuple[MultiModalFeatureSpec, ProcessedItem]], list[tuple[MultiModalFeatureSpec, BaseException]]]


def read_misses(misses: Sequence[tuple[Reader, MultiModalFeatureSpec]], waiting: Iterable[Reader]) -> Read:
    """(the misses read, in order; those that could not be, each with the first error met).

    NOTE: each miss's own copy is brought first, all of them together, then read; other waiting requests' copies of
    an item only for the misses whose own copy did not arrive or could not be read, all of those together (a second
    wait): a far copy that no miss needs never holds the step, and stuck copies are never waited for one by one.
    """
    others = list(waiting)
    own = _prefetch([[copy] for copy in misses])
    late = {k for k, [here] in enumerate(own) if not here}
    got: dict[int, ProcessedItem] = {}
    errors: dict[int, BaseException] = {}
    for k, (req, spec) in enumerate(misses):
        if k not in late:
            try:
                got[k] = _read(req, spec)
            except Exception as exc:  # e.g. its pixels' owner died: another request's copy may serve
                errors[k] = exc
    again = [k for k in range(len(misses)) if k not in got]
    alternates = {k: _alternates(*misses[k], others) for k in again}
    arrived = dict(zip(again, _prefetch([alternates[k] for k in again]), strict=True))
    read: list[tuple[MultiModalFeatureSpec, ProcessedItem]] = []
    failed: list[tuple[MultiModalFeatureSpec, BaseException]] = []
    for k, (_, spec) in enumerate(misses):
        if k in got:
            read.append((spec, got[k]))
            continue
        try:
            read.append((spec, _read_first([c for c, here in zip(alternates[k], arrived[k], strict=True) if here])))
        except Exception:  # NOTE: the own copy's lateness or error is the reason, whatever the others did
            failed.append((spec, errors.get(k) or TimeoutError(
                f"the pixels of item {spec.identifier} did not arrive in time")))
    return read, failed


def _alternates(req: Reader, spec: MultiModalFeatureSpec, waiting: list[Reader]) -> list[Copy]:
    """Other waiting requests' specs of the same item that carry other pixels than `spec`'s, each pixels once.

    NOTE: requests that share an item (the same content hash) may carry pixels of different makers, and the
    stage books the item for the one whose turn comes first only: when that one's maker is gone (or its copy is late),
    another's pixels still serve, and no request fails for another's lost pixels.
    """
    found: list[Copy] = []
    for other in waiting:
        for alt in other.features if other is not req else ():
            if alt.identifier == spec.identifier and alt.data is not None \
                    and not any(_same(alt.data, seen.data) for seen in (spec, *(s for _, s in found))):
                found.append((other, alt))
    return found


def _prefetch(candidates: list[list[Copy]]) -> list[list[bool]]:
    """Whether each candidate copy of each miss is here, once each prefetching resolver (`Prefetcher`) has
    brought the copies it reads together; a copy that no resolver prefetches counts as here.

    NOTE: read one after another, N items on a stuck or far object store would hold the step N times a
    read's timeout, and their transfers would not overlap.
    """
    here = [[True] * len(copies) for copies in candidates]
    by_resolver: dict[int, tuple[Prefetcher, list[tuple[int, int]]]] = {}
    for k, copies in enumerate(candidates):
        for j, (req, spec) in enumerate(copies):
            if isinstance(req.resolve, Prefetcher) and spec.data is not None:
                by_resolver.setdefault(id(req.resolve), (req.resolve, []))[1].append((k, j))
    for resolver, where in by_resolver.values():
        try:
            arrived = resolver.prefetch([candidates[k][j][1] for k, j in where])
        except Exception:  # NOTE: then each copy is read as it is, under its own timeout
            log.warning("prefetching a step's pixels failed; reading them one by one", exc_info=True)
            continue
        for (k, j), ok in zip(where, arrived, strict=True):
            here[k][j] = ok
    return here


def _read_first(copies: list[Copy]) -> ProcessedItem:
    """The pixels of the first copy that reads; the first copy's error if none does (LookupError: no copy)."""
    first: Exception | None = None
    for req, spec in copies:
        try:
            return _read(req, spec)
        except Exception as exc:
            first = first or exc
    raise first or LookupError("no copy of the item to read")


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
