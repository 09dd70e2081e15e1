"""KVCache's gather workspace: a group's pages copied out exactly, into memory kept across gathers."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import DecoderConfig
from mmserve.decoder.kv_cache import KVCache
from mmserve.models.base import FULL, AttentionPattern, ModelSpec

PATTERN = AttentionPattern(layer_kinds=(FULL, FULL), sliding_window=None, bidirectional_images=False, scaling=0.5,
                           softcap=None)
SPEC = ModelSpec("gemma3", "m", 9, 4, 50, 16, 2, 2, 4, 1024, (1,), PATTERN)


def _filled_cache() -> KVCache:
    kv = KVCache(SPEC, DecoderConfig(block_size=4, num_blocks=16), dtype=torch.float32, device=torch.device("cpu"))
    kv.keys.copy_(torch.randn(kv.keys.shape))
    kv.values.copy_(torch.randn(kv.values.shape))
    return kv


def test_gather_copies_the_pages_asked_for_in_order() -> None:
    kv = _filled_cache()
    pages = torch.tensor([5, 0, 5, 31])
    keys, values = kv.gather(pages)
    assert torch.equal(keys, kv.keys[pages]) and torch.equal(values, kv.values[pages])


def test_a_gather_no_bigger_than_the_largest_so_far_reuses_its_memory() -> None:
    kv = _filled_cache()
    first, _ = kv.gather(torch.arange(8))
    smaller_keys, smaller_values = kv.gather(torch.tensor([3, 1]))
    assert smaller_keys.data_ptr() == first.data_ptr()
    assert torch.equal(smaller_keys, kv.keys[[3, 1]]) and torch.equal(smaller_values, kv.values[[3, 1]])
    bigger, _ = kv.gather(torch.arange(9))  # grows (to 16 pages: doubling), then 16 fit again
    again, _ = kv.gather(torch.arange(16))
    assert bigger.data_ptr() != first.data_ptr() and again.data_ptr() == bigger.data_ptr()
    assert torch.equal(again, kv.keys[:16])


def test_off_the_cpu_the_workspace_grows_by_a_quarter() -> None:
    kv = KVCache(SPEC, DecoderConfig(block_size=4, num_blocks=16), dtype=torch.float32, device=torch.device("meta"))
    kv.gather(torch.arange(16, device="meta"))
    kv.gather(torch.arange(17, device="meta"))
    assert kv._workspace.shape[1] == 20  # not 32: device memory is what the pool is sized against
    kv.gather(torch.arange(30, device="meta"))
    assert kv._workspace.shape[1] == 30  # a bigger jump: to what it needs


def test_a_pool_the_accelerator_cannot_hold_is_refused_naming_num_blocks_and_one_that_leaves_little_room_warned(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from mmserve.decoder import kv_cache

    gib = kv_cache.GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (9 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)  # of it 1 GiB held unused,
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * gib)  # free to the pool
    cuda = torch.device("cuda")
    kv_cache.check_pool_fits(8 * gib, 1000, cuda)  # room left: nothing said
    assert not caplog.records
    with pytest.raises(ValueError, match=r"decoder.num_blocks=2000 makes a KV cache of 16.0 GiB; cuda has 10.0 GiB "
                                         r"free now .*: set decoder.num_blocks to at most 1125"):
        kv_cache.check_pool_fits(16 * gib, 2000, cuda)
    kv_cache.check_pool_fits(int(9.5 * gib), 1000, cuda)
    assert "leaving 0.5 GiB" in caplog.text and "947 blocks would leave 10%" in caplog.text
    kv_cache.check_pool_fits(1 << 50, 1, torch.device("cpu"))  # a CPU's memory is not checked here
