"""The HTTP edge's middleware, in the order a request meets it, and its per-process settings.

Owns: `install` (CORS outermost: a browser's preflight is answered before anything asks it for a key or counts
it; then the API key: a request without one takes no slot; then the admission bound) and `configure` (the
settings each serving process gives them). Does not own what each does (cross_origin.py, api_keys.py,
admission.py) nor the routes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from mmserve.api.admission import Admission, AdmissionMiddleware, bound
from mmserve.api.api_keys import ENV as API_KEY_ENV
from mmserve.api.api_keys import ApiKeyMiddleware, api_keys, parse_keys
from mmserve.api.cross_origin import CrossOriginMiddleware, origins

log = logging.getLogger(__name__)


def install(app: Any, name: str, bounded_paths: frozenset[str]) -> None:
    """Add the edge's middleware to a Starlette/FastAPI `app`, its settings found under `name`."""
    # NOTE: Starlette runs the last added first
    app.add_middleware(AdmissionMiddleware, name=name, paths=bounded_paths)
    app.add_middleware(ApiKeyMiddleware, name=name)
    app.add_middleware(CrossOriginMiddleware, name=name)


def configure(name: str, *, limit: int, on_refused: Callable[[], None], cors_origins: tuple[str, ...],
              environ: Mapping[str, str], logger: logging.Logger = log) -> Admission:
    """Set this process's settings under `name` (the API keys from `environ`, their number told to `logger`: a
    Serve replica's is `ray.serve`); returns the admission bound."""
    admission = bound(name)
    admission.limit, admission.on_refused = limit, on_refused
    origins(name).allowed = cors_origins
    api_keys(name).accepted = keys = parse_keys(environ.get(API_KEY_ENV))
    if keys:
        logger.info("/v1 requests need one of %d API keys (%s)", len(keys), API_KEY_ENV)
    else:
        logger.info("/v1 requests need no API key (%s is not set)", API_KEY_ENV)
    return admission
