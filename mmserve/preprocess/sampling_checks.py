"""The checks of a request's sampling fields that need the served model or the app's limits.

Owns: the bounds on `stop` and `bad_words` (count and length: each is checked every token), and that the token ids
a request names are the model's. Does not own: the fields' own ranges (`SamplingParams.validate`), spelling bad
words in tokens, nor the prompt's checks (preprocessor.py).
"""

from __future__ import annotations

from mmserve.config import LimitsConfig
from mmserve.errors import InvalidSamplingError
from mmserve.messages import SamplingParams


def check_strings(strings: tuple[str, ...], limits: LimitsConfig, param: str = "stop") -> None:
    """`stop` (or `bad_words`: each checked every token too) within the limits on their count and length."""
    if len(strings) > limits.max_stop_sequences:
        raise InvalidSamplingError(f"{param}: {len(strings)} strings; the limit is {limits.max_stop_sequences}",
                                   param=param)
    longest = max((len(s) for s in strings), default=0)
    if longest > limits.max_stop_chars:
        raise InvalidSamplingError(f"{param}: a string of {longest} characters; the limit is "
                                   f"{limits.max_stop_chars}", param=param)


def check_token_ids(sampling: SamplingParams, vocab_size: int | None) -> None:
    """Token ids a request names must be the model's: one past its vocabulary would change nothing (None: the
    vocabulary is not known here, nothing is checked)."""
    if vocab_size is None:
        return
    named = (("logit_bias", [i for i, _ in sampling.logit_bias]), ("stop_token_ids", sampling.stop_token_ids),
             ("allowed_token_ids", sampling.allowed_token_ids or ()))
    for param, ids in named:
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise InvalidSamplingError(f"{param}: token id {bad} is not in the model's vocabulary "
                                       f"(0-{vocab_size - 1})", param=param)
