"""Where the engine's tests run it: on the CPU, or on the device that `MMSERVE_TEST_DEVICE` names (`cuda` on a
lent GPU: scripts/device_check.sh). The oracle, transformers' model, stays on the CPU either way.

Owns the device name the engine-level tests build their engines with. Does not own tolerances
(tests/numerics.py, the parity bound in tests/unit/test_parity.py).
"""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("MMSERVE_TEST_DEVICE", "cpu")  # a torch device string
