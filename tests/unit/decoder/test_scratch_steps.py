"""The start-up's scratch steps by rows: decodes of 1, 2, 4, ... short sequences and all of them, and the
prefill chunk only where it computes more rows than any of those decodes."""

from __future__ import annotations

from typing import Any, cast

from mmserve.config import DecoderConfig
from mmserve.decoder.block_pool import BlockPool
from mmserve.decoder.model_runner import ModelRunner
from mmserve.decoder.scheduler import Scheduler
from mmserve.decoder.thread_calibration import ScratchSteps, _sizes, scratch_steps
from mmserve.models.base import FULL, AttentionPattern


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

ONE_FULL_LAYER = AttentionPattern(layer_kinds=(FULL,), sliding_window=None, bidirectional_images=True, scaling=1.0,
                                  softcap=None)


class Runner:
    """Records the steps run: (first token computed, tokens computed) of each sequence."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[int, int]]] = []

    def execute(self, scheduled: list[tuple[Any, int]]) -> None:
        self.steps.append([(seq.num_computed_tokens, n) for seq, n in scheduled])


def test_short_sequences_are_as_many_as_the_pool_holds_and_all_go_back() -> None:
    # 128-token sequences in blocks of 16 on one layer: 8 blocks each; room for 3 in 26 blocks, not for 16
    pool = BlockPool(26)
    scheduler = Scheduler(DecoderConfig(num_blocks=26, block_size=16), pool, ONE_FULL_LAYER,
                          max_model_len=4096, eos_token_ids=(1,))
    runner = Runner()
    with scratch_steps(cast(ModelRunner, runner), scheduler, 1, short=16, heavy=False) as steps:
        assert steps is not None and steps.heavy is None
        assert list(steps.by_rows()) == [1, 2, 3, 128]  # 1, 2 and the 3 there was room for; the chunk
        assert pool.num_free == 26 - 3 * 8
        steps.decodes[3]()
        steps.big()
    assert runner.steps == [[(127, 1)] * 3, [(0, 128)]]  # each decodes its last token; the chunk is a prompt
    assert pool.num_free == 26
