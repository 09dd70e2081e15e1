"""Structured output inside a decoder step: masks computed ahead, matchers advanced after sampling.

Owns: the grammar thread; where the forward leaves the host a core, the next step's masks, started on it as
soon as a step has advanced its matchers (so they are computed while the step thread's Python finishes that
step and prepares the next); starting the step's masks before the forward where none are ready (beside it,
on that thread, where a core is free; else on the step thread, before it); collecting them for the rows the
forward returned; and feeding each matcher its sampled token. Does not own the matchers (one per request,
in the decoder's request state), compiling grammars or unpacking masks (grammar.py), nor sampling.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from mmserve.decoder.grammar import Grammars, GrammarViolationError, NoTokenAllowedError, contained
from mmserve.decoder.sampler import RowMasks
from mmserve.runtime.host_copy import ints_to_device

log = logging.getLogger(__name__)

Masks = tuple[list[str], RowMasks | None]  # (request ids in plan order, what their grammars forbid)


class Made:
    """Masks made on the step thread: a finished future's reads, without the lock and condition that a
    `Future` makes (NOTE: after a forward each distinct call costs tens of µs of cold code, docs/benchmarks.md)."""

    def __init__(self, make: Callable[[], Masks]) -> None:
        self._masks: Masks | None = None
        self._error: Exception | None = None
        try:
            self._masks = make()
        except Exception as exc:  # NOTE: raised by finish(), as from the thread
            self._error = exc

    def done(self) -> bool:
        return True

    def exception(self) -> Exception | None:
        return self._error

    def result(self) -> Masks:
        if self._error is not None:
            raise self._error
        assert self._masks is not None
        return self._masks


Pending = Future[Masks] | Made


class GrammarStep:
    def __init__(self, grammars: Grammars, device: torch.device) -> None:
        self.grammars, self.device = grammars, device
        self._thread: ThreadPoolExecutor | None = None  # started by the first constrained step
        # masks started after the last step's advance: the matchers they read, by request id, and the work
        self._ahead: tuple[dict[str, llguidance.LLMatcher], Pending] | None = None
        self._spare_core = False  # whether the last step's forward left the host a core (`start`'s `beside`)

    def start(self, rows: list[tuple[str, llguidance.LLMatcher | None]], beside: bool) -> Pending | None:
        """Start computing what the matchers of the step's sampling rows (request id, matcher or None) forbid.

        NOTE: `beside` the forward, on a worker thread (the forward's kernels release the GIL), when the
        forward leaves the host a core (an accelerator's forward, or fewer torch threads than cores): the
        masks are ready when the logits are, and the step waits only for what is left. Otherwise here and
        now: a third thread on cores the forward's threads fill preempts one of them, and every parallel
        kernel then waits for it at its barrier (docs/benchmarks.md). None (and no work) when no row has a
        grammar. The masks made ahead by the last `advance` are returned instead when they cover the step's
        grammar rows (`_covers`); otherwise they are waited for first.
        """
        ahead, self._ahead = self._ahead, None
        self._spare_core = beside
        if ahead is not None:
            if self._covers(ahead, rows):
                return ahead[1]  # NOTE: `finish` maps its rows onto this step's
            ahead[1].exception()  # NOTE: wait for it: a matcher borrowed by a running mask cannot be read
        if all(m is None for _, m in rows):
            return None
        ids, matchers = [rid for rid, _ in rows], [m for _, m in rows]
        if beside:
            # NOTE: beside an accelerator's forward on llguidance's pool, which lets go of the GIL that the
            # forward's launches need; on a CPU its spinning thread would take a core from the forward's
            background = self.device.type != "cpu"
            return self._worker().submit(
                lambda: (ids, self.grammars.forbidden(matchers, self.device, background=background)))
        return Made(lambda: (ids, self.grammars.forbidden(matchers, self.device)))

    @staticmethod
    def _covers(ahead: tuple[dict[str, llguidance.LLMatcher], Pending],
                rows: list[tuple[str, llguidance.LLMatcher | None]]) -> bool:
        """Whether the masks made ahead hold every constrained row's, made from the same matcher, and
        did not fail (a failure is computed again, by the step's own path)."""
        made, pending = ahead
        if any(m is not None and made.get(rid) is not m for rid, m in rows) or all(m is None for _, m in rows):
            return False
        if pending.done() and pending.exception() is not None:
            log.warning("structured output: masks made ahead failed (%r); made again", pending.exception())
            return False
        return True

    def _worker(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="mmserve-grammar")
        return self._thread

    def _start_ahead(self, rows: list[tuple[str, llguidance.LLMatcher]]) -> None:
        """Start the masks of `rows`, whose matchers have just advanced, for the next step, where the forward
        leaves the host a core (else the next `start` makes them on the step thread).

        NOTE: off the step thread, on llguidance's pool, which lets go of the GIL: computed while the step
        thread's Python emits this step's outputs and schedules the next. Where the forward's threads fill
        the cores, the work's tail overlapped the next forward and slowed the whole batch ~3x more than making
        the masks on the step thread before it (docs/benchmarks.md). No other code reads these matchers
        meanwhile: the next `start` waits for this work unless it returns it, and `finish` waits for it
        before `advance`.
        """
        if not rows or not self._spare_core:
            return
        ids = [rid for rid, _ in rows]
        matchers: list[llguidance.LLMatcher | None] = [m for _, m in rows]
        self._ahead = (dict(rows), self._worker().submit(
            lambda: (ids, self.grammars.forbidden(matchers, self.device, background=True))))

    @staticmethod
    def finish(pending: Pending | None, ids: list[str]) -> RowMasks | None:
        """What the grammars of the step's logits rows (request `ids`) forbid; None if no row has one."""
        if pending is None:
            return None
        planned, masks = pending.result()
        if masks is None or planned == ids:
            return masks
        where = {rid: j for j, rid in enumerate(ids)}  # the planned rows among the step's (minus any that failed)
        kept = [k for k, r in enumerate(masks.rows) if planned[r] in where]  # masks whose row is still here
        if not kept:
            return None
        rows = tuple(where[planned[masks.rows[k]]] for k in kept)
        # NOTE: all kept is the usual case (masks made ahead for the grammar rows only): no (g, vocab) copy
        if len(kept) == len(masks.rows):
            return RowMasks(rows, masks.forbid)
        return RowMasks(rows, masks.forbid.index_select(0, ints_to_device(kept, masks.forbid.device)))  # (k, vocab)

    def advance(self, ids: list[str], tokens: list[int],
                matchers: list[llguidance.LLMatcher | None]) -> tuple[set[str], dict[str, Exception]]:
        """Feed each constrained row its sampled token -> (requests whose grammar allows nothing more, and
        the requests that cannot go on: their masks left no token (-1), or their matcher failed); then start
        the next step's masks of the others."""
        ended: set[str] = set()
        broken: dict[str, Exception] = {}
        going: list[tuple[str, llguidance.LLMatcher]] = []
        for rid, token, matcher in zip(ids, tokens, matchers, strict=True):
            if matcher is None:
                continue
            error = _consume(matcher, token)
            if error is not None:
                broken[rid] = error
            elif matcher.is_stopped():
                ended.add(rid)
            else:
                going.append((rid, matcher))
        self._start_ahead(going)
        return ended, broken


def _consume(matcher: llguidance.LLMatcher, token: int) -> Exception | None:
    """Advance `matcher` by `token`; what went wrong, or None."""
    if token < 0:
        why = f"its matcher failed: {matcher.get_error()}" if matcher.is_error() else \
            "the grammar allows no token the model may sample here (e.g. only an end that allowed_token_ids leaves out)"
        return NoTokenAllowedError(f"structured output cannot go on: {why}")
    try:
        if matcher.consume_token(token):
            return None
    except BaseException as exc:
        if not contained(exc):
            raise
        return GrammarViolationError(f"token {token}: the grammar's matcher failed: {exc!r}")
    return GrammarViolationError(f"token {token} broke the grammar: {matcher.get_error()}")
