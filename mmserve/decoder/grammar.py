"""Structured output: the grammar a request's output must match, enforced token by token with llguidance.

Owns: the model's vocabulary as llguidance sees it (built once, on the first request that asks), one
matcher per request, the batch's allowed-token bitmask and its application to logits. Does not own: the
constraint's grammar and the edge's check that it compiles (constraint.py), when a row is masked (the
decoder's step) nor sampling (sampler.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict

import llguidance
import llguidance.hf
import numpy as np
import torch

from mmserve.decoder.big_stack import on_big_stack
from mmserve.decoder.constraint import NAMES, InvalidGrammarError, compiling, contained, digest, grammar_of
from mmserve.decoder.sampler import RowMasks
from mmserve.errors import InvalidRequestError
from mmserve.messages import StructuredOutput

log = logging.getLogger(__name__)

PARALLEL_ROWS = 32  # constrained rows in a step from which their masks are computed on llguidance's pool


class GrammarViolationError(RuntimeError):
    """A sampled token that the request's grammar did not allow (a bug: its mask forbade it)."""


class NoTokenAllowedError(InvalidRequestError):
    """A constrained request whose masks together leave no token (the grammar with min_tokens or with the
    model's never-sampled tokens), or whose matcher failed."""


class Grammars:
    """The model's vocabulary for llguidance and fresh matchers for requests, thread-safe.

    `vocab_size` is the logits' width (it may exceed the tokenizer's); `eos_token_ids` are what a finished
    grammar allows, so a constrained output ends with the model's own end of turn; `never` are the tokens
    the model may never sample, forbidden in every mask (`sampler.RowMasks`). The vocabulary is built
    on the first request that asks (NOTE: not at start-up: it is slow on a large vocabulary, and many
    deployments never ask). The last `cached` constraints are kept compiled: production traffic sends the
    same extraction schema again and again, and copying a compiled matcher costs next to nothing against
    compiling it (docs/benchmarks.md).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cached: int = 64,
                 never: tuple[int, ...] = ()) -> None:
        self._hf, self._vocab, self._eos = hf_tokenizer, vocab_size, list(eos_token_ids)
        # (words,) int32 with the never-sampled tokens' bits clear; None: no such token
        self._keep = _without_bits(never, vocab_size) if never else None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._background: llguidance.LLExecutor | None = None  # one worker, for masks made off the step thread
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # by digest: pristine, LRU
        self._cached, self._lock = cached, threading.Lock()
        self.words = (vocab_size + 31) // 32  # int32 words per row of a bitmask

    def matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one request; raises InvalidGrammarError if the constraint does not compile."""
        key = digest(structured)
        with self._lock:
            pristine = self._compiled.get(key)
            if pristine is not None:
                self._compiled.move_to_end(key)
                return pristine.deep_copy()
            tokenizer = self._vocabulary()
        with compiling(structured):  # NOTE: outside the lock: compiling is slow; on a deep stack (big_stack.py)
            pristine = on_big_stack(lambda: llguidance.LLMatcher(tokenizer, grammar_of(structured)))
        if pristine.is_error():
            raise InvalidGrammarError(f"invalid {NAMES[structured.kind]}: {pristine.get_error()}")
        with self._lock:
            self._compiled[key] = pristine
            while len(self._compiled) > self._cached:
                self._compiled.popitem(last=False)
        return pristine.deep_copy()

    def bitmask(self, matchers: list[llguidance.LLMatcher], *, background: bool = False) -> torch.Tensor:
        """(g, words) int32 allowed-token bits of each matcher's next token.

        NOTE: computed on the calling thread below PARALLEL_ROWS rows (as vLLM does): llguidance's thread
        pool spins for work after each call, and on a CPU host those spinning threads take the cores
        from the forward's own threads; a large batch of constrained rows is worth the pool.
        `background` (a caller off the step thread): below PARALLEL_ROWS on a pool of one worker, which
        unlike a matcher's own call lets go of the GIL, so the step thread's Python goes on meanwhile; its
        one spinning thread is the price, paid while the forward's threads are idle or near their end.
        """
        mask = torch.empty((len(matchers), self.words), dtype=torch.int32)
        row_bytes, base = self.words * 4, mask.data_ptr()  # NOTE: rows by address: a view per row is a torch call
        if background or len(matchers) >= PARALLEL_ROWS:
            executor = self._pool(one_worker=len(matchers) < PARALLEL_ROWS)
            try:
                executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], base, row_bytes,
                                                 len(matchers))
            except BaseException as exc:
                if not contained(exc):
                    raise
                log.warning("structured output: masks of %d rows failed together (%r); one by one", len(matchers), exc)
            else:
                return self._without_errors(matchers, mask)
        for i, matcher in enumerate(matchers):
            try:
                matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
            except BaseException as exc:
                if not contained(exc):
                    raise
                log.warning("structured output: a mask failed (%r); its row allows nothing", exc)
                mask[i] = 0
        return self._without_errors(matchers, mask)

    @staticmethod
    def _without_errors(matchers: list[llguidance.LLMatcher], mask: torch.Tensor) -> torch.Tensor:
        """NOTE: a matcher in an error state allows nothing: its request then fails, not its batch."""
        for i, matcher in enumerate(matchers):
            if matcher.is_error():
                mask[i] = 0
        return mask

    def _pool(self, one_worker: bool) -> llguidance.LLExecutor:
        """llguidance's pool of one worker, or of its default size; made on first use."""
        if one_worker:
            if self._background is None:
                self._background = llguidance.LLExecutor(num_threads=1)
            return self._background
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def forbidden(self, matchers: list[llguidance.LLMatcher | None], device: torch.device, *,
                  background: bool = False) -> RowMasks | None:
        """What each row's matcher forbids next, for the rows that have one (None: no row has)."""
        present = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not present:
            return None
        bitmask = self.bitmask([m for _, m in present], background=background)  # (g, words)
        if self._keep is not None:  # NOTE: the never-sampled cleared in the words, not in the (g, vocab) mask
            np.bitwise_and(bitmask.numpy(), self._keep, out=bitmask.numpy())
        return RowMasks(tuple(i for i, _ in present), forbidden(bitmask, self._vocab, device))  # (g, vocab) bool

    def _vocabulary(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            start = time.perf_counter()
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab, eos_token=self._eos)
            log.info("structured output: vocabulary of %d tokens built in %.2f s", self._vocab,
                     time.perf_counter() - start)
        return self._tokenizer


