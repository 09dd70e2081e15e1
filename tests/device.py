"""Where the engine's tests run it: on the CPU, or on the device that `MMSERVE_TEST_DEVICE` names (`cuda` on a
lent GPU: scripts/device_check.sh); and which checkpoints the parity suites compare on.

Owns the device name the engine-level tests build their engines with, and the parity suites' checkpoints with
their oracle's device: the tiny fixtures with the oracle (transformers' model) on the CPU, or the folder that
`MMSERVE_TEST_PARITY_CHECKPOINT` names with the oracle on `TEST_DEVICE` too (scripts/device_check.sh: a
checkpoint of gemma-3-4b's sizes, whose oracle on a CPU would take most of a lent machine's time). Does not own
tolerances (tests/numerics.py, the parity bound in tests/unit/test_parity.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TEST_DEVICE = os.environ.get("MMSERVE_TEST_DEVICE", "cpu")  # a torch device string
PARITY_CHECKPOINT = os.environ.get("MMSERVE_TEST_PARITY_CHECKPOINT")  # a checkpoint folder, or None: the tiny ones
# the parity suites' module fixture params: the tiny checkpoints' fixture names, or the folder above
PARITY_PARAMS = ["tiny_ckpt", "tiny_ckpt_224", "tiny_ckpt_gqa"] if PARITY_CHECKPOINT is None else [PARITY_CHECKPOINT]


def parity_checkpoint(request: pytest.FixtureRequest) -> tuple[Path, str]:
    """(the checkpoint folder, the oracle's device) of a parity fixture's param (one of PARITY_PARAMS)."""
    if PARITY_CHECKPOINT is None:
        return Path(request.getfixturevalue(request.param)), "cpu"
    return Path(request.param), TEST_DEVICE
