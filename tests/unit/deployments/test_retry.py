"""retry.py: which errors are a lost replica, and a bounded retry of only those."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ObjectLostError,
    OwnerDiedError,
    RayError,
    RayTaskError,
)

from deployments import retry
from deployments.retry import attempt_id, replica_lost, retrying, unwrapped
from mmserve.encoder.outputs import EncoderStepError
from mmserve.errors import MediaError, ReplicaLostError
from mmserve.runtime.step_loop import StageStopped


@pytest.mark.parametrize("exc, lost", [
    (ActorDiedError(), True), (ActorUnavailableError("gone", None), True), (OwnerDiedError("00" * 28, None, ""), True),
    (RayTaskError("generate", "tb", ActorDiedError()), True),  # a replica passing on its callee's loss
    (StageStopped("the step thread of mmserve-decoder died"), True),  # a live replica can serve it
    (RayTaskError("encode", "tb", StageStopped("stopped")), True),
    (RayTaskError("generate", "tb", MediaError("bad image")), False), (MediaError("bad image"), False),
    (TimeoutError(), False),
    # NOTE: a Decoder that gave up on its own lost Encoder passes on a ReplicaLostError: not retried again
    # upstream, so retries do not multiply along the path (no 3 x 3 fan-out)
    (RayTaskError("generate", "tb", ReplicaLostError("a serving replica was lost")), False),
])
def test_what_counts_as_a_lost_replica(exc: BaseException, lost: bool) -> None:
    assert replica_lost(exc) is lost


def test_what_the_client_is_told_of_an_error_a_replica_passed_on() -> None:
    bad = MediaError("bad image")
    assert unwrapped(RayTaskError("generate", "tb", RayTaskError("process", "tb", bad))) is bad
    assert isinstance(unwrapped(RayTaskError("generate", "tb", ActorDiedError())), ReplicaLostError)
    assert unwrapped(bad) is bad


def _flaky(failures: list[BaseException]):
    calls: list[int] = []

    async def call(attempt: int) -> str:
        calls.append(attempt)
        if failures:
            raise failures.pop(0)
        return "ok"
    return call, calls


def test_a_lost_replica_is_retried_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "BACKOFF_S", 0.0)
    call, calls = _flaky([ActorDiedError(), ActorDiedError()])
    assert asyncio.run(retrying(call, retries=2, what="t")) == "ok" and calls == [0, 1, 2]
    call, calls = _flaky([ActorDiedError()] * 3)
    with pytest.raises(ActorDiedError):
        asyncio.run(retrying(call, retries=2, what="t"))
    assert len(calls) == 3


def test_other_errors_are_not_retried() -> None:
    call, calls = _flaky([MediaError("bad image")])
    with pytest.raises(MediaError):
        asyncio.run(retrying(call, retries=5, what="t"))
    assert len(calls) == 1


def test_only_the_kinds_asked_for_are_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "BACKOFF_S", 0.0)
    call, calls = _flaky([OwnerDiedError("00" * 28, None, "")])  # lost pixels: retrying the call cannot help
    with pytest.raises(OwnerDiedError):
        asyncio.run(retrying(call, retries=2, what="t", kinds=retry.ACTOR_LOST))
    assert calls == [0]


def _kept_after(exc: BaseException) -> str | None:
    """What the next attempt starts from after an attempt that made "pre" then failed with `exc`."""
    kept: retry.Kept[str] = retry.Kept()
    assert kept.take() is None and not kept.ready  # the first attempt makes its own
    kept.made("pre")
    kept.lost_after(exc)
    return kept.take()


@pytest.mark.parametrize("exc, kept", [
    (ActorDiedError(), True),  # the Decoder died: its request is preprocessed still
    (ActorUnavailableError("gone", None), True),
    (OwnerDiedError("00" * 28, None, ""), False),  # the pixels' maker died: preprocess again
    (RayTaskError("generate", "tb", OwnerDiedError("00" * 28, None, "")), False),  # ...as a replica passed it on
    (RayTaskError("generate", "tb", MediaError("bad image")), False), (TimeoutError(), False),
])
def test_a_retry_starts_from_the_lost_attempts_preprocessed_request_only_if_a_replica_alone_died(
        exc: BaseException, kept: bool) -> None:
    assert _kept_after(exc) == ("pre" if kept else None)


def test_a_kept_value_serves_one_attempt_and_an_attempt_lost_before_making_its_own_keeps_none() -> None:
    kept: retry.Kept[str] = retry.Kept()
    kept.made("pre")
    kept.lost_after(ActorDiedError())
    assert kept.ready and kept.take() == "pre"
    assert kept.take() is None  # taken: the attempt that took it must make it (or keep it) again
    kept.lost_after(ActorDiedError())  # e.g. lost in Preprocess, before it made anything
    assert not kept.ready and kept.take() is None


def test_attempt_ids_stay_unique_where_retries_nest() -> None:
    # the ingress's attempts, each with the Decoder's retried encodes under it
    ids = {attempt_id(attempt_id("r", outer), inner, "encode-retry") for outer in range(3) for inner in range(3)}
    assert len(ids) == 9


def test_an_encoder_step_error_crosses_ray_and_a_request_whose_pixels_were_lost_sees_the_loss() -> None:
    from deployments.encoder import as_raised

    error = EncoderStepError({"lost": ObjectLostError("ab" * 14, None, ""), "bad": RuntimeError("a bad image")})
    backs = {}
    for request_id in ("lost", "bad"):  # as each request's caller gets it
        backs[request_id] = RayError.from_bytes(
            RayTaskError("Encoder.encode", "tb", as_raised(error, request_id)).to_bytes())
    assert replica_lost(backs["lost"])  # so the ingress preprocesses it again
    assert not replica_lost(backs["bad"])  # reported: its own error only, not another request's
    bad = unwrapped(backs["bad"])
    assert isinstance(bad, EncoderStepError) and bad.request_ids == ["bad"]
    assert "a bad image" in str(bad) and "lost" not in str(bad)
