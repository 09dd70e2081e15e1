"""deployments/model_lookup.py without Ray: the Ingress asks Preprocess for the model once however many requests
wait for it, and a Preprocess that does not answer (none running) or is full is a 503, not a hang or a 500."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.serve.exceptions import BackPressureError

from deployments import model_lookup
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
def test_a_preprocess_that_does_not_answer_or_is_full_is_a_503(preprocess: Preprocess,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_lookup, "MODEL_LOOKUP_S", 0.05)
    lookup = ModelLookup(preprocess, retries=2)
    with pytest.raises(OverloadedError) as refused:
        asyncio.run(asyncio.wait_for(lookup.get(), 5))
    assert error_body(refused.value)[0] == 503 and "Retry-After" in error_headers(refused.value)
    assert lookup.served is None  # asked again next time
