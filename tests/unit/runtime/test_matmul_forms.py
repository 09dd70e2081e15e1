"""A step's x @ w.T in the form measured fastest: every form is the same product, and the choice is per
row count and thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmserve.config import DecoderConfig
from mmserve.runtime import matmul_forms
from mmserve.runtime.matmul_forms import (
    FORMS,
    LINEAR,
    ONEDNN,
    MatmulForms,
    PackedLinear,
    onednn_packing_available,
    pack_linears,
)
from mmserve.runtime.step_threads import StepThreads


@pytest.mark.parametrize(("name", "rows"), [(name, rows) for name in FORMS for rows in (1, 2, 5, 16)
                                             if name != "doubled" or rows == 1])  # doubled: one row only
def test_every_form_is_the_same_product(name: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 48, generator=gen), torch.randn(80, 48, generator=gen)
    out = FORMS[name](x, w)
    assert out.shape == (rows, 80)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.view(rows, 5, 16), F.linear(x, w).view(rows, 5, 16), rtol=1e-5, atol=1e-5)


def test_calibration_chooses_a_form_per_row_count_and_thread_count_and_restores_the_threads() -> None:
    weights = [torch.randn(64, 32), torch.randn(32, 64), torch.randn(96, 32)]
    forms = MatmulForms()
    before = torch.get_num_threads()
    forms.calibrate(weights, {1, before}, max_rows=4, big_rows=32, rounds=1)
    assert torch.get_num_threads() == before
    assert forms.pack_rows in (None, 32)
    assert set(forms.chosen) == {1, before}
    for chosen in forms.chosen.values():
        assert len(chosen) == 5 and chosen[0] == LINEAR and set(chosen) <= set(FORMS)
        assert "doubled" not in chosen[2:]  # two rows or more are never computed twice
    forms.calibrate(weights, {1}, max_rows=4, big_rows=4, rounds=1)  # a prefill chunk no bigger than a decode
    assert len(forms.chosen[1]) == 5


def test_the_chosen_forms_follow_the_thread_count_and_rows_past_them_take_linear() -> None:
    forms = MatmulForms()
    forms.chosen = {2: (LINEAR, "doubled", "transposed")}
    w = torch.randn(40, 24)
    forms.use(2)
    assert not forms.product(torch.randn(2, 24), w).is_contiguous()  # mm(w, x.T).T: a transposed view
    assert forms.product(torch.randn(3, 24), w).is_contiguous()  # past the measured rows: F.linear
    forms.use(1)  # nothing measured at 1 thread: F.linear
    assert forms.product(torch.randn(2, 24), w).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_dtype_onednn_cannot_pack_here_is_measured_plain(dtype: torch.dtype, monkeypatch) -> None:
    """float16 packing needs AVX-512 FP16 or AVX-NE-CONVERT: where the CPU lacks them, the forms stay plain.
    NOTE: oneDNN's refusal is made here, so the test holds on a CPU that can pack both dtypes too."""
    def cannot_pack(w: torch.Tensor, rows: int) -> torch.Tensor:
        raise RuntimeError(f"no {w.dtype} packing on this CPU")

    if onednn_packing_available():
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", cannot_pack)
    forms = MatmulForms()
    forms.calibrate([torch.randn(64, 32).to(dtype), torch.randn(32, 64).to(dtype)], {1}, max_rows=2, big_rows=16,
                    rounds=1)
    x, w = torch.randn(3, 32).to(dtype), torch.randn(48, 32).to(dtype)
    torch.testing.assert_close(forms.product(x, forms.pack(w)).float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    assert matmul_forms._packed([w], 16) is None  # oneDNN cannot pack the dtype: never chosen
    assert forms.pack_rows is None and forms.pack_hint is None and not forms.pack(w).is_mkldnn


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN packing")
def test_a_weight_packed_for_onednn_gives_the_same_product_at_any_row_count() -> None:
    forms, w = MatmulForms(), torch.randn(80, 48)
    assert forms.pack(w) is w  # nothing measured: plain
    forms.packing(16)
    packed = forms.pack(w)
    assert packed.is_mkldnn
    for rows in (1, 3, 16, 100):
        x = torch.randn(rows, 96)[:, ::2]  # NOTE: a strided input, as the layers' normed slices are
        torch.testing.assert_close(forms.product(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_timed_cycle_is_the_first_weights_that_outgrow_the_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    weights = [torch.zeros(256, 256) for _ in range(6)]  # 256 KiB each
    monkeypatch.setattr(matmul_forms, "COLD_BYTES", 600 << 10)
    assert len(matmul_forms._cold_cycle(weights)) == 3
    monkeypatch.setattr(matmul_forms, "COLD_BYTES", 1 << 30)
    assert len(matmul_forms._cold_cycle(weights)) == 6


def test_forms_are_measured_at_every_count_a_step_may_use() -> None:
    threads = StepThreads(torch.device("cpu"), DecoderConfig(small_step_threads=1, big_step_threads=3))
    threads.available = 4
    assert threads.possible_counts() == {1, 3}
    threads.big = None  # open: measured between 1 and all
    assert threads.possible_counts() == {1, 4}


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN packing")
def test_a_packed_linear_layer_is_the_same_layer() -> None:
    linear = torch.nn.Linear(24, 40)
    forms = MatmulForms()
    forms.packing(64)
    packed = PackedLinear(linear, forms)
    x = torch.randn(2, 7, 24)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_packing_available(), reason="this torch build has no oneDNN packing")
@pytest.mark.parametrize("packed_wins", [True, False])
def test_linear_layers_are_packed_only_where_measured_faster(monkeypatch: pytest.MonkeyPatch,
                                                             packed_wins: bool) -> None:
    def timings(cycle, packed, rows, rounds):  # stands in for the clock
        return {LINEAR: 1.0, "transposed": 1.0, ONEDNN: 0.5 if packed_wins else 1.0}

    monkeypatch.setattr(matmul_forms, "_timings", timings)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Sequential(torch.nn.Linear(32, 8)))
    x = torch.randn(5, 16)
    with torch.no_grad():
        before = model(x)
        assert pack_linears(model, rows=64) == (2 if packed_wins else 0)
        kinds = {type(m) for m in model.modules()}
        assert (PackedLinear in kinds) == packed_wins and (torch.nn.Linear in kinds) != packed_wins
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
