"""Prefix-cache hits against the oracle: a request whose prompt starts with blocks an earlier request left
cached gives transformers' greedy tokens and logits (within `logits_bound`), whatever the hit covers: chat
turns with their image, the same image under another question (a hit ending inside the image), pan-and-
scan crops, a prompt past the sliding window, a hit beside running decodes, and a preempted re-hit."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from mmserve.config import DecoderConfig, EngineConfig
from mmserve.engine import Completion, Engine
from mmserve.messages import ChatRequest, SamplingParams
from tests.device import PARITY_PARAMS, TEST_DEVICE, parity_checkpoint
from tests.unit.test_parity import LONG_TEXT, Recorder, data_url, logits_bound, make_image

MAX_TOKENS = 8
PHOTO = make_image(640, 480, 21)
WIDE = make_image(1024, 400, 22)


def user(text: str, *images: Any) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def hf_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The same conversation in the HF processor's form, and how many images it holds."""
    out, n = [], 0
    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            out.append({"role": m["role"], "content": [{"type": "text", "text": content}]})
            continue
        parts = []
        for p in content:
            if p["type"] == "image_url":
                parts.append({"type": "image"})
                n += 1
            else:
                parts.append(p)
        out.append({"role": m["role"], "content": parts})
    return out, n


@pytest.fixture(scope="module", params=PARITY_PARAMS)
def oracle(request: pytest.FixtureRequest) -> tuple[Any, Any, Any]:
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model_dir, device = parity_checkpoint(request)
    model: Any = Gemma3ForConditionalGeneration.from_pretrained(model_dir)
    return model_dir, AutoProcessor.from_pretrained(model_dir), model.to(device).eval()


def reference(oracle: tuple[Any, Any, Any], messages: list[dict[str, Any]], images: list[Any],
              mm_kwargs: dict[str, Any]) -> tuple[list[int], list[torch.Tensor]]:
    _, processor, model = oracle
    conversation, n = hf_messages(messages)
    assert n == len(images)
    rendered = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=rendered, images=images or None, add_special_tokens=False, return_tensors="pt",
                       **mm_kwargs).to(model.device)
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
                         suppress_tokens=[model.config.image_token_id])  # our rule: see ModelSpec.never_sampled
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [s[0].cpu() for s in out.logits]


MakeEngine = Callable[..., tuple[Engine, Recorder]]


@pytest.fixture
def engine_for(oracle: tuple[Any, Any, Any]) -> Iterator[MakeEngine]:
    """A maker of engines on the oracle's checkpoint, each shut down when the test ends, however it ends."""
    with contextlib.ExitStack() as made:

        def make(**decoder: Any) -> tuple[Engine, Recorder]:
            rec = Recorder()
            config = EngineConfig(model=str(oracle[0]), device=TEST_DEVICE, decoder=DecoderConfig(**decoder))
            return made.enter_context(Engine(config, on_logits=rec)), rec

        yield make


def run(engine: Engine, rid: str, messages: list[dict[str, Any]], mm_kwargs: dict[str, Any] | None = None,
        max_tokens: int = MAX_TOKENS) -> Completion:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    [out] = engine.generate([ChatRequest(rid, messages, sampling, mm_kwargs or {})])
    return out


def check(oracle: Any, rec: Recorder, out: Completion, messages: list[dict[str, Any]], images: list[Any],
          mm_kwargs: dict[str, Any] | None = None) -> None:
    tokens, logits = reference(oracle, messages, images, mm_kwargs or {})
    assert out.token_ids == tokens
    for step, (ours, theirs) in enumerate(zip(rec.logits[out.request_id], logits, strict=True)):
        diff = float((ours - theirs.float()).abs().max())
        assert diff <= logits_bound(theirs), f"step {step}: max |logit diff| {diff}"


def test_chat_turns_reuse_the_history_with_its_image(oracle: Any, engine_for: MakeEngine) -> None:
    engine, rec = engine_for()
    history = [user("Describe this image.", PHOTO)]
    previous, answer = 0, None
    for turn, question in enumerate(["Describe this image.", "What colour is it?", "Anything else?"]):
        if answer is not None:
            history += [{"role": "assistant", "content": answer.text}, user(question)]
        answer = run(engine, f"turn{turn}", history)
        check(oracle, rec, answer, history, [PHOTO])
        if turn:  # at least the previous turn's prompt, but for the block it ended in
            assert answer.num_cached_tokens >= previous - engine.config.decoder.block_size
        previous = answer.num_prompt_tokens
    assert engine.stats().encoder.queries == 1  # turns 2 and 3 never asked the encoder about the image


