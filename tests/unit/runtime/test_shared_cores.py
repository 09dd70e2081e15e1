"""Encodes in flight on this host's CPU are counted; one whose encoder answered from elsewhere is not."""

from __future__ import annotations

import pytest

from mmserve.runtime.shared_cores import HOST, SharedCores, cpu_host


def test_a_cpu_stage_names_this_host_and_an_accelerator_none() -> None:
    assert cpu_host("cpu") == HOST != ""
    assert cpu_host("cuda") == ""


def test_calls_count_while_in_flight_where_the_callee_last_answered_from_this_hosts_cpu() -> None:
    cores = SharedCores()
    assert not cores.busy()
    with cores.waiting():  # before any answer: taken to be here
        with cores.waiting():
            assert cores.busy()
        assert cores.busy()
        cores.answered(HOST)
    assert not cores.busy()
    cores.answered(cpu_host("cuda"))  # the callee computes on an accelerator now
    with cores.waiting():
        assert not cores.busy()
        cores.answered("another-host")
    with cores.waiting():
        assert not cores.busy()
    cores.answered(HOST)
    with pytest.raises(RuntimeError), cores.waiting():  # a failed call stops counting too
        assert cores.busy()
        raise RuntimeError("the call failed")
    assert not cores.busy()
