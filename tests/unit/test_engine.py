"""The in-process engine end to end: caching tiers, streaming, aborts, errors, sampling options."""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.config import DecoderConfig, EncoderConfig, EngineConfig, MediaConfig
from mmserve.decoder.sampler import Sampler
from mmserve.engine import Engine
from mmserve.errors import (
    InvalidRequestError,
    InvalidSamplingError,
    MediaError,
    PromptTooLongError,
    TooManyItemsError,
    UnsupportedURLError,
)
from mmserve.messages import ChatRequest, DecodeRequest, SamplingParams, StructuredOutput
from mmserve.runtime.device_errors import DeviceFault
from mmserve.runtime.shared_cores import HOST
from mmserve.stages import StageFactory
from tests.unit.test_parity import data_url, make_image

IMAGE = data_url(make_image(640, 480, seed=11))
WIDE = data_url(make_image(1024, 300, seed=12))


def chat(request_id: str, *urls: str, text: str = "What is this?", **sampling) -> ChatRequest:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    return ChatRequest(request_id, [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                       SamplingParams(**sampling))


@pytest.fixture(scope="module")
def engine(tiny_ckpt_224):
    config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048,
                          media=MediaConfig(max_images_per_prompt=2))
    eng = Engine(config)
    yield eng
    eng.shutdown()


def test_repeated_image_skips_processor_and_encoder(engine):
    before = engine.stats()
    engine.generate([chat("c1", IMAGE)])
    first = engine.stats()
    assert first.image_processor_calls == before.image_processor_calls + 1
    assert first.encoder.forward_passes == before.encoder.forward_passes + 1
    engine.generate([chat("c2", IMAGE, text="And now?")])
    second = engine.stats()
    assert second.image_processor_calls == first.image_processor_calls  # ProcessorCache hit
    assert second.encoder.forward_passes == first.encoder.forward_passes
    assert second.processor_cache.hits == first.processor_cache.hits + 1
    # the image's last rows share a block with the new text, so they are computed again, from the embeddings
    # the decoder kept: the encoder is not asked
    assert second.encoder.queries == first.encoder.queries
    kept, before_kept = second.decoder.embedding_cache, first.decoder.embedding_cache
    assert kept is not None and before_kept is not None
    assert (kept.queries, kept.hits) == (before_kept.queries + 1, before_kept.hits + 1)


def test_without_the_decoders_embedding_cache_a_repeat_is_an_encoder_hit(engine, tiny_ckpt_224):
    # a salt of their own: nothing of theirs is in the prefix cache, whatever ran before on this engine
    [k1] = engine.generate([replace(chat("k1", IMAGE), cache_salt="k")])
    hits = engine.stats().decoder.embedding_cache
    [k2] = engine.generate([replace(chat("k2", IMAGE, text="And now?"), cache_salt="k")])
    after = engine.stats().decoder.embedding_cache
    assert hits is not None and after is not None and after.hits == hits.hits + 1  # k2's image from the cache
    config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048,
                          decoder=DecoderConfig(embedding_cache_bytes=0, measure_matmul_forms=False))
    with Engine(config) as engine:
        [a] = engine.generate([chat("c1", IMAGE)])
        first = engine.stats()
        [b] = engine.generate([chat("c2", IMAGE, text="And now?")])
        second = engine.stats()
    assert (second.encoder.queries, second.encoder.hits) == (first.encoder.queries + 1, first.encoder.hits + 1)
    assert second.encoder.forward_passes == first.encoder.forward_passes
    assert second.decoder.embedding_cache is not None and second.decoder.embedding_cache.entries == 0
    assert [a.text, b.text] == [k1.text, k2.text]  # the kept embeddings are the encoder's


def test_other_pan_and_scan_setting_misses(engine):
    engine.generate([chat("p1", WIDE)])
    calls = engine.stats().image_processor_calls
    req = chat("p2", WIDE)
    req = ChatRequest(req.request_id, req.messages, req.sampling, {"do_pan_and_scan": True})
    [out] = engine.generate([req])
    assert engine.stats().image_processor_calls == calls + 1
    [plain] = engine.generate([chat("p3", WIDE)])
    assert out.num_prompt_tokens > plain.num_prompt_tokens  # crops add placeholders


