"""scripts/bench_lib/timeline.py: each hop derived as a round trip less its callee's own time, per request."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_timeline", Path(__file__).resolve().parents[2] / "scripts" / "bench_lib" / "timeline.py")
assert SPEC is not None and SPEC.loader is not None
timeline = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(timeline)


def test_each_hop_is_a_round_trip_less_its_callee_s_own_time():
    served = {"parse": 5.0, "preprocess": 60.0, "preprocess.replica": 52.0, "preprocess.prompt": 1.0,
              "preprocess.image_decode": 14.0, "preprocess.features": 0.5, "first": 180.0, "decoder.prefix": 1.0,
              "decoder.encode_call": 150.0, "encoder.replica": 138.0, "decoder.embeddings": 151.0,
              "decoder.admit": 0.5, "decoder.first_output": 17.5}
    rows = timeline.with_hops(served)
    assert rows[timeline.HOP_PREPROCESS] == pytest.approx(8.0)
    assert rows[timeline.HOP_ENCODER] == pytest.approx(12.0)
    assert rows[timeline.HOP_STREAM] == pytest.approx(180.0 - 170.0)  # the decoder's four phases, not the call
    assert rows["preprocess.work"] == pytest.approx(15.5)  # its phases, not the replica's whole call


def test_in_process_has_no_hops_and_medians_take_each_request_s_own_hop():
    assert set(timeline.with_hops({"preprocess.prompt": 1.0, "decoder.admit": 0.1})) == {
        "preprocess.prompt", "decoder.admit", "preprocess.work"}
    # NOTE: the median of the requests' own hops (1, 1, 27: 1), not the hop of the medians (20 - 9 = 11)
    requests = [{"preprocess": 10.0, "preprocess.replica": 9.0}, {"preprocess": 20.0, "preprocess.replica": 19.0},
                {"preprocess": 30.0, "preprocess.replica": 2.0}]
    assert timeline.medians(requests)[timeline.HOP_PREPROCESS] == pytest.approx(1.0)
