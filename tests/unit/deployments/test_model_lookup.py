"""deployments/model_lookup.py without Ray: the Ingress asks Preprocess for the model once however many requests
wait for it, and a Preprocess that does not answer (none running) or is full is a 503, not a hang or a 500."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.serve.exceptions import BackPressureError

from deployments.model_lookup import ModelLookup
from mmserve.api.errors import error_body, error_headers
from mmserve.errors import OverloadedError
from mmserve.messages import ServedModel

SERVED = ServedModel("tiny", 2048)


class Preprocess:
    """Stands in for the Preprocess handle: `served_model.remote()` answers after `delay_s`, or raises `error`."""

    def __init__(self, delay_s: float = 0.0, error: BaseException | None = None) -> None:
        self.delay_s, self.error, self.asked = delay_s, error, 0
        self.served_model = self

    def remote(self) -> Any:
        self.asked += 1

        async def answer() -> ServedModel:
            await asyncio.sleep(self.delay_s)
            if self.error is not None:
                raise self.error
            return SERVED

        return answer()


def test_the_requests_that_come_before_the_answer_wait_for_one_ask() -> None:
    preprocess = Preprocess(delay_s=0.05)
    lookup = ModelLookup(preprocess, retries=2)

    async def run() -> list[ServedModel]:
        return list(await asyncio.gather(*(lookup.get() for _ in range(5))))

    assert asyncio.run(run()) == [SERVED] * 5 and preprocess.asked == 1
    assert asyncio.run(lookup.get()) is SERVED and preprocess.asked == 1  # kept


@pytest.mark.parametrize("preprocess", [Preprocess(delay_s=60), Preprocess(error=BackPressureError(
    num_queued_requests=3, max_queued_requests=3))], ids=["no replica answers", "its queue is full"])
def test_a_preprocess_that_does_not_answer_or_is_full_is_a_503(preprocess: Preprocess) -> None:
    lookup = ModelLookup(preprocess, retries=2)
    with pytest.raises(OverloadedError) as refused:
        asyncio.run(asyncio.wait_for(lookup.get(timeout_s=0.05), 5))
    assert error_body(refused.value)[0] == 503 and "Retry-After" in error_headers(refused.value)
    assert lookup.served is None  # asked again next time


def test_without_a_bound_of_its_own_a_slow_answer_is_waited_for() -> None:
    """A chat request's ask: bounded by the request's deadline alone, as its Preprocess call would be."""
    lookup = ModelLookup(Preprocess(delay_s=0.2), retries=2)
    assert asyncio.run(lookup.get(timeout_s=None)) is SERVED
