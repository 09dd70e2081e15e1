"""Whether the decoder's weights are packed for oneDNN, chosen again while serving by the steps it runs.

Owns: the rule (`LayoutPolicy`: what the layout in place has lost to the other on the steps run, priced
with the start-up timings of both, against what a change costs) and the change itself, one weight at a
time (`WeightLayout`). Does not own the timings (whole steps, `layout_steps.py`; where none ran, the
products alone, `matmul_forms.py`), the products, the weights (the model module's `relayout_weight`), when
a weight is re-laid (the decoder, between steps), nor which threads a step uses (`step_threads.py`).

NOTE: why: a decode step reads every weight once, and how fast oneDNN's packed product is against a
plain one depends on the rows: on one CPU packed weights were slower than the best plain form at 1 row
and faster at 8 (docs/benchmarks.md), so the start-up choice, one layout for every row count, either
slows a lone client's decodes or a loaded server's. Which row counts matter is known only once requests
come: one client decodes 1 row a step, a loaded server 8 or more.
NOTE: the rule is rent-or-buy: what the layout in place loses to the other beyond `close` of the other's
time, summed over the steps (a step where it loses less, or wins, takes back from the sum, down to 0), is
weighed against what re-laying every weight takes; once the loss reaches it, the layout changes. By the
timings, a change then never costs more than staying lost, whatever the machine, model or load, and a
mix near the balance changes nothing. Each direction's cost is timed at start-up, then as the last change
that way took.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable

from mmserve.runtime.matmul_forms import CLOSE, MatmulForms
from mmserve.runtime.thread_trials import CHANGES_KEPT

log = logging.getLogger(__name__)

# threads -> rows -> (plain s, packed s), as timed at start-up: whole steps, or a share of the products alone
Costs = dict[int, dict[int, tuple[float, float]]]


def step_costs(costs: Costs, threads: int, rows: int) -> tuple[float, float]:
    """(plain, packed) seconds of a step (or its products) at `rows` rows and `threads` threads, from the nearest
    timed thread count: between two timed row counts, interpolated; past the largest, scaled by rows (bound
    by arithmetic there); below the smallest, the smallest's (bound by reading the weights)."""
    table = costs[min(costs, key=lambda c: abs(c - threads))]
    timed = sorted(table)
    if rows >= timed[-1]:
        plain, packed = table[timed[-1]]
        return plain * rows / timed[-1], packed * rows / timed[-1]
    at = bisect.bisect_left(timed, rows)
    if at == 0 or timed[at] == rows:
        return table[timed[at]]
    low, high = timed[at - 1], timed[at]
    share = (rows - low) / (high - low)
    (p0, k0), (p1, k1) = table[low], table[high]
    return p0 + share * (p1 - p0), k0 + share * (k1 - k0)


class LayoutPolicy:
    """The loss of the layout in place against the other, step by step, and whether it is time to change.

    `costs` are the start-up timings: whole steps (`timed_share` 1), or the products of a share `timed_share`
    of the weights' bytes; `change_s[packed]` is what re-laying every weight packed (True) or plain (False)
    costs (s). NOTE: `close` is a share of what was timed: of whole steps, it holds what the layouts share
    (attention, the lm_head) too, a wider margin for the same products."""

    def __init__(self, costs: Costs, *, timed_share: float, change_s: dict[bool, float], close: float) -> None:
        if not costs or not all(costs.values()):
            raise ValueError("the layout policy needs the start-up timings of both layouts")
        self.timed_share, self.change_s, self.close = timed_share, dict(change_s), close
        self.costs = costs
        self.loss = 0.0  # s the layout in place lost to the other (beyond `close`) since the sum last hit 0

    @property
    def costs(self) -> Costs:
        return self._costs

    @costs.setter
    def costs(self, costs: Costs) -> None:
        self._costs = costs
        # NOTE: (threads, rows) -> `step_costs`, priced once: a server runs few distinct sizes, every step
        self._priced: dict[tuple[int, int], tuple[float, float]] = {}

    def excess(self, rows: int, threads: int, packed_now: bool) -> float:
        """What a step of `rows` rows at `threads` threads loses in the layout in place against the other,
        beyond `close` of the other's time (s; negative where it loses less, or wins)."""
        priced = self._priced.get((threads, rows))
        if priced is None:
            priced = self._priced[(threads, rows)] = step_costs(self.costs, threads, rows)
        plain, packed = priced
        now, other = (packed, plain) if packed_now else (plain, packed)
        return (now - other * (1 + self.close)) / self.timed_share

    def observe(self, rows: int, threads: int, packed_now: bool) -> None:
        self.loss = max(0.0, self.loss + self.excess(rows, threads, packed_now))

    def due(self, packed_now: bool) -> bool:
        """Whether staying has lost as much as changing to the other layout costs (and something at all)."""
        return self.loss > 0 and self.loss >= self.change_s[not packed_now]

    def freeze(self) -> None:
        """No change from now on (a change that failed; a benchmark's timed steps)."""
        self.change_s = {True: math.inf, False: math.inf}


