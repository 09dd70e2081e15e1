"""Re-measuring a step's thread count while the stage serves, on its own steps.

Owns: when to try the other count (after `period` steps of the kind, the period doubling while trials keep
confirming the count and starting over at `first_period` when one changes it), running a trial (the two
counts alternating in runs of `run_length` steps, in pairs of runs whose first takes turns (ABBA), so that
the machine's drift, the batch's slow growth and any fixed order of a request's steps fall on both alike;
only the last step of each run timed), and the verdict (the two counts' ratio of times per new token over
pairs of timed steps of about the same size, neighbours first, its median weighed by time; the fewer
threads when within `close`; a verdict against the count in use changes it only once a second trial, run
at once, agrees). Does not own applying a count, which kinds of step have trials, or the
start-up measurement (`step_threads.py`).

NOTE: a count measured once at start-up is measured while the other replicas on the node start too (each
importing torch and loading weights on the same cores), which can favour one thread; and what is fastest
under load differs from what is fastest alone. A trial costs a few steps at the slower count each period.

NOTE: the step right after a switch is not what the count costs while it serves: after a step at one thread
the other OpenMP threads have gone to sleep, and on a node whose other processes took the freed core
meanwhile the first step back at more threads waits, it seems, for them to get a core. Served, such steps ran up to
several times a settled step's time, and trials of single alternating steps chose one thread for decodes
that two made faster (docs/benchmarks.md). So decodes alternate in runs of two and only the second
step of each run counts; a prefill chunk, tens of milliseconds or more, runs alone (`run_length` 1).

NOTE: a verdict is a median over a few steps of a serving process that shares its cores; one trial of steps
that other processes happened to hit more at one count than the other can read the slower count as the
faster. A change wrongly made costs a whole period at the slower count, a second trial a few of its steps:
so a trial that would change the count is checked by another, and the count changes only when both agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

FIRST_PERIOD = 256  # steps of the kind before the first trial (steps)
LONGEST_PERIOD = 16384  # the period stops doubling here (steps)
TIMED_STEPS = 16  # timed steps of one trial, half at each count (steps)
RUN_LENGTH = 2  # steps at one count in a row within a trial; the last of each run is timed (steps)
MIN_PAIRS = 4  # pairs of same-size steps a verdict needs (pairs)
# a trial ends after MIN_PAIRS pairs when the count in use won every one of them by this factor past the verdict's
# boundary: the rest of the trial would only cost more steps at a count that plainly loses
DECISIVE = 1.25
CHANGES_KEPT = 256  # the latest changes a kind keeps (for stats and tests): a replica may serve for months


@dataclass
class ThreadTrials:
    counts: tuple[int, int]  # the two counts to choose between, e.g. (1, all of the stage's)
    close: float  # a count this much slower than the fastest still wins if it uses fewer threads
    first_period: int = FIRST_PERIOD  # steps of the kind before the first trial, and after a change (steps)
    # two steps compare when the larger has at most this fraction more new tokens than the smaller (0 = equal)
    size_tolerance: float = 0.0
    run_length: int = RUN_LENGTH  # steps at one count in a row within a trial, the last of them timed (steps)
    period: int = field(init=False)  # steps of the kind between trials now (steps)
    _since: int = 0  # steps of the kind since the last trial ended
    _trial: list[tuple[int, int, float]] | None = None  # (count, step size, seconds) of the trial's timed steps
    _trial_steps: int = 0  # steps of the trial so far, timed or not
    trials: int = 0  # trials finished (for stats and tests)
    changes: list[tuple[int, int]] = field(default_factory=list)  # (from, to) of the latest trials that changed it
    # the last trial's weighted median of (more threads' time per token / fewer's); None before the first trial
    # ends, or when too few of its pairs compared
    last_ratio: float | None = None
    # the count the last trial chose over the one in use, which the next trial (started at once) must choose
    # again before it is used; None when no change waits
    pending: int | None = None

    def __post_init__(self) -> None:
        self.period = self.first_period

    @property
    def trial_steps(self) -> int:
        """Steps of one trial, timed or not (steps)."""
        return TIMED_STEPS * self.run_length

    def soon(self, steps: int) -> None:
        """Have the next trial begin after at most `steps` more steps of the kind (the count in use is in
        doubt)."""
        self.period = min(self.period, self._since + steps)

    def count_for(self, current: int) -> int:
        """The count the coming step of the kind should use, given the chosen `current`."""
        if self._trial is None:
            if self._since < self.period:
                return current
            self._trial, self._trial_steps = [], 0
        other = self.counts[0] if current == self.counts[1] else self.counts[1]
        run = self._trial_steps // self.run_length
        other_first = (run // 2) % 2 == 0  # NOTE: ABBA: a kind's steps that come in a fixed order (a
        # request's first and second prefill chunk) fall on both counts alike
        return other if (run % 2 == 0) == other_first else current

    def observe(self, count: int, size: int, seconds: float, current: int) -> int:
        """Record a finished step of the kind (its count, its new tokens, its time) -> the chosen count."""
        if self._trial is None:
            self._since += 1
            return current
        self._trial_steps += 1
        if self._trial_steps % self.run_length == 0:  # the last of its run: the count settled
            self._trial.append((count, size, seconds))
        decided = self._trial_steps % (2 * self.run_length) == 0 and self._current_won_plainly(current)
        if self._trial_steps < self.trial_steps and not decided:
            return current
        self.last_ratio = more_over_fewer(self._trial, self.size_tolerance)
        chosen = choose(self.last_ratio, self.counts, current, self.close)
        self._trial, self._since, self.trials = None, 0, self.trials + 1
        if chosen != current and self.pending != chosen:
            self.pending, self.period = chosen, 0  # NOTE: the checking trial starts with the kind's next step
            return current
        self.pending = None
        if chosen == current:  # NOTE: a period shortened by `soon` (or by a check) doubles from `first_period` on
            self.period = min(max(2 * self.period, self.first_period), LONGEST_PERIOD)
        else:
            self.changes.append((current, chosen))
            del self.changes[:-CHANGES_KEPT]
            self.period = self.first_period
        return chosen

    def _current_won_plainly(self, current: int) -> bool:
        """Whether the trial so far has MIN_PAIRS pairs (or more) and `current` won each by DECISIVE past the
        verdict's boundary (`choose`). NOTE: only ever ends a trial that keeps the count: a change needs the
        whole trial and a second one."""
        assert self._trial is not None
        ratios = pair_ratios(self._trial, self.size_tolerance)
        if len(ratios) < MIN_PAIRS:
            return False
        boundary = 1 / (1 + self.close)  # more threads' time over fewer's at which the two counts tie
        if current == max(self.counts):
            return all(r * DECISIVE < boundary for r, _ in ratios)
        return all(r >= boundary * DECISIVE for r, _ in ratios)


def choose(ratio: float | None, counts: tuple[int, ...], current: int, close: float) -> int:
    """By a trial's `more_over_fewer` ratio: the fewer of `counts` when the more threads are within `close` of
    it or slower, else the more; `current` when the trial compared too little (None)."""
    if ratio is None:
        return current
    return min(counts) if ratio * (1 + close) >= 1 else max(counts)


def more_over_fewer(steps: Sequence[tuple[int, int, float]], tolerance: float = 0.0) -> float | None:
    """The more threads' time per new token over the fewer's, in a trial of alternating steps (count, size,
    seconds): over pairs of steps whose sizes differ by at most `tolerance` of the smaller (`pairs`), the
    median with each pair weighed by its faster step's time; None when fewer than MIN_PAIRS pairs compare.

    NOTE: weighed by time, since the count that serves is the one that takes less of it: a few slow steps (an
    image's prefill losing a thread to the node's other stages) outweigh many quick ones a little faster the
    other way; weighed by the faster step, so that one step stalled by chance (a pause of the process) moves the
    median by one quick pair's weight at most.
    """
    weighed = pair_ratios(steps, tolerance)
    return weighted_median(weighed) if len(weighed) >= MIN_PAIRS else None


def pair_ratios(steps: Sequence[tuple[int, int, float]], tolerance: float) -> list[tuple[float, float]]:
    """Per pair of comparable steps (`pairs`): (the more threads' time per token over the fewer's, the weight:
    the faster step's time in s)."""
    weighed: list[tuple[float, float]] = []
    for (count_a, size_a, a), (count_b, size_b, b) in pairs(steps, tolerance):
        (more, more_size), (fewer, fewer_size) = ((a, size_a), (b, size_b)) if count_a > count_b else \
            ((b, size_b), (a, size_a))
        if more > 0 and fewer > 0:
            more_as_fewer = more * fewer_size / more_size  # the more threads' time at the other step's size
            weighed.append((more_as_fewer / fewer, min(more_as_fewer, fewer)))
    return weighed


def weighted_median(values: Sequence[tuple[float, float]]) -> float:
    """The smallest value (of (value, weight) pairs) at which the weights of it and those below reach half."""
    ordered = sorted(values)
    half, total = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        total += weight
        if total >= half:
            return value
    return ordered[-1][0]


def pairs(steps: Sequence[tuple[int, int, float]],
          tolerance: float) -> list[tuple[tuple[int, int, float], tuple[int, int, float]]]:
    """Steps at different counts paired for comparison: each with its neighbour in the trial's ABBA order where
    their sizes compare; then each step left with the next one left at the other count whose size compares.

    NOTE: a workload of mixed requests (a short text prompt, then an image's long one) rarely puts two steps
    of a size next to each other; a trial that compared only neighbours decided nothing under it, however
    much one count lost. Neighbours first keep the drift of the machine and of the batch off the verdict where
    the steps allow it.
    """
    matched: list[tuple[tuple[int, int, float], tuple[int, int, float]]] = []
    left: list[int] = []
    for i in range(0, len(steps) - 1, 2):
        a, b = steps[i], steps[i + 1]
        if a[0] != b[0] and _comparable(a[1], b[1], tolerance):
            matched.append((a, b))
        else:
            left += [i, i + 1]
    left += [len(steps) - 1] if len(steps) % 2 else []
    while left:
        i = left.pop(0)
        j = next((j for j in left if steps[j][0] != steps[i][0] and _comparable(steps[i][1], steps[j][1], tolerance)),
                 None)
        if j is not None:
            left.remove(j)
            matched.append((steps[i], steps[j]))
    return matched


def _comparable(size_a: int, size_b: int, tolerance: float) -> bool:
    small, large = sorted((size_a, size_b))
    return small > 0 and large <= small * (1 + tolerance)
