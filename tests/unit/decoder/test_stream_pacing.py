"""StreamPacing: the floor alone, the budget shared by the live streams, the ceiling, and final-only callers."""

from __future__ import annotations

import math

from mmserve.decoder.stream_pacing import StreamPacing


def test_one_stream_gets_the_floor_and_many_share_the_budget_up_to_the_ceiling() -> None:
    pacing = StreamPacing(floor_s=0.02, messages_per_s=100, ceiling_s=0.25)
    assert pacing.interval_s(1) == 0.02  # 1 / 100 s is under the floor
    assert pacing.interval_s(2) == 0.02
    assert math.isclose(pacing.interval_s(8), 0.08)  # 8 streams at 12.5 messages/s each: 100 in all
    assert pacing.interval_s(100) == 0.25  # the budget would ask 1 s: a reader still gets 4 a second


def test_no_budget_keeps_every_stream_at_the_floor_and_a_floor_above_the_ceiling_wins() -> None:
    assert StreamPacing(floor_s=0.02).interval_s(1000) == 0.02
    assert StreamPacing(floor_s=0.5, messages_per_s=100, ceiling_s=0.25).interval_s(8) == 0.5


def test_a_final_only_caller_gets_nothing_between_its_first_output_and_its_end() -> None:
    assert StreamPacing(floor_s=0.02, messages_per_s=100).interval_s(1, final_only=True) == math.inf