def test_stream_matches_generate_and_runs_concurrently(engine):
    [ref_a] = engine.generate([chat("g1", IMAGE, max_tokens=12)])
    [ref_b] = engine.generate([chat("g2", text="Hello there", max_tokens=12)])

    async def collect(req):
        return [out async for out in engine.stream(req)]

    async def both():
        return await asyncio.gather(collect(chat("s1", IMAGE, max_tokens=12)),
                                    collect(chat("s2", text="Hello there", max_tokens=12)))

    outs_a, outs_b = asyncio.run(both())
    for outs, ref in ((outs_a, ref_a), (outs_b, ref_b)):
        assert "".join(o.new_text for o in outs) == ref.text
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
        assert outs[-1].finished and outs[-1].finish_reason == ref.finish_reason
        assert outs[-1].num_output_tokens == len(ref.token_ids)


def test_abort_mid_stream_frees_blocks_and_references(engine):
    max_tokens = 4000

    async def start_then_leave():
        got = 0
        stream = engine.stream(chat("ab1", IMAGE, max_tokens=max_tokens, ignore_eos=True))
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()
        # NOTE: closed through every layer at once, not when the loop's finalizer gets to an orphaned one
        assert "ab1" not in engine.decoder_service.loop._channels and "ab1" not in engine.decoder_service._live
        for _ in range(3000):  # the abort is applied by the step loop
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        return got

    steps_before = engine.decoder.stats().steps
    assert asyncio.run(start_then_leave()) == 3
    stats = engine.decoder.stats()  # every page back: free, or a prefix-cache entry nobody holds
    # NOTE: a request that ran to its end would have made a step per token: the abort cut it short
    assert stats.steps - steps_before < max_tokens // 2
    assert stats.free_blocks == stats.total_blocks
    assert stats.running == 0
    assert engine.encoder.manager.referencing_requests() == []
    assert "ab1" not in engine.decoder.request_ids()


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (chat("e1", "data:image/png;base64,bm90IGFuIGltYWdl"), MediaError),  # "not an image"
        (chat("e2", "data:image/png;base64,%%%"), MediaError),
        (chat("e3", "ftp://example.com/cat.png"), UnsupportedURLError),
        (chat("e4", IMAGE, IMAGE, IMAGE), TooManyItemsError),
        (chat("e5", text="word " * 3000), PromptTooLongError),
        (chat("e6", temperature=-1.0), InvalidSamplingError),
        (chat("e7", stop=tuple(f"s{i}" for i in range(17))), InvalidSamplingError),  # limits.max_stop_sequences
        (chat("e8", stop=("x" * 257,)), InvalidSamplingError),  # limits.max_stop_chars
        (chat("e9", text="x" * 70_000), PromptTooLongError),  # 32 characters per token of max_model_len 2048
    ],
)
def test_bad_input_raises_client_error_and_engine_keeps_serving(engine, request_, error):
    async def run():
        return [o async for o in engine.stream(request_)]

    with pytest.raises(error) as info:
        asyncio.run(run())
    assert isinstance(info.value, InvalidRequestError) and info.value.status == 400
    assert "limit" in str(info.value) or request_.request_id not in ("e7", "e8", "e9"), info.value
    [ok] = engine.generate([chat("after-" + request_.request_id, IMAGE)])
    assert ok.finish_reason in ("stop", "length")


def test_stop_string_cuts_text(engine):
    [full] = engine.generate([chat("st1", IMAGE, max_tokens=16, ignore_eos=True)])
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), f"need visible text to stop on, got {full.text!r}"
    [cut] = engine.generate([chat("st2", IMAGE, max_tokens=16, ignore_eos=True, stop=(stop,))])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop  # vLLM's `stop_reason`: what stopped it
    assert cut.text == full.text[: full.text.index(stop)]
    assert full.stop_reason is None  # "length"
    token = full.token_ids[3]
    [by_id] = engine.generate([chat("st3", IMAGE, max_tokens=16, ignore_eos=True, stop_token_ids=(token,))])
    assert (by_id.finish_reason, by_id.stop_reason, by_id.token_ids[-1]) == ("stop", token, token)


