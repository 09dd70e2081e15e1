"""How many CPU threads torch may use for one step of a stage, measured rather than guessed.

Owns: the count per step (a small step, i.e. decodes, and a big one, i.e. prefill chunks, may differ;
among decodes, a light one and a heavy one, by the context rows they attend), choosing a count the
config leaves open by timing a few steps at 1 and at all of the stage's threads on the loaded model
(and again while serving, on each kind's own steps: `thread_trials.py`), taking fewer while work the
stage waits for computes on the same cores (`beside`: an encode on this host's CPU, `shared_cores.py`),
and applying it in the calling thread. Does not own what a step computes (the runners) nor the process-wide
default (set by whoever starts the stage, e.g. a Ray replica from its stage's `torch_threads`).

NOTE: decodes differ in work by more than their token count: a batch of 8 at 8k tokens of context reads
hundreds of times the keys of one short sequence, and a second thread that changes nothing for the light
one made the heavy one several times faster on one CPU (docs/benchmarks.md). So a
decode attending more than `heavy_rows` context rows (the geometric mean of the two measured decodes')
takes the heavy count.

NOTE: torch's thread count is per calling thread (OpenMP's nthreads ICV), but `torch.set_num_threads`
also changes the default that threads started later begin with. So every stage sets its count in
its own step thread before each step: in the in-process Engine the encoder's step thread, started
after a decode step chose 1, would otherwise run the vision tower on one thread.

NOTE: whether a second thread speeds up a decode step depends on the CPU (memory bandwidth per core,
the cost of waking a thread per kernel): the same VM kind has measured either way (docs/benchmarks.md).
Hence a measurement on the machine and model at hand, not a constant.

NOTE: a measurement taken while other processes filled the cores (in a Ray app: the other replicas of
the node importing torch and loading weights) times the all-threads arm with a core missing, and picks
one thread for the wrong reason. So the start-up measurement also reads how much of the cores others
took meanwhile (`core_company.py`); where they left the all-threads arm less than its threads (less half a
core), its verdict is not trusted: the kind keeps all of the stage's threads, torch's own default, and
its first trial while serving comes after a few steps instead of hundreds.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from mmserve.config import DecoderConfig
from mmserve.runtime.core_company import MIN_WALL_S, CoreCompany, usable_cores
from mmserve.runtime.thread_trials import ThreadTrials

log = logging.getLogger(__name__)
CLOSE = 0.05  # a count this much slower than the fastest still wins if it uses fewer threads (a core saved)
SMALL, HEAVY, BIG = "small", "heavy", "big"  # the kinds of step, each with its own count (attribute names)
# NOTE: a request makes one prefill chunk or a few and hundreds of decodes: the chunks' first trial comes
# after a few requests, not hundreds, and compares chunks of about the same size (prompts differ)
BIG_FIRST_PERIOD = 16  # big steps before their first trial (steps)
BIG_SIZE_TOLERANCE = 0.25  # two chunks compare per token when one has at most 25% more tokens
# a start-up measurement is not trusted when others left the all-threads arm fewer free cores than its
# threads less this (cores): half a core, more than a quiet node's background and less than one process
BUSY_MARGIN = 0.5
UNTRUSTED_FIRST_PERIOD = 16  # steps of a kind whose start-up measurement was not trusted before its trial


class StepThreads:
    def __init__(self, device: torch.device, config: DecoderConfig | None = None):
        self.enabled = device.type == "cpu"
        self.cores = usable_cores()  # cores this process may compute on at once (fixed for its life)
        self.available = self._stage_count()  # the stage's count
        self.small_step_tokens = config.small_step_tokens if config is not None else 0
        self.small = config.small_step_threads if config is not None else self.available
        self.big = config.big_step_threads if config is not None else self.available
        # heavy decodes: their own count only when the light one is measured (a configured count holds for all)
        self.heavy: int | None = None if self.small is None else self.small
        self.heavy_rows = 0  # decodes attending more context rows than this are heavy; 0 = none are (rows)
        if self.available == 1:  # nothing to choose between
            self.small, self.big, self.heavy = self.small or 1, self.big or 1, self.heavy or 1
        # each kind measured at start-up -> the cores others kept busy meanwhile, None where unknown (cores)
        self.company: dict[str, float | None] = {}
        self.voided: set[str] = set()  # the kinds whose measurement that company voided
        self.medians_ms: dict[str, dict[int, float]] = {}  # each kind measured -> median step by count (ms)
        # a count the config left open is re-measured while serving, on that kind's own steps
        self.trials = self._open_trials() if self.enabled else {}
        # at most this many threads while `beside()` says other work computes on these cores (None: no limit)
        self.beside_count = config.threads_beside_encodes if config is not None else None
        self.beside: Callable[[], bool] = lambda: False  # set by the owner (decoder/service.py: encodes here)
        self._yielded = False  # whether the step `apply` set up yields to that work (no trial sees it)

    def _stage_count(self) -> int:
        """torch's threads when the stage was built; on a CPU, at most the cores this process may compute on at
        once. NOTE: threads past a CPU quota (a container's limit) gain nothing and are throttled all at once;
        the in-process Engine runs at torch's default, one thread per core the affinity shows."""
        count = torch.get_num_threads()
        if self.enabled and count > self.cores:
            log.warning("step threads: torch's %d (the stage's torch_threads, or torch's default) capped at the %d "
                        "cores this process may compute on at once (its CPU affinity within its CPU quota)",
                        count, self.cores)
            return self.cores
        return count

    def _open_trials(self) -> dict[str, ThreadTrials]:
        counts = (1, self.available)
        trials = {kind: ThreadTrials(counts, CLOSE) for kind in (SMALL, HEAVY) if self.small is None}
        if self.big is None:
            trials[BIG] = ThreadTrials(counts, CLOSE, BIG_FIRST_PERIOD, BIG_SIZE_TOLERANCE, run_length=1)
        return trials

    def kind(self, num_new_tokens: int, attended: int = 0) -> str:
        """SMALL, HEAVY or BIG: the kind of a step computing `num_new_tokens` tokens (all sequences together)
        that attends `attended` context rows (the sequences' lengths after the step, summed)."""
        if not self._is_small(num_new_tokens):
            return BIG
        return HEAVY if self._is_heavy(attended) else SMALL

    def threads_for(self, num_new_tokens: int, attended: int = 0) -> int:
        """Threads for a step computing `num_new_tokens` tokens that attends `attended` context rows."""
        chosen: int | None = getattr(self, self.kind(num_new_tokens, attended))
        return min(chosen or self.available, self.available)

    def leaves_a_core(self, num_new_tokens: int, attended: int = 0) -> bool:
        """Whether such a step leaves the host a core for other work while it runs: always off the CPU (the
        forward runs on the accelerator), else when its threads are fewer than the cores this process may
        compute on at once (`usable_cores`)."""
        return not self.enabled or self.threads_for(num_new_tokens, attended) < self.cores

    def apply(self, num_new_tokens: int, attended: int = 0) -> int:
        """Set torch's threads for the coming step in the calling thread (no-op off CPU) -> the count: its
        kind's, or its trial's, or at most `beside_count` while other work computes on these cores (`beside`:
        no trial runs or counts such a step, whatever the kind's count)."""
        wanted = self.threads_for(num_new_tokens, attended)
        limit = self.beside_count if self.enabled and self.beside() else None
        self._yielded = limit is not None
        trial = None if self._yielded else self._trial(num_new_tokens, attended)
        if limit is not None:
            wanted = min(wanted, limit)
        elif trial is not None:
            wanted = trial[0].count_for(trial[1])
        if self.enabled and torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        return wanted

    def observe(self, num_new_tokens: int, seconds: float, count: int, attended: int = 0) -> None:
        """A step `apply` set up took `seconds` at `count` threads (fed to its kind's trials; CPU only)."""
        trial = None if self._yielded else self._trial(num_new_tokens, attended)
        if trial is not None:
            trials, current = trial
            finished = trials.trials
            chosen = trials.observe(count, num_new_tokens, seconds, current)
            if trials.trials == finished:
                return
            kind, ratio = self.kind(num_new_tokens, attended), trials.last_ratio
            # NOTE: every trial's figure, not only a change's: what the served steps showed is the evidence
            log.info("step threads: %d for %s steps, measured while serving (was %d; %s)%s", chosen, kind, current,
                     "too few steps of a size to compare" if ratio is None else
                     f"{self.available} threads took {ratio:.2f}x 1 thread's time per token",
                     "" if trials.pending is None else f"; {trials.pending} only if the trial that starts now agrees")
            if chosen != current:
                setattr(self, kind, chosen)

    def _is_small(self, num_new_tokens: int) -> bool:
        return num_new_tokens <= self.small_step_tokens

    def _is_heavy(self, attended: int) -> bool:
        return 0 < self.heavy_rows < attended

    def _trial(self, num_new_tokens: int, attended: int) -> tuple[ThreadTrials, int] | None:
        """(the trials of this step's kind, its chosen count), or None where its count is configured or not
        chosen yet."""
        kind = self.kind(num_new_tokens, attended)
        trials, current = self.trials.get(kind), getattr(self, kind)
        return None if trials is None or current is None else (trials, current)

    @property
    def trials_run(self) -> int:
        return sum(t.trials for t in self.trials.values())

    def changes(self) -> list[tuple[str, int, int]]:
        """(kind, from, to) of every trial that changed a count."""
        return [(kind, a, b) for kind, t in self.trials.items() for a, b in t.changes]

    def possible_counts(self) -> set[int]:
        """Every thread count a step may run with, now or after a trial: the configured or chosen ones, and 1
        and all where one is open or tried while serving."""
        counts = {min(c, self.available) for c in (self.small, self.heavy, self.big, self.beside_count)
                  if c is not None}
        return counts | ({1, self.available} if self.small is None or self.big is None or self.trials else set())

    @contextmanager
    def pinned(self, count: int) -> Iterator[None]:
        """Every step at `count` threads meanwhile, whatever its kind, with no trial run or fed (start-up
        timings of something else than the threads: `layout_steps.py`)."""
        saved = self.small, self.heavy, self.big, self.trials
        self.small = self.heavy = self.big = count
        self.trials = {}
        try:
            yield
        finally:
            self.small, self.heavy, self.big, self.trials = saved
            torch.set_num_threads(self.available)

    @property
    def needs_calibration(self) -> bool:
        return self.enabled and (self.small is None or self.big is None)

    def calibrate(self, small_step: Callable[[], object], big_step: Callable[[], object],
                  heavy_step: tuple[Callable[[], object], int, int] | None = None) -> None:
        """Fill each open count with the fastest of 1 and all threads for that kind of step. `heavy_step`:
        (a heavy decode, the rows the light decode attends, the rows it attends), measured when the light
        decode's count is open; without it every decode takes the light one's count.

        NOTE: the counts are tried in interleaved rounds (1, N, 1, N, ...), so that the machine's drift
        during the measurement hits both alike; the step applies the count under test itself, with the
        trials (which would swap it) set aside meanwhile.
        """
        trials, self.trials = self.trials, {}
        try:
            if self.small is None:
                if heavy_step is not None:
                    step, light_rows, heavy_rows = heavy_step
                    self.heavy_rows = math.isqrt(light_rows * heavy_rows)  # NOTE: first: the step is heavy
                    self.heavy = self._fastest(step, HEAVY)
                self.small = self._fastest(small_step, SMALL)
                self.heavy = self.heavy or self.small
            if self.big is None:
                self.big = self._fastest(big_step, BIG)
        finally:
            self.trials = trials
            torch.set_num_threads(self.available)
        for kind in self.voided & trials.keys():
            trials[kind].soon(UNTRUSTED_FIRST_PERIOD)
        log.info("step threads: %d for steps of <= %d new tokens (%d when they attend more than %d rows), "
                 "%d for bigger ones (of %d); measured (ms by threads, and the cores others kept busy): %s",
                 self.small, self.small_step_tokens, self.heavy, self.heavy_rows, self.big, self.available,
                 "; ".join(self._measured(kind) for kind in self.company) or "-")

    def _measured(self, kind: str) -> str:
        """One kind's start-up measurement, for the log: its medians by thread count, and its company."""
        times = ", ".join(f"{count}: {ms:.2f}" for count, ms in self.medians_ms[kind].items())
        company = self.company[kind]
        return f"{kind} {times}, others {'?' if company is None else f'{company:.2f}'}"

    def _fastest(self, step: Callable[[], object], which: str, warmup: int = 2, rounds: int = 7,
                 most_rounds: int = 64) -> int:
        """The count of fewer threads within CLOSE of the fastest, over `rounds` interleaved rounds after
        `warmup`, and more (up to `most_rounds`) until they last MIN_WALL_S, so that the company is known."""
        counts = sorted({1, self.available})
        timings: dict[int, list[float]] = {count: [] for count in counts}
        for _ in range(warmup):
            self._round(step, which, counts, None)
        # NOTE: over all the timed rounds, both arms: /proc/stat counts in 10 ms ticks, read at each start and
        # stop, so the all-threads steps alone (a few ms each on a small model) would measure only the ticks
        company = CoreCompany()
        company.start()
        began, done = time.perf_counter(), 0
        while done < rounds or (done < most_rounds and time.perf_counter() - began < MIN_WALL_S):
            self._round(step, which, counts, timings)
            done += 1
        company.stop()
        medians = {count: statistics.median(t) for count, t in timings.items()}
        self.medians_ms[which] = {count: t * 1e3 for count, t in medians.items()}
        best = min(medians.values())
        fastest = min(count for count, t in medians.items() if t <= best * (1 + CLOSE))
        others = self.company[which] = company.others()
        # NOTE: a win of all threads stands whatever the company: it can only have made them slower
        if fastest == self.available or self._trusted(others):
            return fastest
        self.voided.add(which)
        log.info("step threads: %s steps measured while others kept %.2f of %d cores busy: %d thread(s) won, not "
                 "trusted; %d until measured while serving", which, others, self.cores, fastest, self.available)
        return self.available

    def _round(self, step: Callable[[], object], which: str, counts: list[int],
               timings: dict[int, list[float]] | None) -> None:
        """One step of kind `which` at each of `counts`, timed into `timings` (None: a warm-up round)."""
        for count in counts:
            setattr(self, which, count)
            started = time.perf_counter()
            step()
            if timings is not None:
                timings[count].append(time.perf_counter() - started)

    def _trusted(self, others: float | None) -> bool:
        """Whether a measurement beside `others` busy cores (of this process's) left the all-threads arm its
        cores (less BUSY_MARGIN); unknown company is taken as none."""
        return others is None or self.cores - others >= min(self.available, self.cores) - BUSY_MARGIN
