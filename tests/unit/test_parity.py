"""Parity with the oracle: transformers' Gemma3ForConditionalGeneration on the same checkpoint.

Greedy tokens must be identical and every step's logits within LOGITS_ATOL (float32, CPU). The
reference inputs come from transformers' own Gemma3Processor, so this checks the front end, the
encoder, the image merge, the attention pattern and the paged KV cache together.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.config import DecoderConfig, EngineConfig
from mmserve.decoder import attention
from mmserve.engine import Engine
from mmserve.messages import ChatRequest, SamplingParams
from mmserve.preprocess.image_runs import image_token_runs
from mmserve.runtime import matmul_forms
from mmserve.runtime.matmul_forms import LINEAR, ONEDNN, PackedLinear, onednn_packing_available
from tests.device import PARITY_PARAMS, TEST_DEVICE, parity_checkpoint

# Max |ours - reference| over the vocab, every step. NOTE: two implementations with their own kernels and
# summation orders through every layer; logits are O(1..10), so this is ~1000 float32 ulps of the largest,
# and a real bug (a missing image mask, a wrong position) moves them by 1e-2 or more.
LOGITS_ATOL = 1e-3
MAX_TOKENS = 10


def logits_bound(reference: torch.Tensor) -> float:
    """LOGITS_ATOL, or the same ~1000 ulps of a reference whose largest logit passes 10 (a checkpoint wider or
    deeper than the tiny ones: MMSERVE_TEST_PARITY_CHECKPOINT)."""
    return LOGITS_ATOL * max(1.0, float(reference.abs().max()) / 10)

# Generations several sliding windows long (the tiny checkpoints' window is 64 tokens): every sliding layer
# has dropped blocks by then, and each step reads only the window's.
LONG_GENERATION = 160


def make_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, size=(8, 8, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((width, height), Image.Resampling.BILINEAR)


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


LONG_TEXT = " ".join(f"Sentence {i} talks about the weather, the sea and the mountains." for i in range(12))

CASES = {
    "text": ([], "Tell me a story about a dragon.", {}),
    "one_image": ([(640, 480, 1)], "Describe this image.", {}),
    "two_images": ([(640, 480, 2), (300, 500, 3)], "Compare the two images.", {}),
    "pan_and_scan": ([(1024, 400, 4)], "What is written here?", {"do_pan_and_scan": True}),
    "long_text": ([], LONG_TEXT, {}),  # far past the sliding window
    "long_with_image": ([(500, 500, 5)], LONG_TEXT, {}),
    "long_generation": ([], "Write a very long story.", {}),
    "long_generation_with_image": ([(400, 300, 6)], LONG_TEXT, {}),
}


def max_tokens(case: str) -> int:
    return LONG_GENERATION if case.startswith("long_generation") else MAX_TOKENS


def build_request(case: str, request_id: str | None = None) -> tuple[ChatRequest, list[Image.Image]]:
    specs, text, mm_kwargs = CASES[case]
    images = [make_image(w, h, s) for w, h, s in specs]
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    sampling = SamplingParams(max_tokens=max_tokens(case), temperature=0.0, ignore_eos=True)
    return ChatRequest(request_id or case, messages, sampling, mm_kwargs), images


def reference(model_dir, processor, model, case: str) -> tuple[list[int], list[torch.Tensor], int]:
    """Greedy tokens and per-step logits from transformers, on inputs made by its own processor."""
    _, text, mm_kwargs = CASES[case]
    _, images = build_request(case)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    rendered = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    inputs = processor(text=rendered, images=images or None, add_special_tokens=False, return_tensors="pt",
                       **mm_kwargs).to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_tokens(case), do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
                         suppress_tokens=[model.config.image_token_id])  # our rule: see ModelSpec.never_sampled
    n_prompt = inputs["input_ids"].shape[1]
    return out.sequences[0, n_prompt:].tolist(), [s[0].cpu() for s in out.logits], n_prompt


class Recorder:
    def __init__(self):
        self.logits: dict[str, list[torch.Tensor]] = {}

    def __call__(self, ids: list[str], logits: torch.Tensor) -> None:
        for i, rid in enumerate(ids):
            self.logits.setdefault(rid, []).append(logits[i].float().cpu().clone())  # beside the CPU oracle's


@pytest.fixture
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[Engine, Recorder]]]:
    """A maker of engines that are shut down when the test ends (NOTE: each holds a step thread, its OpenMP
    pool and its KV pool; left running, the module's ~20 per checkpoint slowed every later test). It asks
    for `monkeypatch` so that the engines stop before a test's patches are undone."""
    with contextlib.ExitStack() as made:

        def make(model_dir, **scheduler) -> tuple[Engine, Recorder]:
            rec = Recorder()
            config = EngineConfig(model=str(model_dir), device=TEST_DEVICE, decoder=DecoderConfig(**scheduler))
            return made.enter_context(Engine(config, on_logits=rec)), rec

        yield make


@pytest.fixture(scope="module", params=PARITY_PARAMS)
def oracle(request):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model_dir, device = parity_checkpoint(request)
    processor = AutoProcessor.from_pretrained(model_dir)
    model: Any = Gemma3ForConditionalGeneration.from_pretrained(model_dir)
    model = model.to(device).eval()
    refs = {case: reference(model_dir, processor, model, case) for case in CASES}
    del model  # NOTE: freed before the engines load (a gemma-3-4b-size oracle on the GPU holds 17 GB)
    return model_dir, refs


def assert_matches(ref, tokens: list[int], logits: list[torch.Tensor], n_prompt: int, num_prompt: int) -> None:
    ref_tokens, ref_logits, ref_prompt = ref
    assert num_prompt == ref_prompt
    # NOTE: step by step, up to a divergence (the shorter's end: the lengths are asserted after)
    for step, (ours, theirs) in enumerate(zip(logits, ref_logits, strict=False)):
        diff = float((ours - theirs.float()).abs().max())
        assert diff <= logits_bound(theirs), f"step {step}: max |logit diff| {diff}"
        if step < min(len(tokens), len(ref_tokens)) and tokens[step] != ref_tokens[step]:
            top = theirs.float().flatten().topk(2).values
            pytest.fail(f"step {step}: token {tokens[step]} where transformers chose {ref_tokens[step]}, with every "
                        f"logit within {diff:.3g} of its; its top two logits are {float(top[0] - top[1]):.3g} apart "
                        "(a gap that small is a near-tie the two sums' order can flip)")
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)


