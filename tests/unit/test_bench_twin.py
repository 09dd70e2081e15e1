"""scripts/bench_lib/step.py: a twin Decoder steps on the threads of the Decoder it copies."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from mmserve.models.tiny_checkpoint import default_tiny_checkpoint
from mmserve.runtime.core_company import usable_cores

SPEC = importlib.util.spec_from_file_location(
    "bench_step_lib", Path(__file__).resolve().parents[2] / "scripts" / "bench_lib" / "step.py")
assert SPEC is not None and SPEC.loader is not None
step = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = step  # NOTE: its dataclasses look their module up there
SPEC.loader.exec_module(step)


def test_a_twin_takes_the_threads_of_the_decoder_it_copies_not_torch_s_count_of_the_moment():
    before = torch.get_num_threads()
    if min(before, usable_cores()) < 2:
        pytest.skip("one thread or core here: a twin built at 1 thread could not differ")
    ckpt = default_tiny_checkpoint()
    ours = step.engine_decoder(ckpt, max_num_seqs=2, num_blocks=64, measure_forms=False, settle=False)
    torch.set_num_threads(1)  # as the benchmark's transformers cells at one thread leave it
    try:
        twin = step.twin_decoder(ours, ckpt, max_num_seqs=2, num_blocks=64)
        assert torch.get_num_threads() == 1  # left as found
    finally:
        torch.set_num_threads(before)
    assert twin.runner.threads.available == ours.runner.threads.available == min(before, usable_cores())
    for new_tokens, attended in ((1, 10), (2, 5000), (512, 512)):  # a light decode, a heavy one, a prefill
        assert twin.runner.threads.threads_for(new_tokens, attended) == \
            ours.runner.threads.threads_for(new_tokens, attended)
