"""IncrementalDetokenizer: whole characters only, special tokens skipped, stop strings cut exactly."""

from __future__ import annotations

import random
from typing import Any

import pytest

from mmserve.decoder.detokenizer import IncrementalDetokenizer, token_piece

TEXT = "héllo ✓ 日本"
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")


def local_tokenizer() -> Any:
    """A small Gemma-style byte-fallback BPE: é, ✓, 日, 本 are not in it and fall back to bytes."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    pieces = [*"abcdefghijklmnopqrstuvwxyz▁.,!?", "he", "ll", "llo", "▁w", "▁wo", "or", "ld"]
    merges = [("h", "e"), ("l", "l"), ("ll", "o"), ("▁", "w"), ("▁w", "o"), ("o", "r"), ("l", "d")]
    vocab: dict[str, int] = {}
    for token in (*SPECIALS, *[f"<0x{b:02X}>" for b in range(256)], *pieces):
        vocab.setdefault(token, len(vocab))
    # NOTE: merges as pairs, as the tokenizers library takes them (transformers' annotation says list[str])
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False)  # type: ignore[arg-type]
    tok.add_special_tokens({"extra_special_tokens": list(SPECIALS[5:])})
    return tok


@pytest.fixture(scope="module", params=["local", "checkpoint"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    if request.param == "local":
        return local_tokenizer()
    try:
        ckpt = request.getfixturevalue("tiny_ckpt")
    except pytest.FixtureLookupError:
        pytest.skip("the tiny_ckpt fixture is not available")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


def encode(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def stream(tok: Any, ids: list[int], **kwargs: Any) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, detok


def test_streaming_yields_whole_characters_only(tokenizer: Any) -> None:
    ids = encode(tokenizer, TEXT)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert any(t.startswith("<0x") for t in tokens), "the test needs byte-fallback tokens"
    pieces, detok = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT == detok.text
    assert not any("\ufffd" in p for p in pieces)
    for token, piece in zip(tokens, pieces, strict=False):  # a lead byte alone yields nothing
        if token in ("<0xE2>", "<0xE6>"):
            assert piece == ""


def test_check_mark_bytes_arrive_one_per_step() -> None:
    tok = local_tokenizer()
    ids = tok.convert_tokens_to_ids(["▁", "<0xE2>", "<0x9C>", "<0x93>", "o"])
    pieces, _ = stream(tok, ids)
    assert pieces == [" ", "", "", "✓", "o", ""]


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    special = tokenizer.convert_tokens_to_ids(["<bos>", "<end_of_turn>", "<eos>"])
    body = encode(tokenizer, TEXT)
    ids = [special[0], *body[:3], special[1], *body[3:], special[2]]
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == TEXT
    assert pieces[0] == pieces[4] == pieces[-2] == ""


def test_special_tokens_kept_when_asked(tokenizer: Any) -> None:
    turn_end = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    body = encode(tokenizer, TEXT)
    pieces, _ = stream(tokenizer, [*body[:3], turn_end, *body[3:]], skip_special_tokens=False)
    assert "".join(pieces) == tokenizer.decode(body[:3]) + "<end_of_turn>" + tokenizer.decode(body[3:])


def test_prompt_context_matches_a_full_decode(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "hello")
    out = encode(tokenizer, " world ✓")
    pieces, _ = stream(tokenizer, out, prompt_token_ids=prompt)
    full = tokenizer.decode(prompt + out, skip_special_tokens=True)
    assert "".join(pieces) == full[len(tokenizer.decode(prompt, skip_special_tokens=True)):]


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (("llo ✓",), "hé"),  # spans several tokens, byte tokens included
        (("✓",), "héllo "),  # made of byte tokens only
        (("l",), "hé"),  # inside one token: cut mid-token
        (("本", "é"), "h"),  # the earliest match wins, whatever the order given
        (("xyz",), TEXT),  # never matched: all text, none lost
        (("日本!",), TEXT),  # a held-back prefix is released by flush at the end
    ],
)
def test_stop_strings_cut_before_the_first_match(tokenizer: Any, stop: tuple[str, ...],
                                                 expected: str) -> None:
    ids = encode(tokenizer, TEXT)
    pieces, detok = stream(tokenizer, ids, stop=stop)
    assert "".join(pieces) == expected == detok.text
    matched = [s for s in stop if s in TEXT]
    assert detok.stopped == bool(matched)
    if matched:
        assert detok.stop_string == min(matched, key=TEXT.index)
        assert detok.add(ids[0]) == "" and detok.flush() == ""


@pytest.mark.parametrize(("stop", "expected"), [(("llo ✓",), "héllo ✓"), (("l",), "hél"), (("本", "é"), "hé")])
def test_stop_strings_kept_in_the_text_when_asked(tokenizer: Any, stop: tuple[str, ...], expected: str) -> None:
    pieces, detok = stream(tokenizer, encode(tokenizer, TEXT), stop=stop, include_stop=True)
    assert "".join(pieces) == expected == detok.text and detok.stopped


def test_partial_stop_string_is_held_then_released() -> None:
    tok = local_tokenizer()
    detok = IncrementalDetokenizer(tok, stop=("hello!",))
    emitted = [detok.add(i) for i in encode(tok, "ab hello")]
    assert "".join(emitted) == "ab "  # "hello" could still become "hello!"
    assert detok.add(encode(tok, "?")[0]) == "hello?"


def test_random_streams_match_a_full_decode_cut_at_the_stop(tokenizer: Any) -> None:
    rng = random.Random(0)
    alphabet = [*"abcdehlo ", "é", "✓", "日", "本", " ✓", "llo"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(2)})
        ids = encode(tokenizer, text)
        full = tokenizer.decode(ids)
        assert full == text
        cut = min((full.index(s) for s in stops if s in full), default=len(full))
        pieces, _ = stream(tokenizer, ids, stop=stops)
        assert "".join(pieces) == full[:cut], (text, stops)
        assert not any("\ufffd" in p for p in pieces)


def test_with_min_tokens_a_stop_string_cuts_only_where_it_ends_in_a_later_token(tokenizer: Any) -> None:
    """vLLM's rule: stop strings are looked for once more than `min_tokens` tokens are out, and then only those
    that end in the text the latest token completed."""
    rng = random.Random(1)
    alphabet = [*"abcdehlo ", "é", "✓", "日", " ✓", "llo"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(2)})
        ids = encode(tokenizer, text)
        min_tokens = rng.randint(0, len(ids) + 1)
        pieces, _ = stream(tokenizer, ids, stop=stops, min_tokens=min_tokens)
        assert "".join(pieces) == cut_past(tokenizer, ids, stops, min_tokens), (text, stops, min_tokens)


def cut_past(tok: Any, ids: list[int], stops: tuple[str, ...], min_tokens: int) -> str:
    """The whole text cut before the first stop string that the k-th token completes, for k > min_tokens."""
    full, done = tok.decode(ids), 0  # done: characters complete before the token at hand
    for k in range(1, len(ids) + 1):
        now = len(tok.decode(ids[:k]).rstrip("\ufffd"))
        if k > min_tokens:
            hits = [i for s in stops if 0 <= (i := full.find(s, max(0, done - len(s) + 1))) <= now - len(s)]
            if hits:
                return full[: min(hits)]
        done = max(done, now)
    return full


def test_accepts_a_raw_tokenizers_tokenizer() -> None:
    tok = local_tokenizer()
    pieces, _ = stream(tok.backend_tokenizer, encode(tok, TEXT))
    assert "".join(pieces) == TEXT
    with pytest.raises(TypeError):
        IncrementalDetokenizer(object())


def test_a_tokens_own_bytes_join_into_the_text_where_its_decoded_text_cannot(tokenizer: Any) -> None:
    """OpenAI's logprob `bytes`: a byte token alone decodes to U+FFFD; its own byte is what a client joins."""
    ids = encode(tokenizer, TEXT)
    pieces = [token_piece(tokenizer, i) for i in ids]
    assert any(text == "\ufffd" for text, _ in pieces), "the text has characters that fall back to bytes"
    assert b"".join(raw for _, raw in pieces).decode() == tokenizer.decode(ids) == TEXT
    whole = encode(tokenizer, "hello")
    assert [token_piece(tokenizer, i) for i in whole] == [(t, t.encode()) for t in
                                                          (tokenizer.decode([i]) for i in whole)]



def test_the_text_so_far_is_every_piece_emitted(tokenizer: Any) -> None:
    """Kept in pieces (a `str +=` per token copied the whole text each time)."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(i) for i in encode(tokenizer, TEXT)]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces) == TEXT and len(detok._emitted) > 1
