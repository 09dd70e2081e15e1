"""MetricsBoard: every source's latest snapshot summed; sources gone quiet lose their gauges, then their entry."""

from __future__ import annotations

from mmserve.runtime.metrics import Metric, MetricsSnapshot, snapshot_of
from mmserve.runtime.metrics_board import RETIRE_AFTER_S, STALE_AFTER_S, MetricsBoard


def _snap(requests: float, running: float) -> MetricsSnapshot:
    return snapshot_of(Metric("mmserve_requests_total", "counter", "", (), {(): requests}),
                       Metric("mmserve_decoder_running_requests", "gauge", "", (), {(): running}))


def test_gone_sources_keep_their_counters_but_not_their_gauges_nor_an_entry() -> None:
    clock = [1000.0]
    board = MetricsBoard(clock=lambda: clock[0])
    board.report("Decoder#a", _snap(5, 2))
    board.report("Decoder#b", _snap(7, 1))
    assert board.collect().value("mmserve_decoder_running_requests") == 3
    clock[0] += STALE_AFTER_S + 1
    board.report("Decoder#b", _snap(8, 1))
    merged = board.collect()
    assert merged.value("mmserve_requests_total") == 13 and merged.value("mmserve_decoder_running_requests") == 1
    clock[0] += RETIRE_AFTER_S
    board.report("Decoder#b", _snap(9, 0))
    merged = board.collect()
    assert merged.value("mmserve_requests_total") == 14 and board.sources == ["Decoder#b"]
    board.report("Decoder#a", _snap(6, 1))  # a late report from a retired one is not counted twice
    assert board.collect().value("mmserve_requests_total") == 14
