"""Structured output inside a decoder step: masks computed beside the forward, matchers advanced after sampling.

Owns: the grammar thread, starting the step's masks before the forward and collecting them for the rows the
forward returned, and feeding each matcher its sampled token. Does not own the matchers (one per request, in
the decoder's request state), compiling grammars or unpacking masks (grammar.py), nor sampling.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from mmserve.decoder.grammar import Grammars, GrammarViolationError

Pending = Future[tuple[list[str], torch.Tensor]]  # (request ids in plan order, their (n, vocab) bool mask)


class GrammarStep:
    def __init__(self, grammars: Grammars, device: torch.device) -> None:
        self.grammars, self.device = grammars, device
        self._thread: ThreadPoolExecutor | None = None  # started by the first constrained step

    def start(self, rows: list[tuple[str, llguidance.LLMatcher | None]]) -> Pending | None:
        """Start computing what the matchers of the step's sampling rows (request id, matcher or None) forbid.

        NOTE: on a worker thread, beside the forward (whose kernels release the GIL): on a GPU host the
        masks are ready when the logits are, and the step waits only for what is left. None (and no work)
        when no row has a grammar.
        """
        if all(m is None for _, m in rows):
            return None
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="mmserve-grammar")
        ids, matchers = [rid for rid, _ in rows], [m for _, m in rows]
        return self._thread.submit(lambda: (ids, self.grammars.forbidden(matchers, self.device)))

    @staticmethod
    def finish(pending: Pending | None, ids: list[str]) -> torch.Tensor | None:
        """(n, vocab) bool: what each row of the step's logits (request `ids`) may not sample; None if free."""
        if pending is None:
            return None
        planned, forbid = pending.result()
        if planned == ids:
            return forbid
        where = {rid: j for j, rid in enumerate(planned)}  # some failed in the forward: the others' rows
        return forbid[[where[rid] for rid in ids]]

    @staticmethod
    def advance(ids: list[str], tokens: list[int],
                matchers: list[llguidance.LLMatcher | None]) -> tuple[set[str], dict[str, Exception]]:
        """Feed each constrained row its sampled token -> (requests whose grammar allows nothing more, and
        those whose token it refused: a bug, as the mask forbade it)."""
        ended: set[str] = set()
        broken: dict[str, Exception] = {}
        for rid, token, matcher in zip(ids, tokens, matchers, strict=True):
            if matcher is None:
                continue
            if not matcher.consume_token(token):
                broken[rid] = GrammarViolationError(f"token {token} broke the grammar: {matcher.get_error()}")
            elif matcher.is_stopped():
                ended.add(rid)
        return ended, broken
