"""EncoderService: early encodes (started only on an idle stage, found by the request's own call), requests served
from the cache at once, ids, callers that leave."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mmserve.encoder.service import EncoderService
from mmserve.messages import MultiModalFeatureSpec
from mmserve.runtime.device_errors import DeviceFault
from mmserve.runtime.step_loop import StageStopped
from tests.unit.encoder.test_encoder_stage import MM_TOKENS, FakeVision, Store, _item, _spec, _stage


def test_an_early_encode_on_an_idle_stage_is_what_the_requests_own_call_gets() -> None:
    async def run() -> None:
        store = Store()
        store.items["k"] = _item(1)
        service, solo = EncoderService(_stage(), resolve=store.resolve), EncoderService(_stage())
        try:
            assert service.encode_early("r1/early", [_spec("h", "k")])
            while service.stage.stats().forward_passes == 0:  # the early encode runs on its own
                await asyncio.sleep(0.005)
            (embedding,) = (await service.encode("r1", [_spec("h", "k")])).embeddings
            stats = service.stage.stats()
            assert stats.forward_passes == 1 and store.calls == ["k"]
            assert stats.queries == 1 and stats.hits == 0  # the request's miss, run ahead of it
            (alone,) = (await solo.encode("solo", [_spec("h", _item(1))])).embeddings
            assert torch.equal(embedding, alone)
        finally:
            service.stop()
            solo.stop()

    asyncio.run(run())


def held_vision(vision: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[threading.Event, threading.Event, Callable[[torch.Tensor], torch.Tensor]]:
    """(set once a forward is inside, set to let it finish, the vision callable): a forward of `vision` (a fake
    one by default) held (10 s at most)."""
    inside, release = threading.Event(), threading.Event()
    vision = vision or FakeVision()

    def slow(pixels: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(10)
        return vision(pixels)

    return inside, release, slow


async def in_its_forward(service: EncoderService, request_id: str, features: list[MultiModalFeatureSpec],
                         inside: threading.Event) -> asyncio.Future:
    """`service.encode(request_id, features)` started, once its forward (held, `held_vision`) is under way."""
    call = asyncio.ensure_future(service.encode(request_id, features))
    while not inside.is_set():
        await asyncio.sleep(0.005)
    return call


def test_a_busy_stage_starts_no_early_encode() -> None:
    inside, release, slow = held_vision()

    async def run() -> None:
        store = Store()
        store.items.update(k=_item(1), j=_item(2))
        service = EncoderService(_stage(slow), resolve=store.resolve)
        try:
            first = await in_its_forward(service, "r1", [_spec("h", "k")], inside)
            assert not service.encode_early("r2/early", [_spec("g", "j")])
            release.set()
            await first
            assert service.stage.stats().forward_passes == 1 and store.calls == ["k"]  # nothing else ran
            assert not service.encode_early("r3/early", [])  # no items: nothing to start
        finally:
            release.set()
            service.stop()

    asyncio.run(run())


def test_a_second_call_under_a_live_request_id_is_refused_and_the_first_still_gets_its_embeddings() -> None:
    inside, release, slow = held_vision()

    async def run() -> None:
        service = EncoderService(_stage(slow))
        try:
            first = await in_its_forward(service, "r", [_spec("h", _item(1))], inside)
            with pytest.raises(ValueError, match="already has a consumer"):
                await service.encode("r", [_spec("g", _item(2))])
            release.set()
            (embedding,) = (await asyncio.wait_for(first, 10)).embeddings  # NOTE: it waited for ever before
            assert embedding.shape == (4, 6)
        finally:
            release.set()
            service.stop()

    asyncio.run(run())


def test_callers_that_leave_mid_encode_leave_nothing_held_and_the_service_serves_on() -> None:
    inside, release, slow = held_vision()

    async def run() -> None:
        store = Store()
        store.items.update(k=_item(1), j=_item(2))
        service = EncoderService(_stage(slow), resolve=store.resolve)
        stage = service.stage
        try:
            running = await in_its_forward(service, "r1", [_spec("h", "k")], inside)  # in its forward
            queued = asyncio.ensure_future(service.encode("r2", [_spec("g", "j")]))  # behind that forward
            await asyncio.sleep(0.05)  # NOTE: its add waits on the step thread, which the forward holds
            running.cancel()
            queued.cancel()
            for call in (running, queued):
                with pytest.raises(asyncio.CancelledError):
                    await call
            release.set()
            for _ in range(1000):  # the aborts are applied on the step thread
                if not service.loop.busy():
                    break
                await asyncio.sleep(0.01)
            assert stage.stats().num_pending == 0 and stage.manager.referencing_requests() == []
            assert store.calls == ["k"]  # the queued request's pixels were never read
            again = await asyncio.wait_for(service.encode("r3", [_spec("g", "j")]), 10)
            assert again.embeddings[0].shape == (4, 6) and stage.manager.referencing_requests() == []
        finally:
            release.set()
            service.stop()

    asyncio.run(run())


def test_a_request_id_is_free_again_as_soon_as_its_call_returned() -> None:
    """An in-process caller may reuse its ids: the request's channel is gone when `encode` returns."""
    async def run() -> None:
        service = EncoderService(_stage())
        try:
            (first,) = (await service.encode("again", [_spec("h", _item(1))])).embeddings
            (second,) = (await service.encode("again", [_spec("h", _item(1))])).embeddings  # no turn in between
            assert torch.equal(first, second)
        finally:
            service.stop()

    asyncio.run(run())


