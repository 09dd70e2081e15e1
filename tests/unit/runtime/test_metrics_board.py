"""MetricsBoard: every source's latest snapshot summed; sources gone quiet lose their gauges, then their entry."""

from __future__ import annotations

from mmserve.runtime import metrics_board
from mmserve.runtime.metrics import HistogramValue, Metric, MetricsSnapshot, snapshot_of
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


def test_a_source_that_says_it_is_going_is_retired_at_once_with_its_last_counts() -> None:
    board = MetricsBoard()
    board.report("Ingress#a", _snap(5, 2))
    board.report("Ingress#b", _snap(7, 1))
    board.report("Ingress#a", _snap(6, 2), final=True)  # a replica shutting down: its last push
    merged = board.collect()
    assert merged.value("mmserve_requests_total") == 13 and merged.value("mmserve_decoder_running_requests") == 1
    assert board.sources == ["Ingress#b"]
    board.report("Ingress#a", _snap(9, 0))  # a push that raced its last: not counted again
    assert board.collect().value("mmserve_requests_total") == 13


def test_a_board_nobody_scrapes_still_retires_the_silent_and_keeps_a_bounded_list_of_names(monkeypatch) -> None:
    monkeypatch.setattr(metrics_board, "NAMES_KEPT", 3)
    clock = [1000.0]
    board = MetricsBoard(clock=lambda: clock[0])
    board.report("Decoder#a", _snap(5, 2))
    clock[0] += RETIRE_AFTER_S + 1
    board.report("Decoder#b", _snap(1, 1))  # no collect: the report retires a
    assert board.sources == ["Decoder#b"] and list(board._retired_sources) == ["Decoder#a"]
    for i in range(5):
        board.report(f"Ingress#{i}", _snap(1, 0), final=True)
    assert len(board._retired_sources) == 3  # the latest names only: they do not grow for ever
    assert board.collect().value("mmserve_requests_total") == 11


def test_a_report_that_lands_after_a_later_one_is_dropped() -> None:
    """A push that timed out may still reach the hub after the next one: counters must not go back."""
    board = MetricsBoard()
    board.report("Decoder#a", _snap(5, 2), seq=2)
    board.report("Decoder#a", _snap(4, 3), seq=1)
    assert board.collect().value("mmserve_requests_total") == 5 - 5  # its first report here is its base
    board.report("Decoder#a", _snap(6, 1), seq=3)
    assert board.collect().value("mmserve_requests_total") == 1
    board.report("Decoder#a", _snap(7, 0), final=True, seq=5)
    board.report("Decoder#a", _snap(6, 1), seq=4)  # raced its last push: not counted again
    assert board.collect().value("mmserve_requests_total") == 2


def test_a_replaced_board_counts_older_sources_from_their_first_report_there() -> None:
    """A hub replaced (an edit of the app's arguments replaces every replica) starts its counters again from zero,
    as a restarted exporter does, instead of falling and then jumping back by every replica's lifetime count."""
    board = MetricsBoard()
    board.report("Decoder#old", _snap(500, 2), seq=40)  # it pushed before, to the hub this one replaced
    board.report("Decoder#new", _snap(3, 1), seq=1)  # its first push: all of its counts are new here
    merged = board.collect()
    assert merged.value("mmserve_requests_total") == 3 and merged.value("mmserve_decoder_running_requests") == 3
    board.report("Decoder#old", _snap(510, 1), seq=41)
    assert board.collect().value("mmserve_requests_total") == 13
    board.report("Decoder#old", _snap(512, 0), final=True, seq=42)  # retired with its counts here
    assert board.collect().value("mmserve_requests_total") == 15


def test_a_source_retired_for_its_silence_that_comes_back_is_not_counted_twice() -> None:
    clock = [1000.0]
    board = MetricsBoard(clock=lambda: clock[0])
    board.report("Decoder#a", _snap(100, 1), seq=1)
    clock[0] += RETIRE_AFTER_S + 1
    assert board.collect().value("mmserve_requests_total") == 100 and board.sources == []
    board.report("Decoder#a", _snap(160, 1), seq=9)  # back: its 160 include the 100 already in the sum
    assert board.collect().value("mmserve_requests_total") == 100
    board.report("Decoder#a", _snap(170, 1), seq=10)
    assert board.collect().value("mmserve_requests_total") == 110


