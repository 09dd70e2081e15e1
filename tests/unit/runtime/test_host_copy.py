"""host_copy.to_device: a copy onto an accelerator is queued without waiting; one from an accelerator onto the
CPU waits for its bytes (they are read at once). No accelerator here: a stand-in records how it was asked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mmserve.runtime.host_copy import to_device


@dataclass
class OnDevice:
    """Stands in for a tensor on `device`; records each `.to` call's device and non_blocking flag."""

    device: torch.device
    asked: list[tuple[str, bool]] = field(default_factory=list)

    def to(self, device: torch.device, *, non_blocking: bool = False) -> Any:
        self.asked.append((device.type, non_blocking))
        return self


def test_a_copy_onto_an_accelerator_is_queued_and_one_back_to_the_cpu_waits() -> None:
    on_gpu = OnDevice(torch.device("cuda"))
    to_device(on_gpu, torch.device("cpu"))  # type: ignore[arg-type]
    to_device(on_gpu, torch.device("cuda"))  # type: ignore[arg-type]
    assert on_gpu.asked == [("cpu", False), ("cuda", True)]
    on_cpu = OnDevice(torch.device("cpu"))
    to_device(on_cpu, torch.device("cuda"))  # type: ignore[arg-type]
    assert on_cpu.asked == [("cuda", True)]


def test_a_host_array_on_the_cpu_is_the_array_itself() -> None:
    host = np.arange(4)
    out = to_device(host, torch.device("cpu"))
    assert out.tolist() == [0, 1, 2, 3] and out.data_ptr() == host.ctypes.data  # no copy