def test_a_request_whose_items_are_cached_is_served_during_a_forward_for_others() -> None:
    """Strict FIFO is for what needs a forward: a request all of whose items are cached does not wait for the
    forward under way (a whole vision forward on a CPU) nor for misses queued before it."""
    inside, release, slow = held_vision()

    async def run() -> None:
        store = Store()
        store.items.update(k=_item(1), j=_item(2), m=_item(3))
        service = EncoderService(_stage(slow), resolve=store.resolve)
        stage = service.stage
        try:
            release.set()
            (first,) = (await service.encode("r0", [_spec("h", "k")])).embeddings  # now cached
            release.clear()
            inside.clear()
            busy = await in_its_forward(service, "r1", [_spec("g", "j")], inside)  # a miss, in its forward
            queued = asyncio.ensure_future(service.encode("r2", [_spec("f", "m")]))  # a miss behind it
            await asyncio.sleep(0.02)
            served = await asyncio.wait_for(service.encode("r3", [_spec("h", "k"), _spec("h", "k")]), 1)
            assert not busy.done() and not queued.done()
            assert [e.data_ptr() for e in served.embeddings] == [first.data_ptr()] * 2  # the cache's own tensor
            assert served.dtype == "float32" and [name for name, _ in served.timings] == ["encoder.stage"]
            release.set()
            await asyncio.wait_for(asyncio.gather(busy, queued), 10)
            stats = stage.stats()
            assert (stats.queries, stats.hits, stats.forward_passes) == (5, 2, 3)  # its lookups booked as hits
            assert stage.manager.referencing_requests() == []
            assert stage.manager.freeable_order()[-1] != "h"  # r1's and r2's items were freed after it...
            assert stage.manager.freeable_order().index("h") > 0  # ...but it moved past r0's turn: touched
        finally:
            release.set()
            service.stop()

    asyncio.run(run())