def test_the_checkpoints_end_of_turn_is_named_as_the_stop_reason_and_the_tokenizers_end_is_not(engine):
    """As vLLM: generation_config's end ids other than the tokenizer's own count as stop token ids."""
    from mmserve.decoder.sequence import Sequence

    named = engine.decoder._named_ends
    tokenizer_end = engine.decoder.tokenizer.eos_token_id
    assert named and tokenizer_end not in named and set(named) <= set(engine.spec.eos_token_ids)
    turn = min(named)
    seq = Sequence("r", [5, 6], SamplingParams(max_tokens=4), finish_reason="stop")
    assert seq.stop_reason(turn, None, named) == turn and seq.stop_reason(tokenizer_end, None, named) is None
    ignoring = Sequence("r", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True), finish_reason="stop")
    assert ignoring.stop_reason(turn, None, named) is None
    # the tokenizer's end listed as a stop token id: vLLM checks that end first and names it only when ignored
    end_first: dict[str, Any] = {"max_tokens": 4, "stop_token_ids": (tokenizer_end,),
                                 "logit_bias": ((tokenizer_end, 100.0),)}
    [ended] = engine.generate([chat("tke1", **end_first)])
    [listed] = engine.generate([chat("tke2", ignore_eos=True, **end_first)])
    assert [(o.token_ids[-1], o.finish_reason, o.stop_reason) for o in (ended, listed)] == \
        [(tokenizer_end, "stop", None), (tokenizer_end, "stop", tokenizer_end)]
    # a grammar's end, which vLLM lets end only on the tokenizer's end token: named by none
    constrained = Sequence("r", [5, 6], SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "a")),
                           finish_reason="stop")
    assert constrained.stop_reason(turn, None, named) is None


def test_a_stop_string_ends_as_a_stop_on_the_last_token_allowed_and_not_before_min_tokens(engine):
    """As vLLM: a stop string completed by the last token max_tokens allows is still a stop, and one that
    completes within the first min_tokens tokens does not end the text (one that ends later does)."""
    texts = [""] + [out.text for k in range(1, 13)
                    for [out] in [engine.generate([chat(f"sm{k}", max_tokens=k, ignore_eos=True)])]]
    found = [(k, c) for k in range(1, 13) for i, c in enumerate(texts[k][len(texts[k - 1]):])
             if c.strip() and c not in texts[k][: len(texts[k - 1]) + i]]  # a character's first sighting
    assert found, f"need visible text to stop on, got {texts[-1]!r}"
    k, stop = found[0]  # the first occurrence of `stop` completes at token k
    [last] = engine.generate([chat("sm-last", max_tokens=k, ignore_eos=True, stop=(stop,))])
    assert last.finish_reason == "stop" and last.text == texts[k][: texts[k].index(stop)]
    [before] = engine.generate([chat("sm-before", max_tokens=12, ignore_eos=True, stop=(stop,), min_tokens=k - 1)])
    assert before.finish_reason == "stop" and before.text == last.text  # token k is past min_tokens
    [held] = engine.generate([chat("sm-held", max_tokens=12, ignore_eos=True, stop=(stop,), min_tokens=k)])
    assert len(held.token_ids) > k and held.text.startswith(texts[k])  # not matched at token k


def test_a_second_request_under_a_live_id_is_refused_and_the_first_goes_on(engine):
    async def run() -> list[Any]:
        first = engine.stream(chat("dup", max_tokens=24, ignore_eos=True))
        outs = [await first.__anext__()]
        with pytest.raises(ValueError, match="already being served"):
            async for _ in engine.stream(chat("dup", max_tokens=4)):
                pass
        outs += [out async for out in first]
        return outs

    outs = asyncio.run(asyncio.wait_for(run(), 60))
    assert outs[-1].finished and outs[-1].finish_reason == "length"  # it was neither aborted nor left waiting
    assert sum(len(out.new_token_ids) for out in outs) == 24 and not engine.has_unfinished()


def test_ids_taken_by_a_live_request_with_choices_are_refused_before_anything_runs(engine):
    """A request with n > 1 is served as choices `id/0`, `id/1`, ...: its own id and its choices' are taken."""
    clash = engine.preprocess(chat("dupn/1", max_tokens=4))  # NOTE: ready beforehand: no wait before it is sent

    async def run() -> list[Any]:
        first = engine.stream(chat("dupn", max_tokens=24, ignore_eos=True, n=2, temperature=1.0, seed=3))
        opened = asyncio.ensure_future(first.__anext__())
        while "dupn" not in engine.decoder_service._reserved:  # NOTE: taken as it starts, before any output
            await asyncio.sleep(0.001)
        # a choice's id before that choice runs (it waits for choice 0's first output); nothing awaited between
        assert "dupn/1" not in engine.decoder_service._live
        with pytest.raises(ValueError, match="dupn/1 is already being served"):
            async for _ in engine._serve(clash):
                pass
        outs = [await opened]
        with pytest.raises(ValueError, match="dupn is already being served"):
            async for _ in engine.stream(chat("dupn", max_tokens=4)):
                pass
        outs += [out async for out in first]
        return outs

    async def with_a_live_choice_id() -> list[Any]:
        live = engine.stream(chat("dupc/1", max_tokens=24, ignore_eos=True))
        await live.__anext__()
        got: list[Any] = []
        try:
            async for out in engine.stream(chat("dupc", max_tokens=4, n=2)):
                got.append(out)
        finally:
            rest = [out async for out in live]
            assert got == []  # NOTE: refused before its choice 0 ran, not when its choice 1 met the live id
        return rest

    outs = asyncio.run(asyncio.wait_for(run(), 60))
    assert [sum(len(o.new_token_ids) for o in outs if o.index == i) for i in (0, 1)] == [24, 24]
    with pytest.raises(ValueError, match="dupc/1 is already being served"):
        asyncio.run(asyncio.wait_for(with_a_live_choice_id(), 60))
    assert not engine.has_unfinished()


