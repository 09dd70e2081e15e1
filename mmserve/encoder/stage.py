"""The encoder stage: a queue of requests whose images need embeddings, served one step at a time.

Owns: the queue of pending requests (arrival order), one encoder step (its booking, in turns across the
requests under the per-step compute budget, the cache capacity and one forward's crops: booking.py; ONE
`embed_multimodal` for its misses), the tensor
cache kept in line with the manager's books, and the stage's stats. Does not own: the vision model
(`EncoderRunner` wraps it), nor how requests arrive or leave (the engine, or a Ray deployment, calls
`add_request` / `step` / `abort`).

A request holds references to its entries from their booking until its embeddings are handed out by
`step` (or it is aborted): what it found cached cannot be evicted while its other items wait for their
turn. Handed out, the embeddings are the caller's (the cache's tensors are never written again; an
evicted entry only drops the cache's own reference), so nothing downstream holds anything here and no
death or cancel elsewhere can leak an entry.

Single-threaded by design: the caller serializes calls (one engine loop or one replica's loop); only `cached`
may be called beside them, from any thread.
"""

from __future__ import annotations

import time

import torch

from mmserve.config import EncoderConfig
from mmserve.encoder.booking import Miss, Pending, StepBooking
from mmserve.encoder.cache import EncoderCache
from mmserve.encoder.cache_manager import EncoderCacheManager
from mmserve.encoder.lookups import Lookups
from mmserve.encoder.outputs import EncodedRequest, EncoderStats, EncoderStepError, Resolver, inline_pixels
from mmserve.encoder.pixel_reads import read_misses
from mmserve.encoder.runner import EncoderRunner
from mmserve.messages import MultiModalFeatureSpec, PhaseTimes, ProcessedItem
from mmserve.models.base import VisionEncoder
from mmserve.runtime.device_errors import DeviceFault, device_fatal