class WeightLayout:
    """Drives a model's weights to the layout its policy chooses, one weight per `relay_one` call.

    `packing(rows | None)` sets the layout new and re-laid weights take (`MatmulForms.packing`);
    `relayout(i)` re-lays the model's i-th weight in it; `all_plain()` says that every weight is plain again
    (`MatmulForms.all_plain`); `pack_rows` is the hint to pack with. Every call comes from the step thread,
    between forwards."""

    def __init__(self, policy: LayoutPolicy, *, num_weights: int, packed: bool, pack_rows: int,
                 packing: Callable[[int | None], None], relayout: Callable[[int], None],
                 all_plain: Callable[[], None] = lambda: None) -> None:
        self.policy, self.num_weights, self.packed, self.pack_rows = policy, num_weights, packed, pack_rows
        self._packing, self._relayout, self._all_plain = packing, relayout, all_plain
        self._next = num_weights  # the next weight to re-lay; num_weights = all in the chosen layout
        self._relaying_s = 0.0  # the re-lays of the change under way so far (s)
        self.changes: list[bool] = []  # the latest layouts taken while serving, in order (True = packed)

    @property
    def settled(self) -> bool:
        return self._next >= self.num_weights

    def observe(self, rows: int, threads: int) -> None:
        """A step of `rows` rows at `threads` threads has run: price it, and change the layout when due (the
        weights follow, one per `relay_one`). Steps while a change is under way are not priced."""
        if not self.settled:
            return
        self.policy.observe(rows, threads, self.packed)
        if self.policy.due(self.packed):
            self.take(not self.packed)

    def take(self, packed: bool, *, at_once: bool = False) -> None:
        """Go to `packed` (or plain): the weights follow one per `relay_one`; `at_once`: all now."""
        if packed == self.packed:
            return
        log.info("decoder weights: %s from now on (the other layout lost %.1f ms beyond %.0f%% of this one's; "
                 "a change takes ~%.1f ms)", "packed for oneDNN" if packed else "plain", self.policy.loss * 1e3,
                 self.policy.close * 100, self.policy.change_s[packed] * 1e3)
        self.packed, self.policy.loss = packed, 0.0
        self.changes.append(packed)
        del self.changes[:-CHANGES_KEPT]
        self._packing(self.pack_rows if packed else None)
        self._next, self._relaying_s = 0, 0.0
        if at_once:
            self.finish()

    def relay_one(self) -> None:
        """Re-lay the next weight of a change under way, if any. A re-lay that fails (e.g. memory for the new
        copy) ends the change where it is, for good: each product follows its own weight's layout."""
        if self.settled:
            return
        started = time.perf_counter()
        try:
            self._relayout(self._next)
        except Exception:
            log.exception("decoder weights: re-laying weight %d failed; the layout stays as it is", self._next)
            self._next = self.num_weights
            self.policy.freeze()
            return
        self._relaying_s += time.perf_counter() - started
        self._next += 1
        if self.settled:  # NOTE: the next change this way is priced at what this one took
            self.policy.change_s[self.packed] = self._relaying_s
            self._all_in_place()

    def relay_all(self, packed: bool) -> None:
        """Re-lay every weight `packed` (or plain) now, whatever layout each is in, outside the policy
        (start-up timings: no change is recorded or priced)."""
        self.finish()
        self.packed = packed
        self._packing(self.pack_rows if packed else None)
        for index in range(self.num_weights):
            self._relayout(index)
        self._all_in_place()

    def _all_in_place(self) -> None:
        if not self.packed:
            self._all_plain()

    def finish(self) -> None:
        """Re-lay now whatever weights the change under way has not reached yet."""
        while not self.settled:
            self.relay_one()


def weight_layout(forms: MatmulForms, num_weights: int, relayout: Callable[[int], None]) -> WeightLayout | None:
    """The layout of a model's weights (`forms`' products; `relayout(i)` re-lays its i-th weight) chosen again
    while serving; None where it cannot change (packing was not timed at start-up)."""
    if forms.pack_hint is None or not forms.costs:
        return None
    policy = LayoutPolicy(forms.costs, timed_share=forms.timed_share, change_s=forms.relayout_seconds, close=CLOSE)
    return WeightLayout(policy, num_weights=num_weights, packed=forms.pack_rows is not None,
                        pack_rows=forms.pack_hint, packing=forms.packing, relayout=relayout,
                        all_plain=forms.all_plain)
