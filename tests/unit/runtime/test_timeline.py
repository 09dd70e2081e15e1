"""Timeline: phases marked on one clock, a stage's whole time, and a callee's phases gathered in order."""

from __future__ import annotations

import pytest

from mmserve.runtime.timeline import Timeline


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0  # (s)

    def __call__(self) -> float:
        return self.now


def test_each_phase_lasts_from_the_previous_mark_and_a_callee_s_phases_sit_where_they_came():
    clock = FakeClock()
    timeline = Timeline(clock)
    clock.now += 0.004
    assert timeline.mark("a.first") == pytest.approx(4.0)
    clock.now += 0.010
    timeline.add((("b.replica", 7.5),))  # reported by a stage called during the next phase
    clock.now += 0.002
    assert timeline.mark("a.second") == pytest.approx(12.0)  # the callee's report does not end a phase
    clock.now += 0.001
    assert timeline.since_start("a.replica") == pytest.approx(17.0)
    clock.now += 0.003
    assert timeline.mark("a.third") == pytest.approx(4.0)  # since_start ended no phase either
    assert [name for name, _ in timeline.phases] == ["a.first", "b.replica", "a.second", "a.replica", "a.third"]
    assert [ms for _, ms in timeline.phases] == pytest.approx([4.0, 7.5, 12.0, 17.0, 4.0])
