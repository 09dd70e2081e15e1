"""EncoderStage + EncoderRunner: batching, cache hits, budget, references until handover, eviction,
failure rollback."""

from __future__ import annotations

import pickle
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from mmserve.config import EncoderConfig
from mmserve.encoder.outputs import EncoderStepError
from mmserve.encoder.runner import EncoderRunner
from mmserve.encoder.stage import EncoderStage
from mmserve.errors import CapacityError
from mmserve.messages import MultiModalFeatureSpec, PlaceholderRange, ProcessedItem
from mmserve.models.pixels import PixelNormalization
from mmserve.runtime.device_errors import DeviceFault
from tests.numerics import assert_close_ulps

MM_TOKENS = 4  # rows per crop of the fake vision model
HIDDEN = 6
# NOTE: a batch runs other matmul/pooling kernels than one image alone (another blocking, another SIMD
# path per CPU), which add the same terms in another order. The fake model is two short sums (a 4x4
# pool, a 3-term dot product + bias) whose terms are at most its largest outputs: each sum moves by
# under 1 ulp of them; 4 ulps leaves room for both sums. A wrong image or crop is off by ~1e6 ulps.
FAKE_ULPS = 4
# The real SigLIP + projector compounds that through ~20 matmuls, softmaxes and norms.
REAL_ULPS = 64