def test_a_stop_token_ends_the_ids_but_not_the_text(engine):
    """As vLLM: the stop token id is in the output's ids, its text is not (nor is the model's own end's)."""
    [full] = engine.generate([chat("sti1", max_tokens=8, ignore_eos=True)])
    ids = full.token_ids
    last = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a token not seen before it
    [cut] = engine.generate([chat("sti2", max_tokens=8, ignore_eos=True, stop_token_ids=(ids[last],))])
    assert cut.finish_reason == "stop" and cut.token_ids == ids[: last + 1]
    [upto] = engine.generate([chat("sti3", max_tokens=last, ignore_eos=True)])  # the same ids but the stop token
    assert cut.text == upto.text and upto.token_ids == ids[:last]
    [kept] = engine.generate([chat("sti4", max_tokens=8, ignore_eos=True, stop_token_ids=(ids[last],),
                                   include_stop_str_in_output=True)])  # vLLM's: the text keeps what stopped it
    [through] = engine.generate([chat("sti5", max_tokens=last + 1, ignore_eos=True)])
    assert kept.token_ids == ids[: last + 1] and kept.text == through.text != cut.text
    assert kept.stop_reason == ids[last]
    # the stop token's kept text is also a stop string: as vLLM (since v0.10.1) the string names the stop
    own = through.text[len(upto.text):]
    assert own.strip() and own not in upto.text, f"need a token with text of its own, got {own!r}"
    [both] = engine.generate([chat("sti6", max_tokens=8, ignore_eos=True, stop_token_ids=(ids[last],), stop=(own,),
                                   include_stop_str_in_output=True)])
    assert (both.token_ids, both.text, both.finish_reason, both.stop_reason) == (kept.token_ids, kept.text, "stop",
                                                                                 own)


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    kw: dict[str, Any] = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234, "max_tokens": 12,
                          "ignore_eos": True}
    [alone] = engine.generate([chat("r1", IMAGE, **kw)])
    batch = engine.generate([chat("r2", IMAGE, **kw), chat("r3", text="other", **{**kw, "seed": 7})])
    assert batch[0].token_ids == alone.token_ids
    [other_seed] = engine.generate([chat("r4", IMAGE, **{**kw, "seed": 99})])
    assert other_seed.token_ids != alone.token_ids


def test_an_image_one_pixel_off_or_another_salt_shares_no_block_past_the_template(engine):
    base = make_image(320, 240, seed=31)
    off = np.asarray(base).copy()
    off[10, 10, 0] ^= 1  # one pixel, one bit
    first = chat("px1", data_url(base), text="What is this?")
    engine.generate([first])
    pre = engine.preprocess(first)
    template = pre.features[0].placeholder.offset  # tokens before the image
    bs = engine.config.decoder.block_size
    [b] = engine.generate([chat("px2", data_url(Image.fromarray(off)), text="What is this?")])
    assert b.num_cached_tokens <= template // bs * bs  # nothing of the image or after it
    [c] = engine.generate([chat("px3", data_url(base), text="What is this?")])
    assert c.num_cached_tokens > template  # the same image does hit
    salted = ChatRequest("px4", first.messages, first.sampling, cache_salt="tenant-b")
    [d] = engine.generate([salted])
    assert d.num_cached_tokens == 0  # another salt: not even the template's first block


def test_a_salt_keeps_a_text_only_prompt_out_of_every_other_tenants_blocks(engine):
    """No image carries the salt here: the decoder's block hashes alone must keep two tenants' equal text apart."""
    text = "A shared system prompt that many tenants send word for word, long enough for several blocks. " * 3

    def salted(rid: str, salt: str | None) -> ChatRequest:
        request = chat(rid, text=text)
        return ChatRequest(rid, request.messages, request.sampling, cache_salt=salt)

    [a] = engine.generate([salted("ts1", "tenant-a")])
    assert len(engine.preprocess(salted("ts0", "tenant-a")).prompt_token_ids) > 3 * engine.config.decoder.block_size
    [b] = engine.generate([salted("ts2", "tenant-b")])
    [unsalted] = engine.generate([salted("ts3", None)])
    [again] = engine.generate([salted("ts4", "tenant-a")])
    assert a.num_cached_tokens == b.num_cached_tokens == unsalted.num_cached_tokens == 0
    assert again.num_cached_tokens >= 3 * engine.config.decoder.block_size  # the same tenant does hit