@pytest.mark.parametrize("case", list(CASES))
def test_alone_matches_transformers(oracle, case, make_engine):
    model_dir, refs = oracle
    engine, rec = make_engine(model_dir)
    request, _ = build_request(case)
    [out] = engine.generate([request])
    assert_matches(refs[case], out.token_ids, rec.logits[case], 0, out.num_prompt_tokens)


def test_concurrent_batch_matches_each_alone(oracle, make_engine):
    """All cases at once through continuous batching = each alone = transformers."""
    model_dir, refs = oracle
    engine, rec = make_engine(model_dir)
    outs = engine.generate([build_request(case)[0] for case in CASES])
    for case, out in zip(CASES, outs, strict=True):
        assert_matches(refs[case], out.token_ids, rec.logits[case], 0, out.num_prompt_tokens)
    stats = engine.decoder.stats()  # every page back: free, or a prefix-cache entry nobody holds
    assert stats.free_blocks == stats.total_blocks


@pytest.mark.parametrize("pages", [None, 10])
def test_kept_gathers_match(oracle, pages, make_engine):
    """Every decode group's gathers kept from step to step (mmserve/decoder/kept_gather.py), with room for all
    layers or for some only (`pages` of this checkpoint's KV pages); all cases batched, so that sequences join and
    leave the decode group, with prefill chunks beside it, as in test_chunked_prefill_matches."""
    model_dir, refs = oracle
    budget = 1 << 30 if pages is None else pages * _page_bytes(model_dir)
    engine, rec = make_engine(model_dir, kept_gathers_min_bytes=0, kept_gathers_bytes=budget,
                              max_num_batched_tokens=300)
    kept = engine.decoder.runner.kept
    assert kept is not None
    started = kept.positions, kept.copied  # NOTE: after the start-up's scratch steps, whose groups change each step
    outs = engine.generate([build_request(case)[0] for case in CASES])
    for case, out in zip(CASES, outs, strict=True):
        assert_matches(refs[case], out.token_ids, rec.logits[case], 0, out.num_prompt_tokens)
    assert 0 < kept.nbytes <= budget
    positions, copied = kept.positions - started[0], kept.copied - started[1]
    assert 0 < copied < positions // 2  # most positions were kept, not copied again


