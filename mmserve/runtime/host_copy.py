"""Host data onto the compute device without waiting for the device: a step's metadata, indices, draws.

Owns: the one way the engine's step code moves host arrays and Python lists onto its device. Does not
own what is moved (the runners, attention metadata, the sampler) nor any device-to-host read.

NOTE: PyTorch's blocking host-to-device copy ends with a stream synchronize on CUDA, so every such copy
in a step is a host sync: the host waits for the work already queued (the last step's forward) before it
may queue more. A `non_blocking` copy from ordinary (pageable) host memory returns as soon as CUDA has
staged the bytes, so the host array may be reused or freed at once, and nothing waits. On a CPU device
both give the tensor itself, no copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a numpy array or a CPU tensor) on `device`, the copy queued without a host sync.

    NOTE: a tensor already on an accelerator, asked for on the CPU, is copied blocking: a non-blocking
    device-to-host copy returns before its bytes have landed, and the caller reads them at once.
    """
    tensor = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    return tensor.to(device, non_blocking=device.type != "cpu" or tensor.device.type == "cpu")


def ints_to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """(n,) int64 tensor of `values` on `device`, the copy queued without a host sync."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def floats_to_device(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """(n,) float32 tensor of `values` on `device`, the copy queued without a host sync."""
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