def test_embeddings_skipped_for_a_prefix_the_cache_then_lost_are_fetched(engine):
    """The prefix looked cached when the request came (so its image was not encoded), but by admission the
    blocks are gone: the step asks for the embeddings, the service fetches them, the answer is unchanged."""
    image = data_url(make_image(400, 300, seed=41))
    [expected] = engine.generate([chat("late-ref", image)])
    kv, cache = engine.decoder.scheduler.kv, engine.decoder.scheduler.kv.cache
    assert cache is not None
    engine.decoder.pool.free(cache.allocate(kv.num_free))  # every free entry evicted meanwhile
    assert not cache.entries
    claimed = engine.decoder.prefix_hit_tokens
    engine.decoder.prefix_hit_tokens = lambda hashes, n: n  # "all cached"
    try:
        before = engine.stats()
        [late] = engine.generate([chat("late", image)])
    finally:
        engine.decoder.prefix_hit_tokens = claimed
    assert late.token_ids == expected.token_ids and late.num_cached_tokens == 0
    after = engine.stats()
    # asked once, late, by the step; answered by the decoder's own cache (the first request left them there)
    kept, before_kept = after.decoder.embedding_cache, before.decoder.embedding_cache
    assert kept is not None and before_kept is not None
    assert (kept.queries, kept.hits) == (before_kept.queries + 1, before_kept.hits + 1)
    assert after.encoder.queries == before.encoder.queries


async def collect(eng: Engine, request: ChatRequest) -> list[Any]:
    return [o async for o in eng.stream(request)]


def test_a_request_that_breaks_the_decoder_step_fails_alone_and_the_rest_match_alone(engine):
    # NOTE: long enough that "bad" joins their steps however fast the step thread runs; asserted below
    long = 160
    [ref_one] = engine.generate([chat("d1", IMAGE, text="Tell me", max_tokens=long, ignore_eos=True)])
    [ref_two] = engine.generate([chat("d2", text="Tell me about d2", max_tokens=long, ignore_eos=True)])
    runner = engine.decoder.runner
    execute = runner.execute
    steps_with_bad: list[set[str]] = []

    def poisoned(scheduled):  # any step holding "bad" fails, as a token id past the vocabulary would
        ids = {seq.request_id for seq, _ in scheduled}
        if "bad" in ids:
            steps_with_bad.append(ids)
            raise IndexError("index out of range in self")
        return execute(scheduled)

    async def rest(stream, first):
        return [first, *[o async for o in stream]]

    async def run():
        streams = [engine.stream(chat("d1x", IMAGE, text="Tell me", max_tokens=long, ignore_eos=True)),
                   engine.stream(chat("d2x", text="Tell me about d2", max_tokens=long, ignore_eos=True))]
        firsts = [await s.__anext__() for s in streams]  # both running: "bad" joins their decode batch
        bad = collect(engine, chat("bad", text="Tell me about bad", max_tokens=12))
        return await asyncio.gather(rest(streams[0], firsts[0]), bad, rest(streams[1], firsts[1]),
                                    return_exceptions=True)

    runner.execute = poisoned
    try:
        one, bad, two = asyncio.run(run())
    finally:
        runner.execute = execute
    assert isinstance(bad, IndexError), bad
    assert any({"d1x", "d2x"} <= ids for ids in steps_with_bad), steps_with_bad  # it failed inside their batch
    for outs, ref in ((one, ref_one), (two, ref_two)):
        assert not isinstance(outs, BaseException), outs
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids  # greedy: as when served alone
    stats = engine.decoder.stats()
    assert stats.running == 0 and stats.free_blocks == stats.total_blocks and "bad" not in engine.decoder.request_ids()


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_an_accelerator_fault_in_a_step_names_the_steps_requests_and_is_not_run_again_item_by_item(
        tiny_ckpt_224, where, monkeypatch):
    """A CUDA fault is sticky (every later call fails too): re-running the batch item by item would only fail
    each request as if it were its own fault, and the replica would go on failing every request. It is raised
    as a DeviceFault of the step's requests, wherever it surfaces (on a GPU, at the wait for the sampled tokens,
    not in the forward that queued the kernel); the step loop then ends (tests/unit/runtime)."""
    decoder = StageFactory(EngineConfig(model=str(tiny_ckpt_224))).decoder().decoder
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for rid in ("a", "b"):
        decoder.add(DecodeRequest(rid, list(range(2, 12)), [], [], greedy))
    calls: list[int] = []

    def fault(*args):
        calls.append(len(args[0]) if where == "forward" else 1)
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(decoder.runner if where == "forward" else decoder.sampler,
                        "execute" if where == "forward" else "sample", fault)
    with pytest.raises(DeviceFault) as raised:
        decoder.step()
    assert calls == ([2] if where == "forward" else [1])  # the batch's forward (or draw) only
    assert raised.value.request_ids == ["a", "b"] and isinstance(raised.value.__cause__, torch.AcceleratorError)


