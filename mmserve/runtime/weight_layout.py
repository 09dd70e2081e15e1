"""Whether the decoder's weights are packed for oneDNN, chosen again while serving by the steps it runs.

Owns: the rule (`LayoutPolicy`: what the layout in place has lost to the other on the steps run, priced
with the start-up timings of both, against what a change costs) and the change itself, one weight per
step (`WeightLayout`). Does not own the timings or the products (`matmul_forms.py`), the weights (the
model module's `relayout_weight`), nor which threads a step uses (`step_threads.py`).

NOTE: why: a decode step reads every weight once, and how fast oneDNN's packed product is against a
plain one depends on the rows. On one CPU (docs/benchmarks.md) packed weights took ~1.4x the plain
form's time at 1 row and ~0.75x at 8, so the start-up choice, one layout for every row count, made a
lone client's decode ~25% slower to make a batch of 8 faster. Which row counts matter is known only
once requests come: one client decodes 1 row a step, a loaded server 8 or more.
NOTE: the rule is rent-or-buy: the time the layout in place loses to the other, summed over the steps
since it last did not (a step where it wins by more than `close` takes back from the sum, down to 0), is
weighed against the time re-laying every weight takes; once the loss reaches it, the layout changes. A
change then never costs more than what staying would have lost, whatever the machine, model or load,
and a mix near the balance changes nothing. The weights are re-laid one per step, so that no step
stalls on a whole model's reorder, and the re-lays are timed for the next decision.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from mmserve.runtime.matmul_forms import CLOSE, MatmulForms

log = logging.getLogger(__name__)

Costs = dict[int, dict[int, tuple[float, float]]]  # threads -> rows -> (plain s, packed s), as timed at start-up


def step_costs(costs: Costs, threads: int, rows: int) -> tuple[float, float]:
    """(plain, packed) seconds of a step's products at `rows` rows and `threads` threads, from the nearest
    timed thread count and the nearest timed row count (in ratio), scaled by rows to it."""
    count = min(costs, key=lambda c: abs(c - threads))
    table = costs[count]
    timed = min(table, key=lambda r: abs(math.log(r / rows)))
    plain, packed = table[timed]
    scale = rows / timed
    return plain * scale, packed * scale


class LayoutPolicy:
    """The loss of the layout in place against the other, step by step, and whether it is time to change.

    `costs` are the start-up timings of a share `timed_share` of the weights' bytes; `change_s` is what
    re-laying every weight costs (s)."""

    def __init__(self, costs: Costs, *, timed_share: float, change_s: float, close: float) -> None:
        if not costs or not all(costs.values()):
            raise ValueError("the layout policy needs the start-up timings of both layouts")
        self.costs, self.timed_share, self.change_s, self.close = costs, timed_share, change_s, close
        self.loss = 0.0  # s the layout in place lost to the other since it last did not

    def excess(self, rows: int, threads: int, packed_now: bool) -> float:
        """What a step of `rows` rows at `threads` threads loses in the layout in place against the other,
        beyond `close` of the other's time (s; negative where the layout in place wins or ties)."""
        plain, packed = step_costs(self.costs, threads, rows)
        now, other = (packed, plain) if packed_now else (plain, packed)
        return (now - other * (1 + self.close)) / self.timed_share

    def observe(self, rows: int, threads: int, packed_now: bool) -> None:
        self.loss = max(0.0, self.loss + self.excess(rows, threads, packed_now))

    def due(self) -> bool:
        """Whether staying has lost as much as changing costs (and something was lost at all)."""
        return self.loss > 0 and self.loss >= self.change_s


class WeightLayout:
    """Drives a model's weights to the layout its policy chooses, one weight per step, on the step thread.

    `packing(rows | None)` sets the layout new and re-laid weights take (`MatmulForms.packing`);
    `relayout(i)` re-lays the model's i-th weight in it; `pack_rows` is the hint to pack with."""

    def __init__(self, policy: LayoutPolicy, *, num_weights: int, packed: bool, pack_rows: int,
                 packing: Callable[[int | None], None], relayout: Callable[[int], None]) -> None:
        self.policy, self.num_weights, self.packed, self.pack_rows = policy, num_weights, packed, pack_rows
        self._packing, self._relayout = packing, relayout
        self._next = num_weights  # the next weight to re-lay; num_weights = all in the chosen layout
        self._relaying_s = 0.0  # the re-lays of the change under way so far (s)
        self.changes: list[bool] = []  # the layouts taken while serving, in order (True = packed)

    @property
    def settled(self) -> bool:
        return self._next >= self.num_weights

    def after_step(self, rows: int, threads: int) -> None:
        """A step of `rows` rows at `threads` threads has run: re-lay one weight, or count it and maybe change."""
        if not self.settled:
            self._relay_next()
            return
        self.policy.observe(rows, threads, self.packed)
        if self.policy.due():
            self.take(not self.packed)

    def take(self, packed: bool, *, at_once: bool = False) -> None:
        """Go to `packed` (or plain): from the next step on, one weight per step; `at_once`: all now."""
        if packed == self.packed:
            return
        log.info("decoder weights: %s from now on (the other layout lost %.1f ms on the steps since it was "
                 "chosen; a change takes ~%.1f ms)", "packed for oneDNN" if packed else "plain",
                 self.policy.loss * 1e3, self.policy.change_s * 1e3)
        self.packed, self.policy.loss = packed, 0.0
        self.changes.append(packed)
        self._packing(self.pack_rows if packed else None)
        self._next, self._relaying_s = 0, 0.0
        if at_once:
            self.finish()

    def finish(self) -> None:
        """Re-lay now whatever weights the change under way has not reached yet."""
        while not self.settled:
            self._relay_next()

    def _relay_next(self) -> None:
        started = time.perf_counter()
        self._relayout(self._next)
        self._relaying_s += time.perf_counter() - started
        self._next += 1
        if self.settled:  # NOTE: the next change is priced with this one's measured cost
            self.policy.change_s = self._relaying_s


def weight_layout(forms: MatmulForms, num_weights: int, relayout: Callable[[int], None]) -> WeightLayout | None:
    """The layout of a model's weights (`forms`' products; `relayout(i)` re-lays its i-th weight) chosen again
    while serving; None where it cannot change (packing was not timed at start-up)."""
    if forms.pack_hint is None or not forms.costs:
        return None
    policy = LayoutPolicy(forms.costs, timed_share=forms.timed_share, change_s=forms.pack_seconds, close=CLOSE)
    return WeightLayout(policy, num_weights=num_weights, packed=forms.pack_rows is not None,
                        pack_rows=forms.pack_hint, packing=forms.packing, relayout=relayout)
