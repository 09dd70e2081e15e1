"""A request's `Server-Timing` header: where its time went on the way to its first output, as the ingress saw it.

Owns: the header's phases and their order. Does not own the timing itself (`mmserve/runtime/timeline.py`)
nor what each stage reports of its own phases (each stage adds its own to its answer).
"""

from __future__ import annotations

from mmserve.messages import PhaseTimes
from mmserve.runtime.timeline import Timeline


class ServerTiming:
    """A request's way to its first token as a `Server-Timing` header (ms): `parse`, `preprocess` (that round
    trip), `first` (the Decoder's stream to its first output), a `retry` before each attempt after a lost
    replica; then, with `stages`, each stage's own phases from that output (mmserve/runtime/timeline.py).

    NOTE: a non-streamed request is retried whole, so its `retry` may hold a lost attempt's decode, and with
    `stages` the phases of every attempt's first output are listed, the lost ones' too, in attempt order.
    NOTE: the stages' phases are off by default: they tell a client whether a cache held an image.
    """

    def __init__(self, stages: bool) -> None:
        self._timeline = Timeline()
        self._stages = stages

    def mark(self, name: str) -> None:
        self._timeline.mark(name)

    def add(self, phases: PhaseTimes) -> None:
        if self._stages:
            self._timeline.add(phases)

    def header(self) -> dict[str, str]:
        return {"Server-Timing": ", ".join(f"{name};dur={ms:.3f}" for name, ms in self._timeline.phases)}
