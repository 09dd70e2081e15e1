"""An accelerator's sticky fault is told from the failures a stage survives."""

from __future__ import annotations

import torch

from mmserve.encoder.outputs import EncoderStepError
from mmserve.runtime.device_errors import device_fatal


def test_an_accelerator_fault_is_fatal_however_it_was_raised_or_wrapped() -> None:
    fault = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    assert device_fatal(fault)
    assert device_fatal(RuntimeError("CUDA error: device-side assert triggered"))  # re-raised as plain text
    try:
        try:
            raise fault
        except RuntimeError as exc:
            raise EncoderStepError({"r1": exc}) from exc  # the stage's own wrapping
    except EncoderStepError as wrapped:
        assert device_fatal(wrapped)


HINT = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
        "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with "
        "`TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")  # what torch appends to every CUDA error


def test_the_hint_torch_appends_to_every_cuda_error_decides_nothing() -> None:
    assert not device_fatal(RuntimeError("CUDA error: out of memory" + HINT))
    assert not device_fatal(RuntimeError("CUDA error: invalid configuration argument" + HINT))
    assert device_fatal(RuntimeError("CUDA error: device-side assert triggered" + HINT))
    assert device_fatal(RuntimeError("CUDA error: an illegal memory access was encountered" + HINT))


def test_what_a_stage_survives_is_not_fatal() -> None:
    assert not device_fatal(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    # cuBLAS out of memory and shape-dependent refusals come as "CUDA error: ..." too, and leave the context usable
    assert not device_fatal(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not device_fatal(RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx`"))
    assert not device_fatal(torch.AcceleratorError("CUDA error: invalid configuration argument"))
    assert not device_fatal(torch.AcceleratorError("CUDA error: out of memory"))
    assert not device_fatal(IndexError("index out of range in self"))  # a bad token id: its request fails alone
    assert not device_fatal(RuntimeError("a kernel rejects this image"))
    assert not device_fatal(ValueError("CUDA error: an illegal memory access was encountered"))  # not torch's


def test_an_error_code_decides_where_the_error_carries_one() -> None:
    sticky = torch.AcceleratorError("CUDA error")
    usable = torch.AcceleratorError("CUDA error: an illegal memory access")
    sticky.error_code = 700  # type: ignore[attr-defined]  # cudaErrorIllegalAddress, as torch sets it on the error it raises
    usable.error_code = 2  # type: ignore[attr-defined]  # cudaErrorMemoryAllocation
    assert device_fatal(sticky) and not device_fatal(usable)
