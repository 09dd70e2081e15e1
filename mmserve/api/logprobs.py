"""OpenAI's `logprobs` objects of a chat completion (a choice's, or a stream chunk's).

Owns: the response models of token log-probabilities and building them from the engine's
`TokenLogprob`s. Does not own: computing them (`mmserve.decoder.sampler.token_logprobs`, from the raw
logits) nor where they go in a response (`protocol.py`, `stream.py`).
"""

from __future__ import annotations

from pydantic import BaseModel

from mmserve.messages import TokenLogprob


class TopLogprob(BaseModel):
    token: str
    logprob: float  # natural log
    bytes: list[int]  # the token's own bytes (a byte token's one byte; else its text as UTF-8)


class ContentLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # best first; as many as `top_logprobs` asked (0 when not set)


class ChoiceLogprobs(BaseModel):
    content: list[ContentLogprob]  # one per generated token


# NOTE: JSON has no -inf (a token a grammar forbids): vLLM's edge reports it as this, and so does ours
FORBIDDEN_LOGPROB = -9999.0


def choice_logprobs(tokens: list[TokenLogprob]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[
        ContentLogprob(token=t.token, logprob=_finite(t.logprob), bytes=list(t.token_bytes),
                       top_logprobs=[TopLogprob(token=s, logprob=_finite(lp), bytes=list(raw))
                                     for _, s, lp, raw in t.top])
        for t in tokens])


def _finite(logprob: float) -> float:
    """NOTE: a NaN (a broken checkpoint's logits) too: JSON has no NaN, and a client's parser refuses one."""
    return logprob if logprob >= FORBIDDEN_LOGPROB else FORBIDDEN_LOGPROB