def test_reports_and_collects_from_many_threads_at_once_neither_fail_nor_count_twice() -> None:
    import sys
    import threading

    clock = [0.0]
    board = MetricsBoard(clock=lambda: clock[0])
    errors: list[BaseException] = []

    def reporter(k: int) -> None:
        try:
            for i in range(200):
                board.report(f"Preprocess#{k}-{i}", _snap(1, 0))  # a new source each time
        except BaseException as exc:
            errors.append(exc)

    def collector() -> None:
        try:
            for _ in range(200):
                board.collect()
        except BaseException as exc:
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # NOTE: threads switch often: an unguarded board meets its races here
    try:
        threads = [threading.Thread(target=reporter, args=(k,)) for k in range(3)]
        threads += [threading.Thread(target=collector) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        clock[0] += RETIRE_AFTER_S + 1  # every source retired, from several collects at once
        threads = [threading.Thread(target=collector) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors and board.collect().value("mmserve_requests_total") == 600


def test_a_release_with_other_buckets_shows_them_once_the_old_replicas_are_gone() -> None:
    """Old-version replicas retiring into the board's sum must not keep the new version's buckets hidden; the old
    sum goes once, when the last old replica does (one reset to Prometheus, not one per replica)."""
    def snap(bounds: tuple[float, ...], n: int) -> MetricsSnapshot:
        counts = (0,) * len(bounds) + (n,)
        return snapshot_of(Metric("h_seconds", "histogram", "", (), {(): HistogramValue(bounds, counts, 50.0 * n)}))

    def count() -> tuple[tuple[float, ...], int]:
        value = board.collect().value("h_seconds")
        assert isinstance(value, HistogramValue)
        return value.bounds, value.count

    old, new = (1.0, 10.0), (1.0, 10.0, 100.0)
    board = MetricsBoard()
    board.report("Ingress#old1", snap(old, 3))
    board.report("Ingress#old2", snap(old, 5))
    board.report("Ingress#new1", snap(new, 2))
    assert count() == (old, 10)  # on the bounds they share
    board.report("Ingress#old1", snap(old, 4), final=True)
    assert count() == (old, 11)  # an old replica still lives: the retired sum stays
    board.report("Ingress#new1", snap(new, 3))
    board.report("Ingress#old2", snap(old, 6), final=True)
    assert count() == (new, 3)  # the last old one gone: the new buckets, and one drop
    board.report("Ingress#new2", snap(new, 1))
    board.report("Ingress#new1", snap(new, 4), final=True)
    assert count() == (new, 5)  # a new replica retiring keeps its counts


def test_buckets_a_release_moved_elsewhere_reset_once_whatever_retires_first() -> None:
    """Old (1, 10), new (2, 20): they share no bound. A new replica retiring while an old one lives leaves the
    retired sum on no bounds at all; it must stay until the last old replica is gone."""
    def snap(bounds: tuple[float, ...], n: int) -> MetricsSnapshot:
        counts = (0,) * len(bounds) + (n,)
        return snapshot_of(Metric("h_seconds", "histogram", "", (), {(): HistogramValue(bounds, counts, 1.0 * n)}))

    def count() -> int:
        value = board.collect().value("h_seconds")
        assert isinstance(value, HistogramValue)
        return value.count

    old, new = (1.0, 10.0), (2.0, 20.0)
    board = MetricsBoard()
    for name, bounds, n in (("o1", old, 100), ("o2", old, 5), ("n1", new, 2), ("n2", new, 1)):
        board.report(name, snap(bounds, n))
    assert count() == 108
    board.report("o1", snap(old, 100), final=True)
    board.report("n2", snap(new, 1), final=True)  # a new one retires while an old one lives
    assert count() == 108
    board.report("o2", snap(old, 5), final=True)
    assert count() == 2  # the last old one gone: the one reset