def test_a_device_fault_crosses_ray_as_itself() -> None:
    fault = DeviceFault(torch.AcceleratorError("CUDA error: an illegal memory access"), ["a", "b"])
    again = pickle.loads(pickle.dumps(fault))
    assert isinstance(again, DeviceFault) and again.request_ids == ["a", "b"] and str(again) == str(fault)


def test_the_image_token_is_never_sampled_and_a_sampled_one_would_not_break_the_step(engine):
    [ref] = engine.generate([chat("i1", IMAGE, text="Describe", max_tokens=10)])
    image_token = engine.spec.image_token_id
    runner, decoder = engine.decoder.runner, engine.decoder
    execute, sampler = runner.execute, decoder.sampler

    def favour_image_token(scheduled):  # the model's favourite is the image token at every step
        result = execute(scheduled)
        return type(result)(result.seqs, result.logits.index_add(  # out of place: inference tensors
            1, torch.tensor([image_token]), torch.full((len(result.seqs), 1), 1e4)))

    runner.execute = favour_image_token
    try:
        [suppressed] = engine.generate([chat("i2", IMAGE, text="Describe", max_tokens=10)])
        decoder.sampler = Sampler()  # no suppression: the image token is sampled and fed back
        [fed_back] = engine.generate([chat("i3", IMAGE, text="Describe", max_tokens=10)])
    finally:
        runner.execute, decoder.sampler = execute, sampler
    assert suppressed.token_ids == ref.token_ids  # the runner-up is each step's own argmax
    assert fed_back.token_ids == [image_token] * 10  # it runs: positions come from the placeholders
    [after] = engine.generate([chat("i4", IMAGE, text="Describe", max_tokens=10)])
    assert after.token_ids == ref.token_ids


def test_once_encoded_no_pixels_are_held_for_the_rest_of_the_generation(engine):
    def inspect() -> tuple[list, int]:
        [seq] = [s for s in engine.decoder.scheduler.running if s.request_id == "px"]
        live = engine.decoder_service._live["px"]
        return [f.data for f in seq.features] + [f.data for f in live.pre.features], len(seq.features)

    async def run():
        stream = engine.stream(chat("px", IMAGE, WIDE, text="Compare", max_tokens=64))
        first = await stream.__anext__()  # prefilled: both images were encoded
        # NOTE: read in the step thread between two steps, while the sequence still runs: the step thread
        # does not wait for this consumer, and a short generation could be over before it looks
        held, n_features = await engine.decoder_service.loop.call(inspect)
        rest = [o async for o in stream]
        return first, held, n_features, rest

    first, held, n_features, rest = asyncio.run(run())
    assert n_features == 2 and held == [None] * 4
    assert [first, *rest][-1].finished


def test_a_late_fetch_for_a_request_whose_loop_has_closed_fails_nothing_in_the_step(engine):
    """The step thread asks for embeddings of a request whose consumer's loop has closed (an Engine user's
    asyncio.run ended): that request is ending; the step, and so its batch mates, must not fail with it."""
    from mmserve.decoder.service import _Live

    closed = asyncio.new_event_loop()
    closed.close()
    pre = engine.preprocess(chat("gone", IMAGE))
    service = engine.decoder_service
    service._live["gone"] = _Live(pre, None, closed, asyncio.Lock())
    aborted: list[str] = []
    abort, service.decoder.abort = service.decoder.abort, aborted.append
    try:
        service._on_missing("gone", [0])  # raised RuntimeError('Event loop is closed') into the step
        asyncio.run(service.loop.call(lambda: None))  # the actions queued before this one have run
        assert aborted == ["gone"] and "gone" not in service._live  # nothing else would end it: its consumer is gone
        service._live["gone"] = _Live(pre, None, closed, asyncio.Lock())  # its own ending ran first: a new "gone"
        service.loop.submit("gone", lambda: service._end_abandoned(_Live(pre, None, closed, asyncio.Lock())))
        asyncio.run(service.loop.call(lambda: None))
        assert aborted == ["gone"]  # the abandoned one's late end does not abort the new request of that id
    finally:
        service.decoder.abort = abort
        service._live.pop("gone", None)


