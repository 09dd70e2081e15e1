"""A request's own time in a stage, phase by phase, reported with the stage's answer.

Owns: `Timeline`, which marks the phases of one request's work in one stage on one clock, and gathers the
phases a stage it called reported (`PhaseTimes`, the wire form in mmserve.messages). With them a caller
tells a stage's work from the hop that carried it: a call's round trip less the callee's own time is the
hop. Does not own which phases a stage marks (each names its own, `stage.phase`) nor how they are shown
(the ingress's `Server-Timing` header, scripts/bench_path.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mmserve.messages import PhaseTimes


class Timeline:
    """Phases marked in the order they end; each lasts from the previous mark (or the start) to its own."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._start = self._last = clock()  # (s)
        self._phases: list[tuple[str, float]] = []

    def mark(self, name: str) -> float:
        """End the phase `name` now -> its length (ms)."""
        now = self._clock()
        ms = (now - self._last) * 1e3
        self._phases.append((name, ms))
        self._last = now
        return ms

    def since_start(self, name: str) -> float:
        """Record `name` as everything from the start to now (a stage's whole time), without ending a phase."""
        ms = (self._clock() - self._start) * 1e3
        self._phases.append((name, ms))
        return ms

    def add(self, phases: PhaseTimes) -> None:
        """Phases another stage reported (they lie inside one of this timeline's, which still ends at its mark)."""
        self._phases.extend(phases)

    @property
    def phases(self) -> PhaseTimes:
        return tuple(self._phases)
