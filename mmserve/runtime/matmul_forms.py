"""A step's products of activations and weights, `x @ w.T`, in the form this machine runs fastest.

Owns: the equivalent forms of the product (each one BLAS call, same result up to float rounding),
choosing one per row count and thread count by timing them at start-up on the model's own weights,
and the product itself (`forms(x, w)`). Does not own which threads a step uses (`step_threads.py`),
the weights (the model module), nor when to measure (the decoder, on a CPU).

NOTE: why: a decode step reads every weight once, so its products are matrix-vector-like, with the
weights coming from memory, and CPU BLAS libraries route such shapes differently. On one CPU
(docs/benchmarks.md) `F.linear` at 1-8 rows took 2.5-4x as long as the same product written as
`mm(w, x.T).T`, and one row was faster computed twice (two rows) than once; another CPU ranked the
forms differently. Hence a measurement on the machine, the model and the thread counts at hand.
NOTE: the forms are timed on a cycle of the model's weights in step order, at least `COLD_BYTES` of
them (or all), so that the weights are not in the CPU's caches between uses, as in a step.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Form = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows, in) x, (out, in) w -> (rows, out)
LINEAR = "linear"
CLOSE = 0.05  # another form must be this much faster than F.linear to be chosen (noise, not a win)
COLD_BYTES = 256 << 20  # NOTE: more than a core complex's last-level cache on today's server CPUs


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()  # (rows, out), a transposed view


def _doubled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, torch.cat((x, x)).t())[:, :1].t()  # one row as two: (1, out)


FORMS: dict[str, Form] = {LINEAR: _linear, "transposed": _transposed, "doubled": _doubled}


class MatmulForms:
    """`forms(x, w)` = `x @ w.T` for x (rows, in) and w (out, in), in the form chosen for x's row count
    under the thread count set by `use`; F.linear where nothing was chosen (the default everywhere).
    The result may be a non-contiguous view."""

    def __init__(self) -> None:
        self.chosen: dict[int, tuple[str, ...]] = {}  # threads -> form per row count (index = rows)
        self._forms: tuple[Form, ...] = ()  # the current thread count's forms, index = rows

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows, forms = x.shape[0], self._forms
        return forms[rows](x, w) if rows < len(forms) else F.linear(x, w)

    def use(self, threads: int) -> None:
        """The forms for steps run at `threads` torch threads (F.linear if none were measured for it)."""
        names = self.chosen.get(threads, ())
        self._forms = () if all(n == LINEAR for n in names) else tuple(FORMS[n] for n in names)

    def calibrate(self, weights: Sequence[torch.Tensor], thread_counts: Iterable[int], max_rows: int,
                  rounds: int = 5) -> None:
        """Choose a form for each row count 1..max_rows at each thread count, timing the products with a
        cycle of `weights` (in step order); leaves torch's thread count as it found it."""
        cycle = _cold_cycle(weights)
        before = torch.get_num_threads()
        try:
            for threads in sorted(set(thread_counts)):
                torch.set_num_threads(threads)
                self.chosen[threads] = (LINEAR, *(_fastest(cycle, rows, rounds) for rows in range(1, max_rows + 1)))
                log.info("matmul forms at %d threads, by rows 1..%d: %s", threads, max_rows,
                         ", ".join(self.chosen[threads][1:]))
        finally:
            torch.set_num_threads(before)
        self.use(before)


def _cold_cycle(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The first weights in step order that add up to `COLD_BYTES`, or all of them."""
    cycle, total = [], 0
    for w in weights:
        cycle.append(w)
        total += w.numel() * w.element_size()
        if total >= COLD_BYTES:
            break
    return cycle


def _fastest(cycle: list[torch.Tensor], rows: int, rounds: int) -> str:
    """The form whose products of `rows` rows with every weight of the cycle take least time; F.linear unless
    another beats it by more than CLOSE. Forms are timed in interleaved rounds (a warm-up first), so that
    the machine's drift falls on all alike."""
    names = [LINEAR, "transposed"] + (["doubled"] if rows == 1 else [])
    w0 = cycle[0]
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w0.dtype, device=w0.device) for w in cycle}
    timings: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(1 + rounds):
        for name in names:
            form = FORMS[name]
            started = time.perf_counter()
            for w in cycle:
                form(xs[w.shape[1]], w)
            if round_:
                timings[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) for name, t in timings.items()}
    best = min(medians, key=medians.__getitem__)
    return LINEAR if medians[LINEAR] <= medians[best] * (1 + CLOSE) else best
