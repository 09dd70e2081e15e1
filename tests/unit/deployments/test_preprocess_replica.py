"""deployments/preprocess.py without Ray: an early encode's call is given up when no Encoder takes it in time."""

from __future__ import annotations

import asyncio

import pytest

from deployments import preprocess
from tests.unit.deployments.test_handles import PendingCall


def test_an_early_encode_with_no_encoder_to_go_to_is_given_up_and_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve queues a call to a deployment with no replica, pinning its pixels: the early one does not wait on."""
    monkeypatch.setattr(preprocess, "EARLY_TIMEOUT_S", 0.05)
    call = PendingCall()

    async def run() -> None:
        await asyncio.wait_for(preprocess._settle(call), 5)  # returns, never raises

    asyncio.run(run())
    assert call.cancels == 1