def test_the_same_image_under_another_question_hits_inside_the_image(oracle: Any, engine_for: MakeEngine) -> None:
    engine, rec = engine_for()
    run(engine, "first", [user("What is in this picture?", PHOTO)])
    messages = [user("Tell me the colours.", PHOTO)]
    out = run(engine, "second", messages)
    check(oracle, rec, out, messages, [PHOTO])
    pre = engine.preprocess(ChatRequest("probe", messages, SamplingParams()))
    image = pre.features[0].placeholder
    assert image.offset < out.num_cached_tokens < image.offset + image.length  # the hit ends inside the image


def test_prompts_hashed_off_the_event_loop_hit_alike(oracle: Any, engine_for: MakeEngine,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of at least `HASH_OFF_LOOP_TOKENS` (here every one) is hashed on a worker thread: the same hits."""
    import threading

    from mmserve.decoder import service

    threads: list[str] = []
    hashes = service.DecoderService._block_hashes

    def recorded(self: Any, pre: Any) -> list[bytes]:
        threads.append(threading.current_thread().name)
        return hashes(self, pre)

    monkeypatch.setattr(service, "HASH_OFF_LOOP_TOKENS", 0)
    monkeypatch.setattr(service.DecoderService, "_block_hashes", recorded)
    engine, rec = engine_for()
    run(engine, "first", [user("What is in this picture?", PHOTO)])
    messages = [user("Tell me the colours.", PHOTO)]
    out = run(engine, "second", messages)
    check(oracle, rec, out, messages, [PHOTO])
    assert out.num_cached_tokens > 0 and len(threads) == 2 and all(t.startswith("asyncio") for t in threads), threads


def test_pan_and_scan_crops_and_a_prompt_past_the_window(oracle: Any, engine_for: MakeEngine) -> None:
    engine, rec = engine_for()
    pas = {"do_pan_and_scan": True}
    run(engine, "pas-first", [user("Read it.", WIDE)], pas)
    messages = [user("Read it again, slowly.", WIDE)]
    out = run(engine, "pas-second", messages, pas)
    assert out.num_cached_tokens > 0
    check(oracle, rec, out, messages, [WIDE], pas)
    run(engine, "long-first", [user(LONG_TEXT, PHOTO)])
    messages = [user(LONG_TEXT + " And then?", PHOTO)]
    out = run(engine, "long-second", messages)
    assert out.num_cached_tokens > 2 * 64  # past the tiny checkpoints' 64-token window
    check(oracle, rec, out, messages, [PHOTO])


def test_hits_beside_running_decodes_and_a_preempted_re_hit(oracle: Any, engine_for: MakeEngine) -> None:
    engine, rec = engine_for()
    scheduler = engine.decoder.scheduler
    hits: list[tuple[str, int]] = []  # (request, tokens taken from the cache) at each admission
    take, schedule = scheduler._start_from_cache, scheduler.schedule

    def spy_take(seq: Any) -> int:
        hit = take(seq)
        hits.append((seq.request_id, hit))
        return hit

    def schedule_then_preempt_once() -> Any:  # as a dry pool would: "hit" goes back to the queue mid-decode
        seq = scheduler.get("hit")
        if seq is not None and len(seq.output_token_ids) == 3 and not any(r == "hit" for r in preempted):
            preempted.append("hit")
            scheduler._preempt(seq)
        return schedule()

    preempted: list[str] = []
    scheduler._start_from_cache = spy_take  # type: ignore[method-assign]
    scheduler.schedule = schedule_then_preempt_once  # type: ignore[method-assign]
    run(engine, "seed", [user("What is in this picture?", PHOTO)])
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    long = ChatRequest("long", [user("Tell me a long story.")], SamplingParams(max_tokens=100, temperature=0.0,
                                                                               ignore_eos=True))
    messages, other = [user("Which colours?", PHOTO)], [user("Which shapes?", PHOTO)]
    outs = {o.request_id: o for o in engine.generate(
        [long, ChatRequest("hit", messages, sampling), ChatRequest("hit2", other, sampling)])}
    assert outs["hit"].num_cached_tokens > 0 and outs["hit2"].num_cached_tokens > 0  # beside the long decode
    check(oracle, rec, outs["hit"], messages, [PHOTO])
    check(oracle, rec, outs["hit2"], other, [PHOTO])
    again = [hit for rid, hit in hits if rid == "hit"]
    assert preempted == ["hit"] and len(again) >= 2 and again[-1] > again[0]  # re-hit its own prompt + outputs
    stats = engine.decoder.stats()
    assert stats.free_blocks == stats.total_blocks