def test_a_request_the_decoder_fails_to_take_leaves_nothing_that_fails_later_steps(engine, monkeypatch):
    """Decoder.add failing after the scheduler took the sequence (its generator, from a seed torch refuses) left
    the sequence there without its state: every later step raised, every request on that decoder failed."""
    from mmserve.decoder import decoder as decoder_module
    from mmserve.messages import DecodeRequest

    def refused(seed: int | None) -> None:
        raise ValueError(f"seed {seed} refused")

    monkeypatch.setattr(decoder_module, "make_generator", refused)
    orphan = DecodeRequest("orphan", list(range(2, 20)), [], [], SamplingParams(max_tokens=2, seed=7))
    with pytest.raises(ValueError, match="refused"):
        asyncio.run(engine.decoder_service.loop.call(lambda: engine.decoder.add(orphan)))
    monkeypatch.undo()
    [after] = engine.generate([chat("after-orphan", text="Say something", max_tokens=4)])
    assert len(after.token_ids) == 4
    with pytest.raises(InvalidSamplingError, match="seed"):  # and such a seed is refused before the decoder
        SamplingParams(seed=2**64).validate()


def test_penalties_and_biases_change_what_is_generated(engine):
    [plain] = engine.generate([chat("p0", text="Say something", max_tokens=8)])
    favourite = plain.token_ids[0]
    [biased] = engine.generate([chat("p1", text="Say something", max_tokens=8, logit_bias=((favourite, 10.0),))])
    assert biased.token_ids == [favourite] * 8  # +10 wins every step (the tiny model's logits are close)
    [fresh] = engine.generate([chat("p2", text="Say something", max_tokens=8, logit_bias=((favourite, 10.0),),
                                    presence_penalty=2.0, frequency_penalty=2.0)])
    # once out it pays 2 + 2 per occurrence: by its fourth the bias is spent
    assert fresh.token_ids[0] == favourite and fresh.token_ids.count(favourite) < 8
    [held] = engine.generate([chat("p3", text="Say something", max_tokens=8, stop_token_ids=(favourite,),
                                   min_tokens=3)])
    assert len(held.token_ids) >= 3 and favourite not in held.token_ids[:2]  # no stop before 3 tokens
    tok = engine.preprocessor.tokenizer
    # a token of the greedy answer that is a word of its own: spelled again, it is that one token
    j = next(j for j, t in enumerate(plain.token_ids) if tok(tok.decode([t]).lstrip(), add_special_tokens=False)
             ["input_ids"] == [t] and t not in plain.token_ids[:j])
    [banned] = engine.generate([chat("p5", text="Say something", max_tokens=8,
                                     bad_words=(tok.decode([plain.token_ids[j]]),))])
    assert banned.token_ids[:j] == plain.token_ids[:j] and plain.token_ids[j] not in banned.token_ids
    never = engine.decoder.spec.never_sampled
    with pytest.raises(InvalidSamplingError, match="allowed_token_ids"):  # nothing it may sample: refused
        engine.generate([chat("p6", max_tokens=4, allowed_token_ids=never)])
    allowed = {t for t in range(40, 60) if t not in plain.token_ids}
    [only] = engine.generate([chat("p4", text="Say something", max_tokens=8, allowed_token_ids=tuple(allowed))])
    assert len(only.token_ids) == 8 and set(only.token_ids) <= allowed  # none of them the model's end either


def test_the_decoders_steps_see_its_encode_on_this_hosts_cpu_only_while_it_runs(engine, monkeypatch):
    threads, original = engine.decoder.runner.threads, engine.encoder_service.encode
    seen: list[bool] = []

    async def watched(request_id: str, features: list[Any], early: bool = False) -> Any:
        seen.append(threads.beside())
        out = await original(request_id, features, early)
        seen.append(threads.beside())
        return out

    monkeypatch.setattr(engine.encoder_service, "encode", watched)
    engine.generate([chat("beside-1", data_url(make_image(320, 200, seed=31)))])
    assert seen == [True, True] and not threads.beside()  # after the call, before the decoder's own steps
    cores = engine.decoder_service.shared_cores
    cores.answered("")  # as if the encoder had moved to an accelerator
    try:
        engine.generate([chat("beside-2", data_url(make_image(320, 200, seed=32)))])
    finally:
        cores.answered(HOST)  # NOTE: the engine is the module's: leave it as it was
    assert seen[2:] == [False, False]