def _without_bits(tokens: tuple[int, ...], vocab: int) -> np.ndarray:
    """(words,) int32 mask words of a `vocab`-token vocabulary with every bit set but those of `tokens`."""
    if bad := [t for t in tokens if not 0 <= t < vocab]:
        raise ValueError(f"never-sampled token ids {bad} are outside the vocabulary of {vocab}")
    keep = np.full((vocab + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
    for token in tokens:
        keep[token >> 5] &= ~np.uint32(1 << (token & 31))
    return keep.view(np.int32)


def forbidden(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """(g, words) int32 allowed-token bits -> (g, vocab) bool on `device`, True where the token is forbidden.

    NOTE: unpacked with numpy on a CPU, in one pass: the words are inverted first (32x fewer), and numpy's
    0/1 bytes are its bools. Sent packed, 32x smaller, to any other device and unpacked there. Bit k of
    word w is token 32 w + k, so on a little-endian host the words' bytes unpack in token order.
    """
    if device.type == "cpu":
        banned = np.invert(bitmask.numpy()).view(np.uint8)  # (g, 4 words) bytes, bit set = forbidden
        return torch.from_numpy(np.unpackbits(banned, axis=1, count=vocab, bitorder="little").view(np.bool_))
    return _forbidden_on(device, bitmask, vocab)


def _forbidden_on(device: torch.device, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """`forbidden` unpacked by torch kernels on `device`."""
    bits = (bitmask.to(device, non_blocking=True)[:, :, None] >> _bits_on(device)) & 1  # (g, words, 32)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab] == 0


@functools.cache
def _bits_on(device: torch.device) -> torch.Tensor:
    """(32,) int32 0..31 on `device`: bit k of a mask word is token 32 * word + k. NOTE: made once per device;
    a copy per call would wait on the grammar thread for the forward queued on the device's stream."""
    return torch.arange(32, dtype=torch.int32, device=device)