class EncoderStage:
    def __init__(self, runner: EncoderRunner, config: EncoderConfig | None = None) -> None:
        self.config = config or EncoderConfig()
        self.runner = runner
        self.manager = EncoderCacheManager(self.config.cache_capacity_tokens, self.config.compute_budget_tokens)
        self.cache = EncoderCache()
        self._pending: dict[str, Pending] = {}  # FIFO: insertion order is arrival order
        self._live: set[str] = set()  # pending: added and not yet handed out or aborted
        self._turns: dict[str, None] = {}  # pending request ids in turn order (booking.py): a new one at the back
        self.lookups = Lookups()
        # the items of the forward that hit an accelerator fault (which ended the step loop), and the fault
        self.fault: tuple[frozenset[str], BaseException] | None = None

    @classmethod
    def build(
        cls,
        encode_images: VisionEncoder,
        config: EncoderConfig | None = None,
        *,
        device: str | torch.device = "cpu",
        passing_forwards: bool = True,  # see EncoderRunner (flag)
    ) -> EncoderStage:
        config = config or EncoderConfig()
        runner = EncoderRunner(encode_images, device=device, max_batch_items=config.max_batch_items,
                               passing_forwards=passing_forwards)
        return cls(runner, config)

    # ---- requests in and out ----

    def add_request(
        self, request_id: str, features: list[MultiModalFeatureSpec], resolve: Resolver = inline_pixels,
        early: bool = False,
    ) -> None:
        """Queue a request; CapacityError if its items can never fit (nothing is queued then).

        `early`: the items are encoded ahead of the request that will ask for them (it is still on its way
        to the decoder). NOTE: the stats count such work when that request finds it, as the miss it was for
        the request: its lookups are not counted, and the request's first hit on an entry it made is not a hit.
        """
        if request_id in self._live:
            raise ValueError(f"request {request_id} is already in the encoder stage")
        sizes: dict[str, int] = {}
        for spec in features:
            if sizes.setdefault(spec.identifier, spec.num_embeds) != spec.num_embeds:
                raise ValueError(f"item {spec.identifier} appears with different num_embeds in one request")
        self.manager.validate_request(sizes)
        self._pending[request_id] = Pending(request_id, list(features), resolve, early)
        self._turns[request_id] = None
        self._live.add(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request before its embeddings come (its caller left): its queue entry and references.
        Idempotent; a no-op once its embeddings were handed out."""
        self._pending.pop(request_id, None)
        self._turns.pop(request_id, None)  # NOTE: the id may come again, then at the back
        self._live.discard(request_id)
        self.manager.free_request(request_id)

    def abort_all(self) -> None:
        """Abort every request (after a failure the caller could not attribute)."""
        for request_id in list(self._live):
            self.abort(request_id)

    def has_pending(self) -> bool:
        return bool(self._pending)

    # ---- requests served from the cache alone ----

    def _faulted(self, resolved: list[tuple[MultiModalFeatureSpec, ProcessedItem]], exc: BaseException) -> DeviceFault:
        """Note the items of a forward that hit a sticky fault -> the fault, for the requests referencing them."""
        items = frozenset(spec.identifier for spec, _ in resolved)
        self.fault = (items, exc)
        return DeviceFault(exc, sorted({rid for h in items for rid in self.manager.referrers(h)}))

    def fault_of(self, features: list[MultiModalFeatureSpec]) -> BaseException | None:
        """The accelerator fault of a forward that held one of `features` (None if none did): a request asking
        for such an item gets that fault, not a lost stage, so that no caller retries it on a live replica."""
        if self.fault is None or not any(f.identifier in self.fault[0] for f in features):
            return None
        return self.fault[1]

    def cached(self, features: list[MultiModalFeatureSpec]) -> list[torch.Tensor] | None:
        """Every item's embeddings when all are cached and none awaits the request an early encode made it for
        (that one's step is timed for it by `step`); else None. Safe from any thread, beside the stepping one: it
        reads the cache (`EncoderCache.get_all`) and the early entries' keys, counts its lookups as hits, and
        leaves its entries to be made the newest of the unreferenced by the next step, before it books anything
        (as a step's hit and hand-out would leave them).

        NOTE: such a request is served at once instead of after the forward under way and the misses queued
        before it (the queue is for what needs a forward). Its cache read comes before the early check: an
        entry is marked early before its tensor is put."""
        found = self.cache.get_all(spec.identifier for spec in features)
        if found is None or not self.lookups.served([spec.identifier for spec in features]):
            return None
        return found

    # ---- one step ----

    def step(self) -> list[EncodedRequest]:
        """Run one encoder step; return the requests whose embeddings are now all available.

        Raises EncoderStepError (after dropping the requests involved in the misses) if resolving
        an item or the vision forward fails, carrying the requests the step finished all the same (`outputs`);
        the other requests stay queued, the books consistent. Any other error forgets the step's new entries
        that got no tensor (the caller then aborts every request: see StepLoop).
        """
        for identifier in self.lookups.take_touched():  # NOTE: before booking: an eviction spares what was served
            self.manager.touch(identifier)
        misses = self._schedule()
        self._drop_freed()
        try:
            if misses:
                self._encode(misses)
        except EncoderStepError as exc:
            # NOTE: requests whose items are all here (hits, or misses that encoded) go on now: a next step
            # could fail the same way (a stuck object store fails each after a read's timeout)
            exc.outputs = self._collect_done()
            raise
        except BaseException:
            self.manager.discard([spec.identifier for _, spec in misses if spec.identifier not in self.cache])
            self._drop_freed()
            raise
        return self._collect_done()

    def _schedule(self) -> list[Miss]:
        """Book the pending requests' items in turns (booking.py) under the step's limits; return the misses.

        NOTE: no more crops than one forward takes (`max_batch_items`; an item with more runs alone), so a
        step ends, and its requests go on to the decoder, after one forward: on a CPU a batch of images costs
        the same per image as one alone, and waiting for the whole batch only delays all."""
        booking = StepBooking(self.manager, self.cache.__contains__, self.config.compute_budget_tokens,
                              self.runner.max_batch_items, self._count)
        # NOTE: turns by request, not by arrival time: a request that arrives later waits behind every request
        # already pending, however the turns stood
        misses = booking.run([self._pending[rid] for rid in self._turns], self._pending.values())
        if misses:  # those up to the last miss's request go behind the rest
            turns = list(self._turns)
            k = turns.index(misses[-1][0].request_id)
            self._turns = dict.fromkeys(turns[k + 1:] + turns[:k + 1])
        return misses

    def _count(self, req: Pending, identifier: str, hit: bool) -> None:
        """The stats of one lookup (see `add_request` on early encodes)."""
        req.timings += self.lookups.looked_up(identifier, hit, req.early)

    def _drop_freed(self) -> None:
        """Drop the tensors of the entries the manager has just freed."""
        freed = self.manager.take_freed()
        self.lookups.forget(freed)
        self.cache.drop(freed)

    def _encode(self, misses: list[Miss]) -> None:
        """Encode the step's misses into the cache; raise EncoderStepError naming only the requests whose
        own item failed (its pixels could not be read, or its forward failed alone).

        NOTE: one bad item must not fail its batch mates: a batch whose forward fails is run again item
        by item, so that only the culprit's requests fail (a GPU batch holds up to 16 crops of as many
        requests). The others' embeddings are cached and handed out by the next step.
        """
        started = time.perf_counter()
        resolved, failures = read_misses(misses, self._pending.values())
        resolved_at = time.perf_counter()
        try:
            encoded = self._forward(resolved)
        except Exception as exc:
            if device_fatal(exc):  # NOTE: every forward after it fails too: the step loop ends, the replica exits
                raise self._faulted(resolved, exc) from exc
            alone: list[tuple[MultiModalFeatureSpec, BaseException]] = [(resolved[0][0], exc)]
            if len(resolved) == 1:  # alone already: it failed by itself
                encoded = []
            else:
                encoded, alone = self._forward_each(resolved)
            failures += alone
        phases = _step_phases(started, resolved_at)
        for req in dict.fromkeys(req for req, _ in misses):  # each request once, in order
            req.timings += phases
        for req, spec in misses:  # NOTE: an early encode's, for the request it ran ahead of unless that found it
            if req.early:
                self.lookups.encoded_early(spec.identifier, phases)
        for spec, emb in encoded:
            self.cache.put(spec.identifier, emb)
        if failures:
            causes = self._roll_back({spec.identifier: exc for spec, exc in failures})
            raise EncoderStepError(causes) from failures[0][1]

    def _forward(self, resolved: list[tuple[MultiModalFeatureSpec, ProcessedItem]]
                 ) -> list[tuple[MultiModalFeatureSpec, torch.Tensor]]:
        """One vision forward over the items; raises if it fails or a result has the wrong row count."""
        if not resolved:
            return []
        embeddings = self.runner.embed_multimodal([item for _, item in resolved])  # each (rows, hidden)
        for (spec, _), emb in zip(resolved, embeddings, strict=True):
            if emb.shape[0] != spec.num_embeds:
                raise RuntimeError(f"item {spec.identifier} encoded to {emb.shape[0]} rows, "
                                   f"spec says {spec.num_embeds}")
        return list(zip((spec for spec, _ in resolved), embeddings, strict=True))

    def _forward_each(self, resolved: list[tuple[MultiModalFeatureSpec, ProcessedItem]]
                      ) -> tuple[list[tuple[MultiModalFeatureSpec, torch.Tensor]],
                                 list[tuple[MultiModalFeatureSpec, BaseException]]]:
        """Each item in a forward of its own: (what encoded, what failed alone)."""
        encoded: list[tuple[MultiModalFeatureSpec, torch.Tensor]] = []
        failures: list[tuple[MultiModalFeatureSpec, BaseException]] = []
        for one in resolved:
            try:
                encoded += self._forward([one])
            except Exception as exc:
                if device_fatal(exc):  # NOTE: maybe the batch's own fault, seen late: all of it is suspect
                    raise self._faulted(resolved, exc) from exc
                failures.append((one[0], exc))
        return encoded, failures

    def _roll_back(self, errors: dict[str, BaseException]) -> dict[str, BaseException]:
        """Forget this step's new entries (content hash -> the error that failed it) and drop every request that
        referenced one -> request id -> the error of its failed item, in arrival order."""
        involved = {rid: exc for h, exc in errors.items() for rid in self.manager.referrers(h)}
        failed = [rid for rid in self._pending if rid in involved]  # arrival order
        failed += sorted(set(involved).difference(failed))  # none expected: all are still queued
        self.manager.discard(list(errors))
        self._drop_freed()
        for request_id in failed:
            self.abort(request_id)
        return {rid: involved[rid] for rid in failed}

    def _collect_done(self) -> list[EncodedRequest]:
        done = [req for req in self._pending.values() if req.done]
        out = []
        for req in done:
            stay = ("encoder.stage", (time.perf_counter() - req.arrived) * 1e3)  # added -> handed out
            out.append(EncodedRequest(req.request_id, [self._tensor(spec) for spec in req.features],
                                      (*req.timings, stay)))
            self.abort(req.request_id)  # handed out: its references end here (the entries stay cached)
        return out

    def _tensor(self, spec: MultiModalFeatureSpec) -> torch.Tensor:
        emb = self.cache.get(spec.identifier)
        if emb is None:  # the books say cached and referenced, so this is a bug, not a miss
            raise RuntimeError(f"encoder cache lost referenced entry {spec.identifier}")
        return emb

    # ---- introspection ----

    def stats(self) -> EncoderStats:
        return EncoderStats(
            queries=self.lookups.total_queries,
            hits=self.lookups.total_hits,
            forward_passes=self.runner.forward_passes,
            items_encoded=self.runner.items_encoded,
            images_encoded=self.runner.images_encoded,
            cached_tokens=self.manager.num_cached_tokens,
            peak_cached_tokens=self.manager.peak_cached_tokens,
            capacity_tokens=self.manager.capacity_tokens,
            num_cached=self.manager.num_cached,
            num_pending=len(self._pending),
            batch_sizes=dict(sorted(self.runner.batch_sizes.items())),
            early_found=self.lookups.early_found,
        )


def _step_phases(started: float, resolved_at: float) -> PhaseTimes:
    """A step's time reading its misses' pixels and in the vision forward, until now (ms): the phases of each
    request that had a miss in it."""
    now = time.perf_counter()
    return (("encoder.pixels", (resolved_at - started) * 1e3), ("encoder.forward", (now - resolved_at) * 1e3))

