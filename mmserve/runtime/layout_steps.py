"""The decoder weights' two layouts priced by whole steps at start-up (on a CPU).

Owns: timing a few steps (one per row count: decodes of 1, 2, 4, ... sequences, a prefill chunk) at every
thread count a step may run with, in both layouts, and handing the layout policy those timings (its
`costs`, now in whole-step seconds) and what each change took. Does not own the steps (the decoder's
scratch sequences, `decoder/thread_calibration.py`), the policy and the change (`weight_layout.py`), nor
the products' own timings (`matmul_forms.py`), which still choose the plain forms and the start-up layout.

NOTE: why: products timed alone, back to back, can misprice them inside a step: on one CPU they ranked
the two layouts about even at 8 rows, where whole decode steps of 8 sequences ran clearly faster with
packed weights (docs/benchmarks.md, "The weights' layout priced by whole steps"). What a step runs between
its products, and what they leave in the caches, is only in a step, so the policy weighs whole steps.
NOTE: the blocks of steps go A B B A (the layout in place first): a drift of the machine falls on both
layouts alike, and the weights end in the layout they started in, re-laid twice a round.
NOTE: a step's time scatters by tens of percent on a busy or virtual CPU, so each cell is the median of
2 * ROUNDS * PER_BLOCK steps. Its cost: 2 * (2 * ROUNDS * PER_BLOCK + 1) steps of every shape (6 by
default) at every thread count a step may run with (1 and all where the threads are measured), and
2 * ROUNDS re-lays of every weight: several times the threads' own timing, ~3 s on the benchmark
checkpoint on 2 cores (docs/benchmarks.md). Within a block the shape changes every PER_BLOCK steps, so a
decode group's kept gathers (`kept_gather.py`) are copied whole on its first step, in both layouts alike.
What other processes took of the cores meanwhile is logged beside the prices; it falls on both layouts
alike, A B B A.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable

from mmserve.runtime.core_company import CoreCompany
from mmserve.runtime.step_threads import StepThreads
from mmserve.runtime.weight_layout import Costs, WeightLayout

log = logging.getLogger(__name__)
ROUNDS = 2  # A B B A rounds: each shape is timed in 2 * ROUNDS blocks in each layout ...
PER_BLOCK = 2  # ... this many steps in a row each time


def price_by_steps(layout: WeightLayout, threads: StepThreads, steps: dict[int, Callable[[], object]], *,
                   rounds: int = ROUNDS, per_block: int = PER_BLOCK,
                   clock: Callable[[], float] = time.perf_counter) -> None:
    """Time each of `steps` (rows -> a step computing that many new tokens) at every count of
    `threads.possible_counts()` in both layouts, `per_block` in a row in each block (one untimed step of
    each first in each layout), and make `layout`'s policy weigh the medians: threads -> rows -> (plain s,
    packed s), a change priced at what its last re-lay took. A failure leaves the policy as it was, frozen,
    with every weight re-laid as it began where that works."""
    counts = sorted(threads.possible_counts())
    start = layout.packed
    timed: dict[tuple[int, int, bool], list[float]] = {}
    company = CoreCompany()  # NOTE: logged: both layouts' steps share what others took (A B B A)
    company.start()
    layout.finish()  # NOTE: a change under way would time its re-lays into the policy
    change_s = dict(layout.policy.change_s)
    frozen = all(math.isinf(s) for s in change_s.values())  # NOTE: a policy frozen before stays so
    layout.policy.freeze()  # NOTE: no change of its own meanwhile, were these steps priced (a layout already in use)
    try:
        for packed in [start, not start, not start, start] * rounds:
            if packed != layout.packed:
                began = clock()
                layout.relay_all(packed)
                change_s[packed] = clock() - began
            for count in counts:
                with threads.pinned(count):
                    for rows, step in steps.items():
                        _time(step, timed.setdefault((count, rows, packed), []), per_block, clock)
    except Exception:
        log.exception("decoder weights: timing the layouts by whole steps failed; they stay %s for good",
                      "as they were" if _back(layout, start) else "as they are")
        layout.policy.freeze()
        return
    finally:
        company.stop()
    costs: Costs = {count: {rows: (statistics.median(timed[(count, rows, False)]),
                                   statistics.median(timed[(count, rows, True)])) for rows in steps}
                    for count in counts}
    layout.policy.costs, layout.policy.timed_share, layout.policy.loss = costs, 1.0, 0.0
    if not frozen:
        layout.policy.change_s = change_s
    others = company.others()
    log.info("decoder weights priced by whole steps (ms plain / packed; rows at threads): %s; a change takes "
             "%.1f ms to packed, %.1f ms to plain%s; other processes kept %s cores busy meanwhile", "; ".join(
                 f"{rows} at {count}: {plain * 1e3:.2f} / {packed * 1e3:.2f}"
                 for count, table in costs.items() for rows, (plain, packed) in table.items()),
             change_s[True] * 1e3, change_s[False] * 1e3, " (frozen before: no change)" if frozen else "",
             "?" if others is None else f"{others:.2f}")


def _time(step: Callable[[], object], times: list[float], n: int, clock: Callable[[], float]) -> None:
    """Run `step` `n` times in a row, each one's time onto `times`; an untimed one first where `times` has none
    yet (NOTE: the layout's first step of this shape: oneDNN's set-up)."""
    if not times:
        step()
    for _ in range(n):
        began = clock()
        step()
        times.append(clock() - began)


def _back(layout: WeightLayout, packed: bool) -> bool:
    """Re-lay every weight `packed` (or plain) again, a re-lay that failed may have left some either way ->
    whether that worked."""
    try:
        layout.relay_all(packed)
        return True
    except Exception:
        log.exception("decoder weights: re-laying them back failed; each product follows its own weight's layout")
        return False
