"""Work a stage waits on that computes on its own host's CPU cores: the encodes a decoder asked for.

Owns: the host's name as the stages compare it (`cpu_host`: what an encoder's answer names as where its
forwards ran), and counting the calls in flight whose callee computes on this host's CPU, by where its
last answer said it ran (`SharedCores`). Does not own what a caller makes of the count (`step_threads.py`:
a decoder's steps take fewer threads meanwhile) nor the calls themselves (`decoder/service.py`).

NOTE: until its first answer, a callee is taken to share this host's cores: the default app places every
stage on one node, and a wrong guess costs one request's steps a thread at most.
NOTE: the count is kept by the caller's event loop and read by its step thread: one int, read whole.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

HOST = socket.gethostname()  # this host's name, as the stages' answers name theirs


def cpu_host(device_type: str) -> str:
    """Where a stage computing on `device_type` says its work ran: this host on a CPU, "" on an accelerator
    (its host's cores stay free meanwhile)."""
    return HOST if device_type == "cpu" else ""


class SharedCores:
    """`with cores.waiting(): out = await call(); cores.answered(out.host)`; `busy()` from any thread."""

    def __init__(self) -> None:
        self._in_flight = 0  # calls waited on now whose callee computes on this host's CPU (calls)
        self._callee_here = True  # whether the callee's last answer named this host's CPU

    def busy(self) -> bool:
        """Whether a call waited on now computes on this host's CPU."""
        return self._in_flight > 0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around one call to the callee: counted while it is in flight where the callee computes here."""
        counted = int(self._callee_here)
        self._in_flight += counted
        try:
            yield
        finally:
            self._in_flight -= counted

    def answered(self, host: str) -> None:
        """The callee's answer named `host` (`cpu_host`) as where its work ran."""
        self._callee_here = host == HOST
