"""Which step failures leave the accelerator unusable for the rest of the process.

Owns: the rule. A CUDA kernel's fault (an illegal address, a device-side assert, a launch failure) is
reported asynchronously, at a later sync that may be outside the call that caused it, and every later CUDA
call of the process raises again ("sticky"): neither re-running a batch item by item nor the next step can
succeed, so the stage must stop stepping and its host (Serve's `check_health`) replace the process. Other
CUDA errors (out of memory in the caching allocator, cuBLAS or a raw `cudaMalloc`; an unsupported shape or
launch configuration) leave the context usable: a rerun item by item may succeed. Does not own what a stage
does on other failures (per-request isolation; `abort_all`: `step_loop.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

# NOTE: CUDA's runtime error codes that corrupt the context (cudaError_t): ECC uncorrectable (214), illegal
# address (700), launch timed out (702), device-side assert (710), hardware stack error (714), illegal
# instruction (715), misaligned address (716), invalid address space (717), invalid PC (718), launch failure (719)
STICKY_CODES = frozenset({214, 700, 702, 710, 714, 715, 716, 717, 718, 719})
# the same errors as `cudaGetErrorString` words them, for an error that carries no code (re-raised as text).
# NOTE: "device-side assert triggered" whole: every CUDA error's text from torch ends with a hint naming
# "device-side assertions"
STICKY_TEXT = ("illegal memory access", "device-side assert triggered", "unspecified launch failure",
               "the launch timed out and was terminated", "illegal instruction", "misaligned address",
               "uncorrectable ECC error", "hardware stack error", "invalid program counter",
               "operation not supported on global/shared address space")


class DeviceFault(RuntimeError):
    """A sticky accelerator fault (its cause) raised by a step for the requests whose work was on the device
    then: the step loop fails those with it, and every other waiting request as a lost stage (retried on a live
    replica), then ends."""

    def __init__(self, fault: BaseException, request_ids: list[str]) -> None:
        super().__init__(f"an accelerator fault in a step of requests {request_ids}: {fault!r}")
        self.fault = fault
        self.request_ids = request_ids  # the step loop fails these only (`StepLoop._one_step`)

    def __reduce__(self) -> tuple[type[DeviceFault], tuple[BaseException, list[str]]]:
        return (type(self), (self.fault, self.request_ids))  # NOTE: across Ray, to the caller of a stage


@contextlib.contextmanager
def naming_faults(request_ids: Callable[[], list[str]]) -> Iterator[None]:
    """Raise a sticky fault met inside as a DeviceFault of `request_ids()` (the requests whose work the device
    ran then); NOTE: on an accelerator a kernel's fault surfaces at the next wait, e.g. the read of the step's
    tokens, not in the call that queued the kernel."""
    try:
        yield
    except DeviceFault:
        raise
    except Exception as exc:
        if device_fatal(exc):
            raise DeviceFault(exc, request_ids()) from exc
        raise


def device_fatal(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is a sticky accelerator fault."""
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        code = getattr(err, "error_code", None)
        if isinstance(err, DeviceFault):
            return True
        if isinstance(err, RuntimeError) and (code in STICKY_CODES if isinstance(code, int)
                                              else any(text in str(err) for text in STICKY_TEXT)):
            return True
        err = err.__cause__ or err.__context__
    return False