class FakeVision(torch.nn.Module):
    """(n, 3, 8, 8) -> (n, 4, 6): 4x4 average pooling then a fixed linear map; per-image, deterministic."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Linear(3, HIDDEN)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(HIDDEN, 3, generator=gen))
            self.proj.bias.copy_(torch.randn(HIDDEN, generator=gen))

    def forward(self, px: torch.Tensor) -> torch.Tensor:  # (n, 3, 8, 8) uint8, as a family's callable gets
        pooled = torch.nn.functional.avg_pool2d(px.to(self.proj.weight.dtype), 4)  # (n, 3, 2, 2)
        return self.proj(pooled.flatten(2).transpose(1, 2))  # (n, 4, HIDDEN)


class Store:
    """Stands in for the object store: spec.data is a key, `resolve` counts its calls."""

    def __init__(self) -> None:
        self.items: dict[str, ProcessedItem] = {}
        self.calls: list[str] = []

    def resolve(self, spec: MultiModalFeatureSpec) -> ProcessedItem:
        self.calls.append(spec.data)
        return self.items[spec.data]


def _item(seed: int, n_crops: int = 1, size: int = 8) -> ProcessedItem:
    rng = np.random.default_rng(seed)
    return ProcessedItem(rng.integers(0, 256, (n_crops, 3, size, size), dtype=np.uint8))


def _spec(mm_hash: str, data: Any, num_embeds: int = MM_TOKENS) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(mm_hash, "image", PlaceholderRange(0, num_embeds), num_embeds, data)


def _stage(vision: Callable[[torch.Tensor], torch.Tensor] | None = None, **config: int) -> EncoderStage:
    settings: dict[str, Any] = {"cache_capacity_tokens": 64, "compute_budget_tokens": 32, "max_batch_items": 16,
                                **config}
    cfg = EncoderConfig(**settings)
    return EncoderStage.build(vision or FakeVision(), cfg)


def _alone(vision: Callable[[torch.Tensor], torch.Tensor], item: ProcessedItem) -> torch.Tensor:
    with torch.no_grad():
        return vision(torch.from_numpy(item.pixel_values.copy())).reshape(-1, HIDDEN)


def test_two_requests_batch_into_one_forward_equal_to_alone() -> None:
    vision = FakeVision()
    stage = _stage(vision)
    a, b = _item(1), _item(2)
    stage.add_request("r1", [_spec("ha", a)])
    stage.add_request("r2", [_spec("hb", b)])
    out = {r.request_id: r.embeddings for r in stage.step()}
    s = stage.stats()
    assert s.forward_passes == 1 and s.batch_sizes == {2: 1} and s.items_encoded == 2
    assert out["r1"][0].shape == (MM_TOKENS, HIDDEN)
    assert_close_ulps(out["r1"][0], _alone(vision, a), FAKE_ULPS)
    assert_close_ulps(out["r2"][0], _alone(vision, b), FAKE_ULPS)
    assert not stage.has_pending() and stage.step() == []


def test_same_image_again_is_a_hit_without_forward_or_resolve() -> None:
    stage, store = _stage(), Store()
    store.items["k"] = _item(1)
    stage.add_request("r1", [_spec("h", "k")], store.resolve)
    (first,) = stage.step()
    stage.add_request("r2", [_spec("h", "k")], store.resolve)
    (second,) = stage.step()
    assert store.calls == ["k"]
    assert stage.stats().forward_passes == 1
    assert stage.stats().queries == 2 and stage.stats().hits == 1
    assert torch.equal(first.embeddings[0], second.embeddings[0])  # the cached rows themselves: exact
    assert stage.manager.refcount("h") == 0 and "h" in stage.cache  # handed out: held by nobody, still cached


@pytest.mark.parametrize("together", [False, True])
def test_an_early_encode_serves_its_request_and_counts_as_that_requests_miss(together: bool) -> None:
    stage, store = _stage(), Store()
    store.items.update(k=_item(1), j=_item(2))
    stage.add_request("r1/early", [_spec("h", "k")], store.resolve, early=True)
    if not together:  # the request arrives after the early encode's step, or while it is still queued
        assert [r.request_id for r in stage.step()] == ["r1/early"]
    stage.add_request("r1", [_spec("h", "k"), _spec("g", "j")], store.resolve)
    done = {r.request_id: r for r in stage.step()}
    assert set(done) == ({"r1"} if not together else {"r1/early", "r1"})
    stats = stage.stats()
    assert sorted(store.calls) == ["j", "k"] and stats.images_encoded == 2  # "h" encoded once
    assert stats.queries == 2 and stats.hits == 0  # both were misses for r1, one of them run ahead
    assert stats.early_found == 1
    # r1 waited for the early encode's step (timed for it once run) and for its own step's
    step = ["encoder.pixels", "encoder.forward"]
    assert [name for name, _ in done["r1"].timings] == step * (1 if together else 2) + ["encoder.stage"]
    stage.add_request("r2", [_spec("h", "k")], store.resolve)
    (again,) = stage.step()
    assert [name for name, _ in again.timings] == ["encoder.stage"]  # found cached: no step of its own
    assert stage.stats().queries == 3 and stage.stats().hits == 1  # found again: a hit like any other
    assert stage.stats().early_found == 1
    assert torch.equal(again.embeddings[0], done["r1"].embeddings[0])
    assert not stage.has_pending() and stage.manager.refcount("h") == 0


def test_an_early_entry_evicted_in_the_step_that_misses_it_again_counts_as_a_plain_miss() -> None:
    stage, store = _stage(cache_capacity_tokens=2 * MM_TOKENS), Store()
    store.items.update(k=_item(1), j=_item(2), i=_item(3))
    stage.add_request("r/early", [_spec("x", "k")], store.resolve, early=True)
    stage.add_request("w", [_spec("w", "j")], store.resolve)
    stage.step()  # both handed out: x (made early, its request not come) then w, unreferenced in that order
    stage.add_request("a", [_spec("y", "i")], store.resolve)  # evicts x, the oldest
    stage.add_request("r", [_spec("x", "k")], store.resolve)  # misses x in the same step: evicts w
    done = {out.request_id: out for out in stage.step()}
    stats = stage.stats()
    assert store.calls.count("k") == 2 and stats.early_found == 0 and stats.hits == 0
    assert [name for name, _ in done["r"].timings] == ["encoder.pixels", "encoder.forward", "encoder.stage"]


def test_duplicates_within_a_step_and_a_request_encode_once() -> None:
    stage, store = _stage(), Store()
    store.items.update(k=_item(1), j=_item(2))
    stage.add_request("r1", [_spec("h", "k"), _spec("g", "j"), _spec("h", "k")], store.resolve)
    stage.add_request("r2", [_spec("h", "k")], store.resolve)
    done = stage.step()
    assert [r.request_id for r in done] == ["r1", "r2"]
    assert sorted(store.calls) == ["j", "k"]
    assert stage.stats().images_encoded == 2 and stage.stats().hits == 2
    assert len(done[0].embeddings) == 3 and torch.equal(done[0].embeddings[0], done[0].embeddings[2])  # one encode


def test_pan_and_scan_items_keep_all_their_crops() -> None:
    vision = FakeVision()
    stage = _stage(vision)
    multi, single = _item(1, n_crops=3), _item(2)
    stage.add_request("r1", [_spec("m", multi, 3 * MM_TOKENS), _spec("s", single)])
    (r,) = stage.step()
    assert stage.stats().batch_sizes == {4: 1}
    assert_close_ulps(r.embeddings[0], _alone(vision, multi), FAKE_ULPS)
    assert_close_ulps(r.embeddings[1], _alone(vision, single), FAKE_ULPS)


def test_budget_limits_items_per_step_rest_follow() -> None:
    stage = _stage(compute_budget_tokens=2 * MM_TOKENS)
    for i in range(3):
        stage.add_request(f"r{i}", [_spec(f"h{i}", _item(i))])
    assert [r.request_id for r in stage.step()] == ["r0", "r1"]
    assert stage.has_pending() and stage.stats().num_pending == 1
    assert [r.request_id for r in stage.step()] == ["r2"]
    assert stage.stats().forward_passes == 2 and stage.stats().batch_sizes == {2: 1, 1: 1}


def test_a_step_holds_one_forward_of_crops_and_a_bigger_item_runs_alone_in_chunks() -> None:
    stage = _stage(max_batch_items=2)
    for i in range(3):
        stage.add_request(f"r{i}", [_spec(f"h{i}", _item(i))])
    assert [r.request_id for r in stage.step()] == ["r0", "r1"]  # the third would overflow the forward
    assert [r.request_id for r in stage.step()] == ["r2"]
    stage.add_request("big", [_spec("m", _item(9, n_crops=3), 3 * MM_TOKENS), _spec("s", _item(8))])
    assert stage.step() == []  # the 3-crop item alone, in forwards of 2 + 1; its neighbour waits
    (r,) = stage.step()
    assert r.request_id == "big" and len(r.embeddings) == 2
    assert stage.stats().batch_sizes == {2: 2, 1: 3}


def test_a_one_image_request_shares_the_next_forward_with_an_eight_image_one_ahead_of_it() -> None:
    """Items are booked in turns: the one-image request behind an eight-image prompt goes out after the first
    forward, not after the prompt's every forward; the prompt's items keep their order and all come."""
    stage = _stage(max_batch_items=4)
    stage.add_request("big", [_spec(f"b{i}", _item(i)) for i in range(8)])
    stage.add_request("one", [_spec("o", _item(20))])
    assert [r.request_id for r in stage.step()] == ["one"]  # big's 3 items beside it
    assert stage.step() == [] and [r.request_id for r in stage.step()] == ["big"]
    assert stage.stats().batch_sizes == {4: 2, 1: 1}


def test_started_requests_never_hold_the_room_each_other_needs() -> None:
    """Two requests of two 4-row items each, in a cache of 10 rows: booked in turns without care, each would
    hold one item and wait for the room the other holds, for ever. The second starts once the first's need
    fits beside its own; both come, and the books end empty of references."""
    stage = _stage(cache_capacity_tokens=10, max_batch_items=4)
    stage.add_request("a", [_spec("a0", _item(0)), _spec("a1", _item(1))])
    stage.add_request("b", [_spec("b0", _item(2)), _spec("b1", _item(3))])
    done: list[str] = []
    for _ in range(6):
        done += [r.request_id for r in stage.step()]
    assert done == ["a", "b"] and not stage.has_pending()
    assert stage.manager.referencing_requests() == []


def test_turns_go_round_from_step_to_step_where_a_forward_holds_one_crop() -> None:
    """A CPU's forward takes one crop: within a step there is one turn, so the turns go round across steps; the
    one-image request behind an eight-image one goes out after the second forward, not the ninth."""
    stage = _stage(max_batch_items=1)
    stage.add_request("big", [_spec(f"b{i}", _item(i)) for i in range(8)])
    stage.add_request("one", [_spec("o", _item(20))])
    assert stage.step() == [] and [r.request_id for r in stage.step()] == ["one"]
    out: list[str] = []
    for _ in range(7):
        out += [r.request_id for r in stage.step()]
    assert out == ["big"] and stage.stats().batch_sizes == {1: 9}


def test_a_started_request_keeps_its_turns_while_new_ones_keep_arriving() -> None:
    """A new request waits behind every request already pending, however the turns stood: with one arriving
    before every step, the 4-image request started first shares the forwards (of one crop) in turns with those
    pending beside it and goes out within 12, not never (turns keyed by arrival put each newcomer first)."""
    stage = _stage(max_batch_items=1)
    stage.add_request("big", [_spec(f"b{i}", _item(i)) for i in range(4)])
    out: list[str] = []
    for k in range(12):
        stage.add_request(f"new{k}", [_spec(f"n{k}", _item(30 + k))])
        out += [r.request_id for r in stage.step()]
    assert "big" in out


def test_an_id_aborted_and_added_again_takes_its_turn_at_the_back() -> None:
    """An id comes again after an abort (a retry under the same id): it is a new request, behind those pending."""
    stage = _stage(max_batch_items=1)
    for rid in ("x", "a", "b"):
        stage.add_request(rid, [_spec(f"{rid}0", _item(ord(rid)))])
    stage.abort("x")
    stage.add_request("x", [_spec("x1", _item(99))])
    assert list(stage._turns) == ["a", "b", "x"]
    assert [r.request_id for _ in range(3) for r in stage.step()] == ["a", "b", "x"]


def test_a_request_that_may_not_start_yet_stops_no_one_elses_turns() -> None:
    """B cannot start beside A's need (a cache of 40 rows); A still books all 8 items in turns into one forward
    (B's wait must not leave it one item a forward), then B goes."""
    stage = _stage(cache_capacity_tokens=40, compute_budget_tokens=32, max_batch_items=16)
    stage.add_request("a", [_spec(f"a{i}", _item(i)) for i in range(8)])
    stage.add_request("b", [_spec(f"b{i}", _item(50 + i)) for i in range(3)])
    assert [r.request_id for r in stage.step()] == ["a"]
    assert [r.request_id for r in stage.step()] == ["b"]
    assert stage.stats().batch_sizes == {8: 1, 3: 1}


@pytest.mark.parametrize("seed", range(40))
def test_random_requests_over_a_tight_cache_all_come(seed: int) -> None:
    """Random prompts of 1-4 items (shared between prompts at times, 1-3 crops each) over a cache barely above
    the largest prompt: every request is handed out, within a bounded number of steps, and the books end with
    no reference left and within capacity."""
    rng = np.random.default_rng(seed)
    stage = _stage(cache_capacity_tokens=int(rng.integers(16, 33)), compute_budget_tokens=int(rng.integers(4, 33)),
                   max_batch_items=int(rng.integers(1, 6)))
    pool = [(f"h{k}", int(rng.integers(1, 4))) for k in range(10)]  # (identifier, crops)
    wanted: set[str] = set()
    for r in range(int(rng.integers(2, 9))):
        picks = rng.choice(len(pool), size=int(rng.integers(1, 5)), replace=True)
        specs = [_spec(pool[k][0], _item(int(k), pool[k][1]), pool[k][1] * MM_TOKENS) for k in picks]
        try:
            stage.add_request(f"r{r}", specs)
        except CapacityError:
            continue
        wanted.add(f"r{r}")
    done: list[str] = []
    for _ in range(200):
        done += [r.request_id for r in stage.step()]
        started = [req.next_index > 0 for req in stage._pending.values()]  # arrival order
        assert started == sorted(started, reverse=True), "a request started before an older one"
        if not stage.has_pending():
            break
    assert sorted(done) == sorted(wanted)
    assert stage.manager.referencing_requests() == []
    assert stage.manager.num_cached_tokens <= stage.manager.capacity_tokens


def test_an_item_over_the_compute_budget_is_its_steps_only_miss() -> None:
    """Pan-and-scan with many crops needs more rows than one step's budget: it runs, alone, never refused."""
    stage = _stage(compute_budget_tokens=2 * MM_TOKENS)
    stage.add_request("small", [_spec("s", _item(1))])
    stage.add_request("big", [_spec("m", _item(9, n_crops=3), 3 * MM_TOKENS)])
    stage.add_request("after", [_spec("t", _item(2))])
    assert [r.request_id for r in stage.step()] == ["small"]  # the big one does not fit beside it
    assert [r.request_id for r in stage.step()] == ["big"]  # first in its step: alone, over the budget
    assert [r.request_id for r in stage.step()] == ["after"]
    assert stage.stats().batch_sizes == {1: 2, 3: 1}


def test_references_last_until_handover_and_abort_drops_pending() -> None:
    stage = _stage(compute_budget_tokens=MM_TOKENS)
    stage.add_request("r1", [_spec("a", _item(1)), _spec("b", _item(2))])
    assert stage.step() == []  # budget: only "a" this step; r1 holds it, still pending
    assert stage.manager.refcount("a") == 1
    stage.abort("r1")
    assert not stage.has_pending() and stage.manager.refcount("a") == 0
    assert stage.step() == [] and stage.stats().forward_passes == 1

    stage.add_request("r2", [_spec("c", _item(3))])
    (done,) = stage.step()
    assert stage.manager.refcount("c") == 0 and stage.manager.referencing_requests() == []  # handed out
    stage.abort("r2")  # a late abort (the caller left as the answer came) is a no-op
    cached = stage.cache.get("c")
    assert stage.manager.num_cached == 2 and cached is not None and torch.equal(done.embeddings[0], cached)
    stage.add_request("r2", [_spec("c", _item(3))])  # the id is free again; a hit
    assert [r.request_id for r in stage.step()] == ["r2"] and stage.stats().hits == 1


def test_evicted_entry_misses_again() -> None:
    stage, store = _stage(cache_capacity_tokens=2 * MM_TOKENS), Store()
    store.items.update(a=_item(1), b=_item(2), c=_item(3))
    for rid, key in [("r1", "a"), ("r2", "b"), ("r3", "c"), ("r4", "a")]:
        stage.add_request(rid, [_spec(key, key)], store.resolve)
        assert len(stage.step()) == 1
    assert store.calls == ["a", "b", "c", "a"]  # c evicted a (the oldest unreferenced)
    assert "a" in stage.cache and "b" not in stage.cache and "c" in stage.cache
    assert stage.stats().hits == 0 and stage.stats().forward_passes == 4


def test_entries_a_waiting_request_holds_are_not_evicted_for_its_next_item() -> None:
    stage, store = _stage(cache_capacity_tokens=2 * MM_TOKENS, compute_budget_tokens=MM_TOKENS), Store()
    store.items.update(x=_item(1), a=_item(2), b=_item(3))
    stage.add_request("r0", [_spec("x", "x")], store.resolve)
    assert len(stage.step()) == 1  # x cached, held by nobody
    stage.add_request("r1", [_spec("a", "a"), _spec("b", "b")], store.resolve)
    assert stage.step() == []  # a encoded (the budget: one item a step); r1 holds it while b waits
    (r1,) = stage.step()  # b needs room: x goes, not a
    assert "a" in stage.cache and "b" in stage.cache and "x" not in stage.cache
    assert len(r1.embeddings) == 2 and store.calls == ["x", "a", "b"]


def test_room_for_a_requests_miss_is_not_made_by_evicting_its_own_later_hit() -> None:
    """x (older) and z cached, held by nobody; r asks y (new), then x: y's room comes from z, and x hits."""
    stage, store = _stage(cache_capacity_tokens=2 * MM_TOKENS, compute_budget_tokens=MM_TOKENS), Store()
    store.items.update(x=_item(1), y=_item(2), z=_item(3))
    for name in "xz":
        stage.add_request(f"warm-{name}", [_spec(name, name)], store.resolve)
        assert len(stage.step()) == 1
    stage.add_request("r", [_spec("y", "y"), _spec("x", "x")], store.resolve)
    (r,) = stage.step()
    assert store.calls == ["x", "z", "y"] and "x" in stage.cache and "z" not in stage.cache  # x not encoded again
    assert len(r.embeddings) == 2 and stage.stats().hits == 1


def test_a_request_whose_miss_waits_does_not_hold_an_item_booked_this_step_by_another() -> None:
    """r1 books x this step; r2's y does not fit the step's budget. Holding x for r2 gains nothing (r1's booking
    keeps it) and tied r2 to x's fate: x's pixels are lost, r1 fails, r2 waits for its next step."""
    stage, store = _stage(cache_capacity_tokens=4 * MM_TOKENS, compute_budget_tokens=MM_TOKENS), Store()
    store.items["y"] = _item(1)  # "x_lost": its maker died
    stage.add_request("r1", [_spec("x", "x_lost")], store.resolve)
    stage.add_request("r2", [_spec("y", "y"), _spec("x", "x_lost")], store.resolve)
    with pytest.raises(EncoderStepError) as err:
        stage.step()
    assert err.value.request_ids == ["r1"] and stage.has_pending()


def test_capacity_errors_at_add_request() -> None:
    stage = _stage(cache_capacity_tokens=3 * MM_TOKENS, compute_budget_tokens=2 * MM_TOKENS)
    with pytest.raises(CapacityError, match="cache_capacity_tokens"):
        stage.add_request("r", [_spec("a", _item(1), 4 * MM_TOKENS)])
    with pytest.raises(CapacityError, match="cache_capacity_tokens"):
        stage.add_request("r", [_spec(h, _item(1), 2 * MM_TOKENS) for h in "ab"])
    stage.add_request("r", [_spec("a", _item(1), 2 * MM_TOKENS)] * 3)  # one distinct item fits
    with pytest.raises(ValueError, match="already"):
        stage.add_request("r", [])
    assert stage.stats().num_pending == 1


def test_request_without_images_completes_at_next_step() -> None:
    stage = _stage()
    stage.add_request("r", [])
    assert [(r.request_id, r.embeddings) for r in stage.step()] == [("r", [])]


def test_missing_data_on_a_miss_fails_that_request_only() -> None:
    stage = _stage(compute_budget_tokens=MM_TOKENS)
    stage.add_request("bad", [_spec("x", None)])
    stage.add_request("ok", [_spec("y", _item(1))])
    with pytest.raises(EncoderStepError, match="carries no data") as err:
        stage.step()
    assert isinstance(err.value, RuntimeError) and err.value.request_ids == ["bad"]
    assert "x" not in stage.manager and stage.manager.num_cached == 0
    assert [r.request_id for r in stage.step()] == ["ok"]


def test_failed_forward_rolls_back_the_books() -> None:
    def broken(px: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("boom")

    stage = _stage(broken)
    stage.add_request("r1", [_spec("a", _item(1))])
    stage.add_request("r2", [_spec("a", _item(1))])  # hits the entry r1 allocates in the same step
    with pytest.raises(EncoderStepError) as err:
        stage.step()
    assert err.value.request_ids == ["r1", "r2"]
    assert stage.manager.num_cached == 0 and len(stage.cache) == 0 and not stage.has_pending()


def test_a_lost_pixel_reference_fails_its_request_only() -> None:
    stage, store = _stage(), Store()
    store.items.update(k=_item(1), j=_item(2))  # "gone" is not there: its owner died
    stage.add_request("ok1", [_spec("a", "k")], store.resolve)
    stage.add_request("lost", [_spec("x", "gone")], store.resolve)
    stage.add_request("ok2", [_spec("b", "j")], store.resolve)
    with pytest.raises(EncoderStepError) as err:
        stage.step()
    assert err.value.request_ids == ["lost"] and "x" not in stage.manager
    # encoded in that same forward, they go on from the failed step (the next could fail the same way)
    assert [r.request_id for r in err.value.outputs] == ["ok1", "ok2"]
    assert not stage.has_pending() and stage.manager.referencing_requests() == []
    assert stage.stats().forward_passes == 1


def test_an_item_shared_in_one_step_is_read_through_another_requests_pixels_when_the_firsts_are_lost() -> None:
    stage, store = _stage(), Store()
    store.items["good"] = _item(1)  # "gone" is not there: the first request's maker died, the second's lives
    stage.add_request("r1", [_spec("x", "gone")], store.resolve)
    stage.add_request("r2", [_spec("x", "good")], store.resolve)  # hits the entry r1 allocates in the same step
    assert [r.request_id for r in stage.step()] == ["r1", "r2"]  # neither fails for r1's lost pixels
    assert store.calls == ["gone", "good"] and stage.stats().forward_passes == 1


class PrefetchingStore(Store):
    """A store that brings a step's items together first (as the Ray app's resolver does); `late` never arrive."""

    def __init__(self, late: set[str]) -> None:
        super().__init__()
        self.late, self.prefetched = late, list[list[str]]()

    def __call__(self, spec: MultiModalFeatureSpec) -> ProcessedItem:  # NOTE: the resolver is the store itself
        return self.resolve(spec)

    def prefetch(self, specs: list[MultiModalFeatureSpec]) -> list[bool]:
        self.prefetched.append([s.data for s in specs])
        return [s.data not in self.late for s in specs]


def test_a_steps_misses_are_prefetched_together_and_one_that_arrives_late_fails_alone_unread() -> None:
    stage, store = _stage(), PrefetchingStore(late={"slow"})
    store.items.update(k=_item(1), j=_item(2), slow=_item(3))
    stage.add_request("ok1", [_spec("a", "k")], store)
    stage.add_request("late", [_spec("x", "slow")], store)
    stage.add_request("ok2", [_spec("b", "j")], store)
    with pytest.raises(EncoderStepError) as err:
        stage.step()
    assert store.prefetched == [["k", "slow", "j"]]  # one call for the step's misses, before any read
    assert err.value.request_ids == ["late"] and isinstance(err.value.cause_of("late"), TimeoutError)
    assert store.calls == ["k", "j"] and "x" not in stage.manager  # the late item was not read (no second wait)
    assert [r.request_id for r in err.value.outputs] == ["ok1", "ok2"] and not stage.has_pending()
    assert stage.stats().forward_passes == 1


def test_when_a_lone_misss_own_copy_fails_the_others_copies_are_brought_together_not_read_one_by_one() -> None:
    """The Ray resolver does not wait for a step's one copy (nothing to overlap): if it then fails, the other
    requests' copies of the item are prefetched under one wait, and a stuck one is not read (a timeout each)."""
    class LoneUnwaited(PrefetchingStore):
        def prefetch(self, specs: list[MultiModalFeatureSpec]) -> list[bool]:
            return [True] if len(specs) < 2 else super().prefetch(specs)

    stage, store = _stage(), LoneUnwaited(late={"stuck"})
    store.items["good"] = _item(1)  # "gone": the first request's maker died; "stuck" never arrives
    for rid, data in (("r1", "gone"), ("r2", "stuck"), ("r3", "good")):
        stage.add_request(rid, [_spec("x", data)], store)
    assert [r.request_id for r in stage.step()] == ["r1", "r2", "r3"]
    assert store.prefetched == [["stuck", "good"]] and store.calls == ["gone", "good"]


def test_the_other_copies_of_every_miss_whose_own_copy_failed_are_brought_in_one_wait() -> None:
    stage, store = _stage(), PrefetchingStore(late={"stuck"})
    store.items.update(good_x=_item(1), good_y=_item(2))  # "gone_x", "gone_y": their makers died
    for rid, mm_hash, data in (("r1", "x", "gone_x"), ("r2", "y", "gone_y"), ("r3", "x", "stuck"),
                               ("r4", "x", "good_x"), ("r5", "y", "good_y")):
        stage.add_request(rid, [_spec(mm_hash, data)], store)
    assert len(stage.step()) == 5
    assert store.prefetched == [["gone_x", "gone_y"], ["stuck", "good_x", "good_y"]]  # not one wait per miss
    assert store.calls == ["gone_x", "gone_y", "good_x", "good_y"]


def test_a_request_found_cached_goes_on_from_a_step_whose_every_try_fails() -> None:
    """A stuck object store fails each step's misses after a read's timeout: a request whose items are cached
    must not wait for a step that succeeds."""
    stage, store = _stage(), PrefetchingStore(late={"slow"})
    store.items.update(k=_item(1), slow=_item(3))
    stage.add_request("first", [_spec("a", "k")], store)
    stage.step()
    stage.add_request("late", [_spec("x", "slow")], store)
    stage.add_request("cached", [_spec("a", "k")], store)
    with pytest.raises(EncoderStepError) as err:
        stage.step()
    assert err.value.request_ids == ["late"] and [r.request_id for r in err.value.outputs] == ["cached"]
    assert not stage.has_pending()


def test_a_step_failure_naming_no_request_leaves_no_entry_without_its_tensor() -> None:
    """An error the stage cannot pin on one request (the caller then aborts every request): the entries the
    step booked are forgotten, so a later request for the item encodes it instead of failing on a hit."""
    class Miscounting(PrefetchingStore):
        def prefetch(self, specs: list[MultiModalFeatureSpec]) -> list[bool]:
            return [True] * (len(specs) + 1)  # one answer too many: pixel_reads' strict zip raises

    stage, store = _stage(), Miscounting(late=set())
    store.items["k"] = _item(1)
    stage.add_request("r1", [_spec("a", "k")], store)
    with pytest.raises(ValueError):
        stage.step()
    assert "a" not in stage.manager and len(stage.cache) == 0
    stage.abort_all()
    stage.add_request("r2", [_spec("a", "k")], store.resolve)
    (r2,) = stage.step()
    assert r2.request_id == "r2" and stage.stats().forward_passes == 1


def test_a_late_copy_of_an_item_is_served_by_another_requests_copy_that_arrived() -> None:
    """Two requests carry one item made by two makers: the first's copy is late, the second's here. Neither
    request fails."""
    stage, store = _stage(), PrefetchingStore(late={"slow"})
    store.items.update(slow=_item(3), fast=_item(3))
    stage.add_request("r1", [_spec("x", "slow")], store)
    stage.add_request("r2", [_spec("x", "fast")], store)
    assert [r.request_id for r in stage.step()] == ["r1", "r2"]
    # its own copy first; the other request's only once its own was late
    assert store.prefetched == [["slow"], ["fast"]] and store.calls == ["fast"]  # the late one never read


def test_another_requests_far_copy_is_not_waited_for_when_the_own_copy_is_here() -> None:
    stage, store = _stage(), PrefetchingStore(late={"far"})
    store.items.update(here=_item(3), far=_item(3))
    stage.add_request("r1", [_spec("x", "here")], store)
    stage.add_request("r2", [_spec("x", "far")], store)
    assert [r.request_id for r in stage.step()] == ["r1", "r2"]
    assert store.prefetched == [["here"]] and store.calls == ["here"]


def test_a_late_copy_whose_alternates_fail_too_fails_as_late_and_each_pixels_is_read_once() -> None:
    stage, store = _stage(), PrefetchingStore(late={"slow"})
    store.items["slow"] = _item(3)  # "gone" is not there: its maker died
    stage.add_request("r1", [_spec("x", "slow")], store)
    stage.add_request("r2", [_spec("x", "gone")], store)
    stage.add_request("r3", [_spec("x", "gone")], store)  # the same reference as r2's
    with pytest.raises(EncoderStepError) as err:
        stage.step()
    assert isinstance(err.value.cause_of("r1"), TimeoutError)  # the late own copy is the reason
    assert store.prefetched == [["slow"], ["gone"]] and store.calls == ["gone"]


def test_a_failed_prefetch_reads_each_copy_as_it_is() -> None:
    class Broken(PrefetchingStore):
        def prefetch(self, specs: list[MultiModalFeatureSpec]) -> list[bool]:
            raise RuntimeError("the object store's wait failed")

    stage, store = _stage(), Broken(late=set())
    store.items["k"] = _item(1)
    stage.add_request("r", [_spec("a", "k")], store)
    assert [r.request_id for r in stage.step()] == ["r"] and store.calls == ["k"]


def test_each_failed_request_carries_its_own_items_error_and_the_error_pickles() -> None:
    stage, store = _stage(), Store()
    stage.add_request("lost", [_spec("x", "gone")], store.resolve)  # its maker died: the store raises KeyError
    stage.add_request("empty", [_spec("y", None)], store.resolve)
    with pytest.raises(EncoderStepError) as err:
        stage.step()
    assert err.value.request_ids == ["lost", "empty"]
    assert isinstance(err.value.cause_of("lost"), KeyError)
    assert "carries no data" in str(err.value.cause_of("empty")) and err.value.cause_of("other") is None
    back = pickle.loads(pickle.dumps(err.value))  # NOTE: it crosses Ray inside the replica's error
    assert back.request_ids == ["lost", "empty"] and isinstance(back.cause_of("lost"), KeyError)
    assert str(back) == str(err.value)


def test_an_item_that_breaks_its_batch_fails_alone_and_the_others_match_alone() -> None:
    vision = FakeVision()

    def poisoned(px: torch.Tensor) -> torch.Tensor:  # any batch holding the all-zero image fails
        if bool((px.flatten(1) == 0).all(dim=1).any()):
            raise RuntimeError("a kernel rejects this image")
        return vision(px)

    stage = _stage(poisoned)
    zero = ProcessedItem(np.zeros((1, 3, 8, 8), dtype=np.uint8))
    a, b = _item(1), _item(2)
    stage.add_request("r1", [_spec("a", a)])
    stage.add_request("bad", [_spec("z", zero)])
    stage.add_request("r2", [_spec("b", b)])
    with pytest.raises(EncoderStepError, match="rejects this image") as err:
        stage.step()
    assert err.value.request_ids == ["bad"]
    out = {r.request_id: r.embeddings[0] for r in err.value.outputs}
    assert set(out) == {"r1", "r2"} and not stage.has_pending()
    assert_close_ulps(out["r1"], _alone(vision, a), FAKE_ULPS)
    assert_close_ulps(out["r2"], _alone(vision, b), FAKE_ULPS)
    assert "z" not in stage.manager and stage.manager.referencing_requests() == []


def test_an_accelerator_fault_is_raised_not_run_again_item_by_item() -> None:
    """A CUDA fault is sticky: each item alone would fail too, as if each were bad; raised, it ends the loop."""
    calls: list[int] = []

    def faulty(px: torch.Tensor) -> torch.Tensor:
        calls.append(px.shape[0])
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    stage = _stage(faulty)
    stage.add_request("r1", [_spec("a", _item(1))])
    stage.add_request("r2", [_spec("b", _item(2))])
    with pytest.raises(DeviceFault) as fault:
        stage.step()
    assert len(calls) == 1  # the batch's forward only
    assert fault.value.request_ids == ["r1", "r2"] and isinstance(fault.value.__cause__, torch.AcceleratorError)
    assert stage.fault_of([_spec("b", _item(2))]) is fault.value.__cause__


def test_read_only_arrays_encode_without_warnings() -> None:
    vision = FakeVision()
    item = _item(1, n_crops=2)
    item.pixel_values.flags.writeable = False  # as numpy arrays from the Ray object store
    runner = EncoderRunner(vision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (emb,) = runner.embed_multimodal([item])
    assert_close_ulps(emb, _alone(vision, item), FAKE_ULPS)
    assert not emb.is_inference() and emb.untyped_storage().nbytes() == emb.numel() * 4


def test_runner_hands_uint8_pixels_to_the_callable_which_owns_the_dtype() -> None:
    seen: list[torch.dtype] = []
    vision = FakeVision().to(torch.bfloat16)

    def spy(px: torch.Tensor) -> torch.Tensor:
        seen.append(px.dtype)
        return vision(px)

    (emb,) = EncoderRunner(spy).embed_multimodal([_item(1)])
    assert seen == [torch.uint8]
    assert emb.dtype == torch.bfloat16 and emb.shape == (MM_TOKENS, HIDDEN)


@pytest.mark.parametrize("passing", [True, False])
def test_cpu_forwards_run_in_a_passing_thread_unless_the_stage_is_alone(passing: bool) -> None:
    """Beside a decoder each vision forward runs in a thread that ends with it (its OpenMP pool too); a process
    with no other torch stage runs them in the calling thread (the stage's own), whose pool and malloc arena
    stay warm from one forward to the next."""
    vision = FakeVision()
    threads: list[int] = []

    def spy(px: torch.Tensor) -> torch.Tensor:
        threads.append(threading.get_ident())
        return vision(px)

    runner = EncoderRunner(spy, passing_forwards=passing)
    for seed in (1, 2):
        (emb,) = runner.embed_multimodal([_item(seed)])
        assert_close_ulps(emb, _alone(vision, _item(seed)), FAKE_ULPS)
    assert (threading.get_ident() in threads) is not passing and len(threads) == 2


def test_real_gemma3_vision_batches_like_alone(tiny_ckpt_224: Any) -> None:
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(tiny_ckpt_224).eval()
    normalize = PixelNormalization.from_checkpoint(tiny_ckpt_224)

    def vision(px: torch.Tensor) -> torch.Tensor:  # (n, 3, 224, 224) uint8 -> (n, 16, text_hidden)
        return model.model.get_image_features(pixel_values=normalize(px)).pooler_output

    hidden = model.config.text_config.hidden_size
    a, b = _item(1, size=224), _item(2, size=224)
    stage, store = _stage(vision, cache_capacity_tokens=64, compute_budget_tokens=32), Store()
    store.items.update(a=a, b=b)
    stage.add_request("r1", [_spec("a", "a", 16)], store.resolve)
    stage.add_request("r2", [_spec("b", "b", 16)], store.resolve)
    out = {r.request_id: r.embeddings[0] for r in stage.step()}
    assert stage.stats().forward_passes == 1 and stage.stats().batch_sizes == {2: 1}
    with torch.no_grad():
        alone = [vision(torch.from_numpy(x.pixel_values.copy())).reshape(-1, hidden) for x in (a, b)]
    assert out["r1"].shape == (16, hidden)
    assert alone[0].abs().max() > 0 and not torch.allclose(alone[0], alone[1])  # images matter
    assert_close_ulps(out["r1"], alone[0], REAL_ULPS)
    assert_close_ulps(out["r2"], alone[1], REAL_ULPS)

    stage.add_request("r3", [_spec("a", "a", 16)], store.resolve)
    (r3,) = stage.step()
    assert store.calls == ["a", "b"] and stage.stats().forward_passes == 1
    assert torch.equal(r3.embeddings[0], out["r1"])  # a cache hit hands back the stored rows: exact
