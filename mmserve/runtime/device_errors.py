"""Which step failures leave the accelerator unusable for the rest of the process.

Owns: the rule. A CUDA kernel's fault (an illegal address, a device-side assert) is reported
asynchronously, at a later sync that may be outside the call that caused it, and every later CUDA call of
the process raises again ("sticky"): neither re-running a batch item by item nor the next step can succeed,
so the stage must stop stepping and its host (Serve's `check_health`) replace the process. Does not own
what a stage does on other failures (per-request isolation; `abort_all`: `step_loop.py`).
"""

from __future__ import annotations

import torch

# NOTE: torch raises AcceleratorError for a CUDA error; the text is for one re-raised as a plain RuntimeError
_STICKY_TEXT = ("CUDA error:", "device-side assert")


def device_fatal(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is an accelerator fault (not an out-of-memory error,
    which frees nothing permanently and which a smaller step may avoid)."""
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, torch.AcceleratorError) or (
                isinstance(err, RuntimeError) and not isinstance(err, torch.OutOfMemoryError)
                and any(text in str(err) for text in _STICKY_TEXT)):
            return True
        err = err.__cause__ or err.__context__
    return False
