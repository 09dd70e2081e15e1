"""The served request's timeline over HTTP: the `Server-Timing` header names the ingress's round trips and,
inside them, each stage's own time, so that a round trip less the callee's time is the hop."""

from __future__ import annotations

import os
import typing
from typing import Any

import pytest

from tests.e2e.chat_client import client_for, png_url, user

pytestmark = pytest.mark.timeout(600)
EPS_MS = 0.02  # the header's rounding (1 µs a value) over the dozen values a check adds up

# served, a lookup travels to the store: the work it may spare runs meanwhile, then what is left of the wait.
# NOTE: a lookup answered before that work would start (the store quick, the worker thread descheduled) is
# marked before it: each (work, lookup) pair comes in either order
DECODE, PROCESS = (["preprocess.image_decode", "preprocess.image_lookup"],
                   ["preprocess.image_process", "preprocess.image_lookup"])
IMAGE_PHASES = [["preprocess.image_read", *decode, "preprocess.image_hash", *process, "preprocess.image_store"]
                for decode in (DECODE, DECODE[::-1]) for process in (PROCESS, PROCESS[::-1])]
STAGE_PHASES = [["preprocess.prompt", *image, "preprocess.features", "preprocess.replica",
                 "decoder.prefix", "decoder.encode_call", "encoder.pixels", "encoder.forward", "encoder.stage",
                 "encoder.replica", "decoder.embeddings", "decoder.admit", "decoder.first_output"]
                for image in IMAGE_PHASES]


def server_timing(header: str) -> list[tuple[str, float]]:
    pairs = []
    for item in header.split(","):
        name, dur = item.strip().split(";dur=")
        pairs.append((name, float(dur)))
    return pairs


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
def test_a_new_image_s_server_timing_holds_each_stage_inside_the_round_trip_that_called_it(e2e_server, stream):
    image = png_url(int.from_bytes(os.urandom(4), "little") + 20_000)  # new to the server's caches
    with client_for(e2e_server) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=e2e_server.model_name, messages=typing.cast(Any, user("Describe this.", image)), max_tokens=3,
            temperature=0, stream=stream)
        response = raw.parse()
        if stream:
            list(typing.cast(Any, response))  # read the stream to its end
    pairs = server_timing(raw.headers["server-timing"])
    assert [name for name, _ in pairs] in [["parse", "preprocess", "first", *phases] for phases in STAGE_PHASES], pairs
    t = dict(pairs)
    assert all(ms >= 0 for ms in t.values()), pairs
    # each callee's own time lies inside the round trip that called it (NOTE: + the header's rounding, 1 µs each)
    work = sum(ms for name, ms in pairs if name.startswith("preprocess.") and name != "preprocess.replica")
    assert work <= t["preprocess.replica"] + EPS_MS <= t["preprocess"] + 2 * EPS_MS
    assert t["encoder.pixels"] + t["encoder.forward"] <= t["encoder.stage"] + EPS_MS
    assert t["encoder.stage"] <= t["encoder.replica"] + EPS_MS <= t["decoder.encode_call"] + 2 * EPS_MS
    assert t["decoder.encode_call"] <= t["decoder.embeddings"] + EPS_MS
    decoder = t["decoder.prefix"] + t["decoder.embeddings"] + t["decoder.admit"] + t["decoder.first_output"]
    assert decoder <= t["first"] + EPS_MS
