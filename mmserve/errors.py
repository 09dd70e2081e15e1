"""Exception types that say *whose* fault a failure is.

Owns: the exception hierarchy. Every error a client caused derives from `InvalidRequestError`,
which the HTTP edge maps to a 4xx with `code`; anything else is a server error (5xx). Does not own the
error bodies and HTTP statuses, nor the HTTP edge's own errors (mmserve/api/errors.py).
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The client sent something we cannot serve; maps to HTTP 400. `param` names the offending request field
    (OpenAI's error `param`), where known."""

    code = "invalid_request"
    status = 400

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param  # NOTE: instance state, so it survives pickling across processes


class MediaError(InvalidRequestError):
    """An image could not be fetched or decoded (bad base64, non-image bytes, too large)."""

    code = "invalid_image"


class UnsupportedURLError(InvalidRequestError):
    """The image URL's scheme, host or address is not allowed."""

    code = "unsupported_url"


class TooManyItemsError(InvalidRequestError):
    """More multimodal items in one prompt than the configured limit."""

    code = "too_many_images"


class PromptTooLongError(InvalidRequestError):
    """The prompt, once images are expanded, does not fit the model's context."""

    code = "context_length_exceeded"


class InvalidSamplingError(InvalidRequestError):
    """A sampling parameter is out of range."""

    code = "invalid_sampling_params"


class CapacityError(InvalidRequestError):
    """One item or prompt can never fit a configured budget (encoder cache, step budget, KV pool)."""

    code = "exceeds_capacity"


class PayloadTooLargeError(InvalidRequestError):
    """The request body is larger than the server accepts; maps to HTTP 413."""

    code = "request_too_large"
    status = 413


class UnsupportedMediaTypeError(InvalidRequestError):
    """The body is not sent as JSON (its Content-Type), or is encoded (gzip); maps to HTTP 415. `encoding`:
    refused for its Content-Encoding (the answer then names the one accepted, `Accept-Encoding: identity`)."""

    code = "unsupported_media_type"
    status = 415

    def __init__(self, *args: object, encoding: bool = False) -> None:
        super().__init__(*args)
        self.encoding = encoding


class BodyTimeoutError(InvalidRequestError):
    """The client did not finish sending its body within the request's deadline; maps to HTTP 408."""

    code = "request_timeout"
    status = 408


class OverloadedError(RuntimeError):
    """A stage is at its configured capacity (its queue is full); maps to HTTP 503 with `Retry-After`.

    Not the client's fault, and not a failure: the same request succeeds later.
    """

    code = "overloaded"
    status = 503
    retry_after_s = 1  # seconds a client should wait before retrying (HTTP's Retry-After)


class ReplicaLostError(OverloadedError):
    """A replica serving the request died and the retries on live ones did not get it through (or a stream
    had begun from it: a streamed request is not retried past its first event); 503 with `Retry-After`:
    the service replaces the replica."""

    code = "replica_lost"
    retry_after_s = 5


class DeadlineExceededError(RuntimeError):
    """A request outlived its deadline (waiting or running); maps to HTTP 504. Its holds are freed."""

    code = "deadline_exceeded"
    status = 504
