"""The start-up's scratch steps by rows: decodes of 1, 2, 4, ... short sequences and all of them, and the
prefill chunk only where it computes more rows than any of those decodes."""

from __future__ import annotations

from mmserve.decoder.thread_calibration import ScratchSteps, _sizes


def nothing() -> None:
    return None


def steps(prompt: int, decodes: list[int]) -> ScratchSteps:
    return ScratchSteps(big=nothing, decodes={k: nothing for k in decodes}, heavy=None, prompt=prompt, batch=0,
                        long=0)


def test_decodes_double_up_to_the_most_a_small_step_holds() -> None:
    assert _sizes(1) == [1]
    assert _sizes(16) == [1, 2, 4, 8, 16]
    assert _sizes(5) == [1, 2, 4, 5]


def test_the_prefill_chunk_is_a_row_count_of_its_own_only_past_the_decodes() -> None:
    assert list(steps(128, [1, 2, 4]).by_rows()) == [1, 2, 4, 128]
    chunk = steps(4, [1, 2, 4])
    assert chunk.by_rows()[4] is chunk.decodes[4] and list(chunk.by_rows()) == [1, 2, 4]
