"""How many CPU threads torch may use for one step of a stage (encoder or decoder).

Owns: the choice, per step, between the stage's intra-op thread count (the process setting when
the stage was built) and fewer for a small step, and applying it in the calling thread. Does not
own what a step computes (the runners) nor the process-wide default (set by whoever starts the
stage, e.g. a Ray replica from its stage's `torch_threads`).

NOTE: torch's thread count is per calling thread (OpenMP's nthreads ICV), but `torch.set_num_threads`
also changes the default that threads started later begin with. So every stage sets its count in
its own step thread before each step: in the in-process Engine the encoder's step thread, started
after a decode step chose 1, would otherwise run the vision tower on one thread.

NOTE: a decode step multiplies a handful of rows by every weight matrix and is mostly bound by reading
the weights from memory; whether a second OpenMP thread helps it depends on the CPU (docs/benchmarks.md
has the figures of two), while it takes a core from the stage beside it.
"""

from __future__ import annotations

import torch

from mmserve.config import DecoderConfig


class StepThreads:
    def __init__(self, device: torch.device, small: DecoderConfig | None = None):
        self.enabled = device.type == "cpu"
        self.small = small  # None: every step gets the stage's count
        self.big = torch.get_num_threads()  # the stage's count: the process setting when it was built

    def threads_for(self, num_new_tokens: int) -> int:
        """Threads for a step computing `num_new_tokens` tokens (all sequences together)."""
        small = self.small
        if small is None or small.small_step_threads is None or num_new_tokens > small.small_step_tokens:
            return self.big
        return min(small.small_step_threads, self.big)

    def apply(self, num_new_tokens: int) -> None:
        """Set torch's threads for the coming step in the calling thread (no-op off CPU)."""
        if not self.enabled:
            return
        wanted = self.threads_for(num_new_tokens)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
