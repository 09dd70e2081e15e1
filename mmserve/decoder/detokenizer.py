"""Incremental detokenization of one sequence, with stop strings.

Owns: turning sampled token ids, one at a time, into text deltas that never end inside a UTF-8
character (byte-fallback tokens are held until their character completes), skipping special tokens,
and cutting the text right before the first stop string (or right after it, when asked) without ever
emitting any part of it first.
Also: one token's own text and bytes (`token_piece`, for log-probabilities).
Does not own: finishing the request (the caller sees `stop_string` and tells the scheduler) nor the
tokenizer itself (any Hugging Face tokenizer backed by the `tokenizers` library, or a raw one).

Decoding keeps prefix/read offsets (as vLLM does): the text of the new tokens is the decode of
`ids[prefix:]` minus that of `ids[prefix:read]`, emitted only once it no longer ends in U+FFFD.
NOTE: `tokenizers.decoders.DecodeStream` does the same but raises ("Invalid prefix encountered")
when byte-fallback tokens regroup across the offsets, which random or odd outputs do; a server
must never fail a request on its own output.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer

from mmserve.messages import SamplingParams

PROMPT_CONTEXT_TOKENS = 6  # prompt tokens the stream starts from, so that a first word keeps its space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token's spelling (SentencePiece's)


def token_piece(tokenizer: Any, token_id: int) -> tuple[str, bytes]:
    """A token decoded alone, and its own bytes: a byte-fallback token's one byte (its text alone is U+FFFD:
    OpenAI's `bytes` exist so that a client joins them into the character), else its text as UTF-8."""
    text = str(tokenizer.decode([token_id]))
    if "\ufffd" in text:
        byte = _BYTE_PIECE.fullmatch(backend_tokenizer(tokenizer).id_to_token(token_id) or "")
        if byte is not None:
            return text, bytes([int(byte.group(1), 16)])
    return text, text.encode()


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` inside a transformers tokenizer (or the argument itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"{type(tokenizer).__name__} is not backed by the `tokenizers` library")
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Iterable[int] = (),
                 stop: tuple[str, ...] = (), skip_special_tokens: bool = True, include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        self._tokenizer = backend_tokenizer(tokenizer)
        context = list(prompt_token_ids)[-PROMPT_CONTEXT_TOKENS:]
        # NOTE: seeding the stream with the prompt's tail makes a decoder that strips a leading space
        # (Metaspace) treat the first output token as mid-text, as a full decode of prompt+output does.
        self._ids = context  # token ids decoded so far, starting with the prompt's tail
        self._prefix_offset = 0  # start of the decode window (tokens)
        self._read_offset = len(context)  # tokens before this are already emitted as text
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop  # the text ends after the stop string found, not before it
        # NOTE: as vLLM, a stop string ends the text only once it ends in an output past `min_tokens` tokens
        self._min_tokens = min_tokens
        self._tokens = 0  # output tokens added (tokens)
        self._pending = ""  # decoded text not yet emitted: a possible start of a stop string
        self._emitted: list[str] = []  # everything emitted so far, in pieces (NOTE: a str += copied it all per token)
        self.stop_string: str | None = None  # the stop string found; no more text after it

    @classmethod
    def for_request(cls, tokenizer: Any, sampling: SamplingParams) -> IncrementalDetokenizer:
        """One with a request's stop strings and text options (no prompt context)."""
        return cls(tokenizer, stop=sampling.stop, skip_special_tokens=sampling.skip_special_tokens,
                   include_stop=sampling.include_stop_str_in_output, min_tokens=sampling.min_tokens)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add(self, token_id: int) -> str:
        """Feed one sampled token; return the newly completed text (may be empty)."""
        if self.stopped:
            return ""
        chunk, fresh = self._decode_step(token_id), len(self._pending)
        self._pending += chunk
        self._tokens += 1
        return self._emit(self._check_stop(fresh if self._tokens > self._min_tokens else None))

    def _decode_step(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end of generation: release text held back as a possible stop-string start.

        NOTE: bytes of a character that never completed are dropped, not sent as U+FFFD.
        """
        if self.stopped:
            return ""
        return self._emit(len(self._pending))

    def _check_stop(self, fresh: int | None) -> int:
        """How much of `_pending` may be emitted; sets `stop_string` and cuts when one is found that ends in the
        text from `fresh` on (None: no stop string may end the text yet, `min_tokens`)."""
        if not self._stop:
            return len(self._pending)
        hits = [] if fresh is None else [(i, k, s) for k, s in enumerate(self._stop)
                                         if (i := self._pending.find(s, max(0, fresh - len(s) + 1))) >= 0]
        if hits:  # NOTE: the earliest; of those at one place, the first in the request's list (vLLM's order)
            cut, _, self.stop_string = min(hits)
            cut += len(self.stop_string) if self._include_stop else 0
            self._pending = self._pending[:cut]
            return cut
        return len(self._pending) - _held_back(self._pending, self._stop)

    def _emit(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        if out:
            self._emitted.append(out)
        return out


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string.

    NOTE: holding back only that (not a fixed max-stop-length tail) keeps streaming latency minimal;
    any stop string completed later must start inside it, so none is ever partly emitted.
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