def _page_bytes(model_dir: Any) -> int:
    """One KV page's keys and values in float32 at the default block size (bytes): 4 KiB on the tiny checkpoints,
    6 KiB on the GQA one (two kv heads of 24)."""
    from mmserve.config import DecoderConfig

    text = json.loads((Path(model_dir) / "config.json").read_text())["text_config"]
    return DecoderConfig().block_size * text["num_key_value_heads"] * text["head_dim"] * 4 * 2


def test_kept_gathers_after_failed_forwards_match(oracle, monkeypatch, make_engine):
    """Every 5th batched decode forward raises after two layers have refreshed their kept gathers and before
    the others do; the Decoder runs each sequence again alone (`Decoder._execute`), the kept layouts are
    forgotten, and every case still matches."""
    model_dir, refs = oracle
    engine, rec = make_engine(model_dir, kept_gathers_min_bytes=0)
    real, seen = attention._attend, {"layers": 0}

    def failing(q, kv, group, read, rank, pattern):
        # NOTE: the decode group keeping its gathers, in a step of several sequences (one alone would just fail)
        if read.kept is not None and (group.batch > 1 or group.token_index is not None):
            seen["layers"] += 1
            if seen["layers"] % (5 * engine.spec.num_layers) == 3:  # the 3rd layer of every 5th such forward
                raise RuntimeError("injected")
        return real(q, kv, group, read, rank, pattern)

    monkeypatch.setattr(attention, "_attend", failing)
    outs = engine.generate([build_request(case)[0] for case in CASES])
    assert seen["layers"] > 10 * engine.spec.num_layers
    for case, out in zip(CASES, outs, strict=True):
        assert_matches(refs[case], out.token_ids, rec.logits[case], 0, out.num_prompt_tokens)


def test_chunked_prefill_matches(oracle, make_engine):
    """A small step budget splits prompts into chunks (never inside an image) with the same result."""
    model_dir, refs = oracle
    cases = ["two_images", "long_with_image", "text"]
    # NOTE: room for any image whole (these cases have no crops), and less than the longest prompt (the oracle's
    # count), on every checkpoint: a fixed 300 split nothing where images are 16 tokens
    image_tokens = json.loads((Path(model_dir) / "config.json").read_text())["mm_tokens_per_image"]
    budget = max(image_tokens + 8, 100)
    assert budget < max(refs[case][2] for case in cases)
    engine, rec = make_engine(model_dir, max_num_batched_tokens=budget, max_num_seqs=4)
    runner, execute = engine.decoder.runner, engine.decoder.runner.execute
    later_chunks: list[str] = []
    seen: set[str] = set()

    def spied(scheduled):  # NOTE: the premise: some prompt is computed in more than one step
        later_chunks.extend(seq.request_id for seq, n in scheduled if seq.request_id in seen and n > 1)
        seen.update(seq.request_id for seq, _ in scheduled)
        return execute(scheduled)

    runner.execute = spied
    outs = engine.generate([build_request(case)[0] for case in cases])
    assert later_chunks, "no prompt was split: the budget no longer chunks these cases"
    for case, out in zip(cases, outs, strict=True):
        assert_matches(refs[case], out.token_ids, rec.logits[case], 0, out.num_prompt_tokens)


