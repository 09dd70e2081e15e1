"""scripts/bench_lib: what a cell sends and counts, and the targets read from it: each cell's own hot images,
a stream that stopped short counted as failed, a target over a cell with failures failing, the machine's load
printed beside each cell."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_lib import targets
from bench_lib.loadgen import RequestResult, complete
from bench_lib.report import cell_table
from bench_lib.workloads import cell_requests


def words(text: str, add_special_tokens: bool = False) -> dict[str, list[str]]:
    """A tokenizer as far as the workloads need one: a token per word."""
    return {"input_ids": text.split()}


def test_each_concurrency_cell_has_hot_images_of_its_own() -> None:
    """A cell that reused the last cell's hot images found them in mmserve's caches already."""
    seen: dict[int, set[int]] = {}
    for c in (1, 4, 8):
        requests = cell_requests("hot", c, 16, 0, words)
        counts: dict[int, int] = {}
        for req in requests:
            for image in req.images:
                counts[image.seed] = counts.get(image.seed, 0) + 1
        seen[c] = {seed for seed, n in counts.items() if n > 1}  # the cell's hot images: those it repeats
        assert seen[c], "a hot cell repeats some images"
    assert not (seen[1] & seen[4]) and not (seen[1] & seen[8]) and not (seen[4] & seen[8])
    assert cell_requests("hot", 4, 16, 0, words) == cell_requests("hot", 4, 16, 0, words)  # still seeded


def test_a_stream_that_stopped_short_is_a_failed_request() -> None:
    req = cell_requests("unique", 1, 1, 0, words)[0]
    short = RequestResult(req.key, True, 0.0, 0.01, 0.02, 5, 300)
    assert not complete(short, req).ok and "5 output tokens" in (complete(short, req).error or "")
    whole = RequestResult(req.key, True, 0.0, 0.1, 0.5, req.max_tokens, 300)
    assert complete(whole, req) == whole


def _cell(ok: int, ttft: float, req_per_s: float) -> dict[str, Any]:
    return {"ok": ok, "requests": 16, "ttft_p50_s": ttft, "req_per_s": req_per_s}


def test_a_target_over_a_cell_with_failed_requests_fails_and_issue_17s_lines_are_printed() -> None:
    results = {"unique": {"mmserve": {1: _cell(16, 0.3, 1.5), 8: _cell(16, 1.0, 2.0)},
                          "transformers": {1: _cell(16, 0.4, 1.4), 8: _cell(13, 2.0, 1.0)}},
               "hot": {"mmserve": {1: _cell(14, 0.1, 9.0)}, "transformers": {1: _cell(16, 0.4, 1.4)}}}
    lines = {t.name: t for t in targets.evaluate(results, {}, {})}
    assert lines["unique c=1 TTFT p50 <= 1.0x transformers serve"].status == "PASS"  # 0.3 / 0.4
    hot = lines["hot c=1 throughput >= 1.0x transformers serve"]
    assert hot.status == "FAIL" and "mmserve: 2 of 16" in hot.detail  # fast, but two requests failed
    peer = lines["unique c=8 throughput >= 1.3x transformers serve"]
    assert peer.status == "SKIP" and "transformers: 3 of 16" in peer.detail  # nothing to compare with
    assert any("1.1x in-process Engine" in name for name in lines)
    results["unique"]["mmserve"][1]["prompt_tokens_mean"] = 300.0  # another prompt than the peer's
    results["unique"]["transformers"][1]["prompt_tokens_mean"] = 320.0
    other = {t.name: t for t in targets.evaluate(results, {}, {})}["unique c=1 TTFT p50 <= 1.0x transformers serve"]
    assert other.status == "SKIP" and "prompts differ" in other.detail


def test_the_grammar_cells_decoders_run_in_blocks_and_pair_each_step_with_its_place_in_the_next_block(
        monkeypatch: Any) -> None:
    """A constrained step's masks for its next step are made beside that step: each Decoder runs several
    steps in a row (not one each in turn, which put that work beside the other Decoder's step)."""
    from bench_lib import grammar_cost

    ran: list[str] = []
    clock = {"A": iter(range(1000, 2000)), "B": iter(range(2000, 3000))}

    def timed_step(decoder: Any) -> float:
        ran.append(decoder)
        return float(next(clock[decoder]))

    monkeypatch.setattr(grammar_cost, "timed_step", timed_step)
    monkeypatch.setattr(grammar_cost, "start", lambda *args: [])
    monkeypatch.setattr(grammar_cost, "stop", lambda *args: None)
    pairs = grammar_cost.paired("A", "B", None, 32, 4, block=4)
    assert "".join(ran) == "AAAABBBBBBBBAAAA" * 4  # 32 steps each
    # each block's first step dropped, then the first two pairs of blocks: a's 2nd-4th steps of its third block
    assert pairs[0] == (1009.0, 2009.0) and len(pairs) == 3 * 8 - 6


def test_each_cell_shows_the_cores_others_and_the_host_took_meanwhile() -> None:
    """A cell slowed by the hypervisor (steal) reads as slow as one slowed by a stray process: both are printed."""
    row = {"req_per_s": 1.0, "machine_load": {"foreign_cores": 0.12, "own_cores": 1.0, "steal_cores": 0.39}}
    table = cell_table({"unique": {"mmserve": {1: row}, "engine": {1: {"req_per_s": 2.0}}}}, ["mmserve", "engine"])
    head, _, mine, peer = table.splitlines()[:4]
    assert head.split()[-2:] == ["others", "steal"]
    assert mine.split()[-2:] == ["0.12", "0.39"] and peer.split()[-2:] == ["-", "-"]