def test_preemptions_are_counted_and_change_no_greedy_text(tiny_ckpt_224):
    """A pool too small for three growing sequences sends some back to the queue (their work redone): counted
    for the operator (mmserve_decoder_preemptions_total), and the texts are those of a roomy pool."""
    requests = [ChatRequest(f"r{i}", [{"role": "user", "content": f"Tell me story {i}."}],
                            SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)) for i in range(3)]
    texts, preempted = [], []
    for num_blocks in (12, 2048):
        config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048, decoder=DecoderConfig(
            num_blocks=num_blocks, enable_prefix_caching=False, measure_matmul_forms=False))
        with Engine(config) as engine:
            texts.append([out.text for out in engine.generate(requests)])
            preempted.append(engine.stats().decoder.preemptions)
    assert preempted[0] > 0 and preempted[1] == 0 and texts[0] == texts[1]


def test_the_decoder_counts_computed_and_sampled_tokens_each_step(engine):
    """What `mmserve_decoder_computed_tokens_total` and `_sampled_tokens_total` report: a fresh prompt's
    positions once, then one per decode (the last token sampled is never fed back)."""
    request = chat("count-tokens", text="Count these tokens, please, carefully.", max_tokens=5, ignore_eos=True)
    prompt = len(engine.preprocess(request).prompt_token_ids)
    before = engine.decoder.stats()
    [out] = engine.generate([request])
    after = engine.decoder.stats()
    assert out.num_cached_tokens == 0 and len(out.token_ids) == 5
    assert after.sampled_tokens - before.sampled_tokens == 5
    assert after.computed_tokens - before.computed_tokens == prompt + 4


def test_a_request_whose_images_pass_the_encoder_cache_together_is_encoded_in_calls_that_fit(engine, tiny_ckpt_224):
    """The encoder cache holds a call's items together until it hands them back: two images of one request in a
    cache that fits one at a time go in two calls (once refused as a CapacityError), with the same text."""
    request = replace(chat("two", IMAGE, WIDE, max_tokens=12), cache_salt="fit")
    [whole] = engine.generate([request])
    rows = engine.spec.mm_tokens_per_image
    config = EngineConfig(model=str(tiny_ckpt_224), max_model_len=2048, media=MediaConfig(max_images_per_prompt=2),
                          encoder=EncoderConfig(cache_capacity_tokens=rows),
                          decoder=DecoderConfig(embedding_cache_bytes=0, measure_matmul_forms=False))
    with Engine(config) as small:
        [split] = small.generate([request])
        stats = small.stats().encoder
    assert split.token_ids == whole.token_ids
    assert stats.queries == 2 and stats.forward_passes == 2  # one image per call


def test_a_late_fetch_failing_after_its_request_ended_leaves_the_id_alone(engine, monkeypatch):
    """Its id may already be another request's: the failure must not reach the decoder under it."""
    from mmserve.decoder.service import _Live

    service = engine.decoder_service
    submitted: list[str | None] = []
    monkeypatch.setattr(service.loop, "submit", lambda request_id, action: submitted.append(request_id))
    pre = engine.preprocess(chat("late-gone", data_url(make_image(320, 240, seed=99))))

    async def fetch() -> None:
        async def encode(_: Any) -> Any:
            live.ended = True  # the consumer left while the encoder worked
            raise RuntimeError("encoder lost")

        live = _Live(pre, encode, asyncio.get_running_loop(), asyncio.Lock())
        await service._fetch(live, [0])

    asyncio.run(fetch())
    assert submitted == []


def test_the_text_is_the_tokenizers_own_decode_of_the_output_ids(engine):
    """Streamed piece by piece (the incremental detokenizer), the whole text equals one decode of every output id,
    the model's end left out, as vLLM's text is."""
    tokenizer = engine.decoder.tokenizer
    asks: list[dict[str, Any]] = [{"max_tokens": 24, "ignore_eos": True}, {"max_tokens": 24},
                                  {"max_tokens": 24, "ignore_eos": True, "temperature": 1.0, "seed": 3}]
    for i, kw in enumerate(asks):
        [out] = engine.generate([chat(f"dec{i}", IMAGE, **kw)])
        ids = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
        assert out.text == tokenizer.decode(ids, skip_special_tokens=True), (kw, out.token_ids)