def test_pan_and_scan_item_split_between_crops_matches(oracle, make_engine):
    """A step budget smaller than a pan-and-scan item, but holding any one crop, splits the item
    between its crops (never inside one) with the same result."""
    model_dir, refs = oracle
    probe, _ = make_engine(model_dir)
    pre = probe.preprocessor.process(build_request("pan_and_scan")[0])
    runs = image_token_runs(pre.prompt_token_ids, probe.spec.image_token_id)
    budget = max(end - start for start, end in runs) + 8
    assert len(runs) > 2 and max(f.placeholder.length for f in pre.features) > budget  # the item needs 2+ steps
    engine, rec = make_engine(model_dir, max_num_batched_tokens=budget)
    out = engine.generate([build_request("pan_and_scan")[0]])[0]
    assert_matches(refs["pan_and_scan"], out.token_ids, rec.logits["pan_and_scan"], 0, out.num_prompt_tokens)


@pytest.mark.parametrize("case", ["one_image", "long_generation"])
def test_greedy_logprobs_are_log_softmax_of_transformers_logits(oracle, case, make_engine):
    model_dir, refs = oracle
    ref_tokens, ref_logits, _ = refs[case]
    engine, _ = make_engine(model_dir)
    request, _ = build_request(case)
    [out] = engine.generate([replace(request, sampling=replace(request.sampling, logprobs=5))])
    assert out.token_ids == ref_tokens and out.logprobs is not None and len(out.logprobs) == len(ref_tokens)
    for step, (lp, theirs) in enumerate(zip(out.logprobs, ref_logits, strict=True)):
        ref_lp = torch.log_softmax(theirs.float(), dim=-1)  # (vocab,)
        assert lp.token_id == ref_tokens[step] and lp.token == engine.preprocessor.tokenizer.decode([lp.token_id])
        # log_softmax moves by at most twice the largest logit difference
        assert abs(lp.logprob - float(ref_lp[lp.token_id])) <= 2 * LOGITS_ATOL, step
        values = [v for _, _, v, _ in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True)
        assert max(abs(v - float(r)) for v, r in zip(values, ref_lp.topk(5).values, strict=True)) <= 2 * LOGITS_ATOL
        # each listed token's own logprob (its id, not only the value at its rank)
        assert all(abs(v - float(ref_lp[t])) <= 2 * LOGITS_ATOL for t, _, v, _ in lp.top), step
        assert lp.logprob <= values[0] + 1e-6  # greedy: the best, unless the best is a never-sampled token
        assert lp.token_id in [t for t, _, _, _ in lp.top] or lp.top[0][0] in engine.spec.never_sampled