def test_a_request_whose_items_are_partly_cached_or_made_early_takes_the_step() -> None:
    async def run() -> None:
        store = Store()
        store.items.update(k=_item(1), j=_item(2))
        service = EncoderService(_stage(), resolve=store.resolve)
        try:
            await service.encode("r0", [_spec("h", "k")])
            await service.encode("r1", [_spec("h", "k"), _spec("g", "j")])  # one miss: the step's
            assert service.stage.stats().forward_passes == 2
            assert service.encode_early("r2/early", [_spec("e", "k")])
            while service.stage.stats().forward_passes < 3:
                await asyncio.sleep(0.005)
            while service.loop.busy():
                await asyncio.sleep(0.005)
            assert service.stage.cached([_spec("e", "k")]) is None  # made early for a request still to come
            await service.encode("r2", [_spec("e", "k")])
            assert service.stage.stats().early_found == 1
        finally:
            service.stop()

    asyncio.run(run())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_after_an_accelerator_fault_its_items_get_the_fault_and_others_a_lost_stage() -> None:
    """The request whose own early encode hit a fault gets that fault (no caller retries it elsewhere, where it
    would fault again); any other request, a cache hit included, gets StageStopped (retried on a live replica)."""
    vision = FakeVision()

    def faulty(pixels: torch.Tensor) -> torch.Tensor:
        if bool((pixels == 0).all()):  # the all-zero image's forward faults the device
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return vision(pixels)

    async def run() -> None:
        store = Store()
        store.items.update(bad=_zero_item(), good=_item(1))
        service = EncoderService(_stage(faulty), resolve=store.resolve)
        try:
            await service.encode("hit", [_spec("g", "good")])  # cached before the fault
            assert service.encode_early("r1/early", [_spec("z", "bad")])
            while not service.loop.died():
                await asyncio.sleep(0.005)
            with pytest.raises(torch.AcceleratorError):
                await service.encode("r1", [_spec("z", "bad")])
            with pytest.raises(StageStopped):
                await service.encode("other", [_spec("g", "good")])  # a hit, but the device is gone
        finally:
            service.stop()

    asyncio.run(run())


def _zero_item() -> Any:
    item = _item(1)
    item.pixel_values[...] = 0
    return item


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_requests_that_came_during_the_faulting_forward_get_the_fault_only_for_its_items() -> None:
    """Their adds were queued behind the step that faulted: the loop fails them as a lost stage, and the service
    turns that into the fault for a request of the faulting forward's item (no retry elsewhere), not for others."""
    def fault(pixels: torch.Tensor) -> torch.Tensor:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    inside, release, faulty = held_vision(fault)

    async def run() -> None:
        store = Store()
        store.items.update(bad=_item(3), other=_item(4))
        service = EncoderService(_stage(faulty), resolve=store.resolve)
        try:
            first = await in_its_forward(service, "r1", [_spec("z", "bad")], inside)
            same = asyncio.ensure_future(service.encode("r2", [_spec("z", "bad")]))
            other = asyncio.ensure_future(service.encode("r3", [_spec("o", "other")]))
            await asyncio.sleep(0.05)  # both submitted: their adds wait behind the step
            release.set()
            results = await asyncio.gather(first, same, other, return_exceptions=True)
            assert isinstance(results[0], DeviceFault)  # in the forward
            assert isinstance(results[1], torch.AcceleratorError)  # its item was the faulting forward's
            assert isinstance(results[2], StageStopped)  # innocent: its caller retries it on a live replica
        finally:
            release.set()
            service.stop()

    asyncio.run(run())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_request_pending_beside_the_faulting_forward_is_failed_as_a_lost_stage() -> None:
    """Added before the step but left out of its forward by the compute budget: no work of it was on the device,
    so its caller may retry it on a live replica (StageStopped), where the forward's requests get the fault."""
    def fault(pixels: torch.Tensor) -> torch.Tensor:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    async def run() -> None:
        store = Store()
        store.items.update(a=_item(5), b=_item(6), c=_item(7))
        # NOTE: the batch window lets all three adds run before the first step, whose budget holds two items
        service = EncoderService(_stage(fault, compute_budget_tokens=2 * MM_TOKENS), resolve=store.resolve,
                                 batch_wait_s=0.2)
        try:
            results = await asyncio.gather(*(service.encode(f"r{i}", [_spec(key, key)]) for i, key in
                                             enumerate("abc")), return_exceptions=True)
            assert [type(r) for r in results] == [DeviceFault, DeviceFault, StageStopped], results
        finally:
            service.stop()

    asyncio.run(run())
