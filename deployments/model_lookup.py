"""The served model's description as the Ingress learns it: asked of Preprocess once, then kept.

Owns: the one ask (the requests that come before its answer wait for it), its bound (MODEL_LOOKUP_S, then a 503 with
`Retry-After`, as for a full queue) and logging what is served. Does not own what the description holds
(mmserve.messages.ServedModel) nor reading the checkpoint (Preprocess does).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.serve.exceptions import BackPressureError

from deployments.handles import shed
from deployments.retry import retrying
from mmserve.errors import OverloadedError
from mmserve.messages import ServedModel

log = logging.getLogger("ray.serve")
# the longest a request waits for the model's description (its own ask, or another's under way) (s)
MODEL_LOOKUP_S = 10.0


class ModelLookup:
    def __init__(self, preprocess: Any, retries: int) -> None:  # preprocess: a DeploymentHandle
        self._preprocess, self._retries = preprocess, retries
        self.served: ServedModel | None = None  # once asked
        self._asking = asyncio.Lock()

    async def get(self, timeout_s: float | None = MODEL_LOOKUP_S) -> ServedModel:
        """The model's name, context and sampling defaults; an OverloadedError (a 503 with `Retry-After`) for
        Serve's BackPressureError (a full queue), or past `timeout_s` (None: no bound of its own).

        NOTE: `/v1/models` is bounded (MODEL_LOOKUP_S): with no Preprocess replica running (starting, or all lost)
        Serve's router waits for one without end, and a monitor's `HEAD /v1/models` would hang instead of being
        told. A chat request is bounded by its own deadline alone: its Preprocess call would wait the same way."""
        if self.served is not None:
            return self.served
        try:
            async with asyncio.timeout(timeout_s), self._asking:
                if self.served is None:
                    self.served = await self._ask()
        except BackPressureError as exc:
            raise shed(exc) from None
        except TimeoutError:
            raise OverloadedError(f"the model's stages did not answer within {timeout_s:g} s (starting, or "
                                  "every replica busy or lost: GET /health says which); retry later") from None
        assert self.served is not None
        return self.served

    async def _ask(self) -> ServedModel:
        served: ServedModel = await retrying(lambda _: self._preprocess.served_model.remote(),
                                             retries=self._retries, what="the served model")
        log.info("serving %s; a request's unset sampling fields take %s", served.model_id,
                 served.sampling_defaults.describe())
        return served