@pytest.mark.parametrize("one_row", ["transposed", "doubled", ONEDNN])
def test_every_matmul_form_matches_transformers(oracle, one_row, monkeypatch, make_engine):
    """The forms a CPU may measure fastest (runtime/matmul_forms.py), forced for every row count: one row by
    `one_row`, any more rows (decodes and prefill chunks) as mm(w, x.T).T; or oneDNN's product measured
    fastest, so that the decoder layers' weights and the vision tower's linear layers are packed for it (the
    lm_head, tied to the embeddings, stays plain). All cases batched."""
    model_dir, refs = oracle
    calls: list[int] = []
    if one_row == ONEDNN:
        if not onednn_packing_available():
            pytest.skip("this torch build has no oneDNN packing")
        monkeypatch.setattr(matmul_forms, "_timings", lambda cycle, packed, rows, rounds: {
            LINEAR: 1.0, "transposed": 1.0, "doubled": 1.0, ONEDNN: 0.5})
        forward = PackedLinear.forward

        def counted(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return forward(self, x)

        monkeypatch.setattr(PackedLinear, "forward", counted)
    else:  # NOTE: oneDNN measured slowest, so that no weight is packed (a packed one ignores the forms)
        monkeypatch.setattr(matmul_forms, "_timings", lambda cycle, packed, rows, rounds: {
            LINEAR: 1.0, "transposed": 1.0, "doubled": 1.0, ONEDNN: 2.0})
        form = matmul_forms.FORMS[one_row]

        def counted_form(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return form(x, w)

        monkeypatch.setitem(matmul_forms.FORMS, one_row, counted_form)
    engine, rec = make_engine(model_dir)
    model = engine.decoder.runner.model
    if one_row == ONEDNN:
        assert all(w.is_mkldnn for w in model.linear_weights())
    else:
        forced = (LINEAR, one_row, *("transposed",) * 4096)
        model.matmul.chosen = {count: forced for count in range(1, (os.cpu_count() or 1) + 1)}
    outs = engine.generate([build_request(case)[0] for case in CASES])
    for case, out in zip(CASES, outs, strict=True):
        assert_matches(refs[case], out.token_ids, rec.logits[case], 0, out.num_prompt_tokens)
    assert calls  # the vision tower ran on packed weights, or the decode steps in the forced form
    assert one_row == ONEDNN or not any(w.is_mkldnn for w in model.linear_weights())


def test_weights_relaid_while_generating_match_transformers(oracle, monkeypatch, make_engine):
    """Timed at start-up as slower at decode sizes but so much faster on a prefill chunk that the weights are
    packed (and the start-up thread timing's decodes change nothing); then the steps served make the layout
    policy take them plain, one weight per step, so that steps run with weights in both layouts: every step
    matches transformers. All cases batched."""
    if not onednn_packing_available():
        pytest.skip("this torch build has no oneDNN packing")
    model_dir, refs = oracle
    monkeypatch.setattr(matmul_forms, "_timings", lambda cycle, packed, rows, rounds: {
        LINEAR: 1.0, "transposed": 1.0, "doubled": 1.0, ONEDNN: 2.0 if rows <= 16 else 1e-7})
    engine, rec = make_engine(model_dir)
    layout, weights = engine.decoder.runner.layout, engine.decoder.runner.model.linear_weights
    assert layout is not None and layout.packed and all(w.is_mkldnn for w in weights())
    assert layout.changes == [] and layout.policy.loss == 0.0  # the thread timing's decodes were not priced
    # priced by whole scratch steps: decodes of 1 to 16 short sequences and a prefill chunk, at every count a step
    # may run with; back in the layout it began in
    counts = engine.decoder.runner.threads.possible_counts()
    assert layout.policy.timed_share == 1.0 and set(layout.policy.costs) == counts
    assert all(set(t) == {1, 2, 4, 8, 16, 128} for t in layout.policy.costs.values())
    # from here on packed loses at every size: the first steps make it plain, then one weight per step
    layout.policy.costs = {n: {rows: (1.0, 4.0) for rows in table} for n, table in layout.policy.costs.items()}
    packed_per_step: list[int] = []
    relay_one = layout.relay_one

    def counted() -> None:
        relay_one()
        packed_per_step.append(sum(w.is_mkldnn for w in weights()))

    monkeypatch.setattr(layout, "relay_one", counted)
    outs = engine.generate([build_request(case)[0] for case in CASES])
    for case, out in zip(CASES, outs, strict=True):
        assert_matches(refs[case], out.token_ids, rec.logits[case], 0, out.num_prompt_tokens)
    assert layout.changes == [False] and layout.settled and not any(w.is_mkldnn for w in weights())
    n = len(weights())
    changing = [k for k in packed_per_step[: packed_per_step.index(0) + 1] if k < n]
    assert changing == list(range(n - 1, -1, -1))  # one weight fewer packed each step
