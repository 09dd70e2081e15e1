"""The typed messages' own rules: what a retry sends of a preprocessed request it kept."""

from __future__ import annotations

from mmserve.messages import PreprocessedRequest, SamplingParams


def test_an_attempt_sends_the_request_under_its_own_id_and_a_kept_one_without_the_first_attempts_phases() -> None:
    pre = PreprocessedRequest("chatcmpl-1", [2, 5, 7], [], SamplingParams(max_tokens=4),
                              timings=(("decoded", 3.0),))
    first = pre.for_attempt("chatcmpl-1", kept=False)
    retry = pre.for_attempt("chatcmpl-1/retry-1", kept=True)
    assert first == pre
    assert (retry.request_id, retry.timings) == ("chatcmpl-1/retry-1", ())
    assert (retry.prompt_token_ids, retry.sampling) == (pre.prompt_token_ids, pre.sampling)
    assert pre.request_id == "chatcmpl-1"  # the kept request itself is unchanged for a later attempt
