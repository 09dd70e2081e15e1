"""The decoder stage: continuous batching over a paged KV cache, one batched forward per step.

Owns: the step loop body (schedule -> forward -> sample -> update -> detokenise) and the
per-request output state (RNG, detokeniser, stop strings). Does not own: the policy (scheduler),
memory (block pool, KV cache), the model, or how requests arrive (engine / Ray deployment).
Not thread-safe: one caller drives `add`, `abort` and `step` (the engine's step loop).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmserve.config import DecoderConfig
from mmserve.decoder.block_pool import BlockPool
from mmserve.decoder.chunking import check_image_budget, decodes_leave_room, needs_items
from mmserve.decoder.detokenizer import IncrementalDetokenizer, token_piece
from mmserve.decoder.grammar import Grammars
from mmserve.decoder.grammar_step import GrammarStep
from mmserve.decoder.kept_gather import KeptGathers
from mmserve.decoder.kv_cache import KVCache
from mmserve.decoder.model_runner import ModelRunner, StepLogits, step_size
from mmserve.decoder.penalties import check_allowed
from mmserve.decoder.prefix_cache import BlockHasher
from mmserve.decoder.sampler import Sampler, make_generator
from mmserve.decoder.scheduler import Scheduler
from mmserve.decoder.sequence import PromptImages, Sequence
from mmserve.decoder.stats import DecoderStats
from mmserve.decoder.step_logprobs import asked_logprobs, read_tokens, shaped_logprobs
from mmserve.decoder.thread_calibration import calibrate_threads, price_layouts, warm_up
from mmserve.decoder.token_history import TokenHistory
from mmserve.errors import InvalidRequestError
from mmserve.messages import DecodeRequest, RequestFailed, RequestOutput, TokenLogprob
from mmserve.models.base import ModelSpec, TextDecoder
from mmserve.runtime.device_errors import device_fatal, naming_faults
from mmserve.runtime.step_threads import StepThreads
from mmserve.runtime.weight_layout import weight_layout

TIMED_CHUNK = 256  # rows of the prefill chunk timed beside the decodes' when choosing the matmul forms
PIECES_KEPT = 1 << 16  # tokens whose text and bytes a decoder keeps for log-probs (count)
log = logging.getLogger(__name__)

# Called with the request ids and their (n, vocab) logits of every step; tests use it for parity.
LogitsObserver = Callable[[list[str], torch.Tensor], None]
# Called from the step when a running request needs embeddings it was added without (request id, features).
MissingEmbeddings = Callable[[str, list[int]], None]


@dataclass
class _OutputState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    matcher: Any = None  # the request's llguidance matcher when its output is constrained
    history: TokenHistory | None = None  # what its penalties read, when it asks for any


class Decoder:
    def __init__(
        self,
        model: TextDecoder,
        spec: ModelSpec,
        tokenizer,
        config: DecoderConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        on_logits: LogitsObserver | None = None,
    ):
        device = torch.device(device)
        self.spec, self.tokenizer, self.on_logits = spec, tokenizer, on_logits
        # NOTE: a token's text is a function of its id: each top log-prob of each step asks for one
        self._piece = functools.lru_cache(maxsize=PIECES_KEPT)(functools.partial(token_piece, tokenizer))
        self.kv = KVCache(spec, config, dtype=dtype, device=device)
        self.pool = BlockPool(self.kv.num_pages)
        self.hasher = BlockHasher(spec.model_id, str(dtype), config.block_size)
        self.scheduler = Scheduler(config, self.pool, spec.attention, max_model_len=spec.max_model_len,
                                   eos_token_ids=spec.eos_token_ids, hasher=self.hasher,
                                   decodes_first=decodes_leave_room(spec, config))
        self.on_missing: MissingEmbeddings | None = None  # set by whoever can fetch embeddings (the service)
        kept = KeptGathers(self.kv, budget_bytes=config.kept_gathers_bytes, from_bytes=config.kept_gathers_min_bytes) \
            if config.kept_gathers_bytes else None
        self.runner = ModelRunner(model, spec, self.kv, self.scheduler.kv.kinds, device=device,
                                  threads=StepThreads(device, config), kept=kept)
        self.sampler = Sampler(spec.never_sampled, spec.eos_token_ids)
        # NOTE: as vLLM, the checkpoint's end ids other than the tokenizer's own end count as stop token ids (Gemma
        # 3's <end_of_turn>): a choice they end reports them as its `stop_reason`
        self._tokenizer_end: int | None = getattr(tokenizer, "eos_token_id", None)
        self._named_ends = frozenset(spec.eos_token_ids) - {self._tokenizer_end}
        self.grammars = Grammars(tokenizer, spec.vocab_size, spec.eos_token_ids, never=spec.never_sampled)
        self.grammar_step = GrammarStep(self.grammars, device)
        self._states: dict[str, _OutputState] = {}
        self.steps = 0
        self.computed_tokens = self.sampled_tokens = 0  # (tokens) since start, counted each step
        self.preemptions = 0  # sequences preempted since start (DecoderStats)
        check_image_budget(spec, config)
        if self.scheduler.max_seq_len < spec.max_model_len:
            log.warning("the KV pool holds %d tokens of one sequence, below max_model_len %d: longer prompts are "
                        "refused, longer outputs end there; raise decoder.num_blocks (or lower max_model_len)",
                        self.scheduler.max_seq_len, spec.max_model_len)
        if config.measure_matmul_forms and device.type == "cpu":  # NOTE: first: the threads are timed with them
            model.matmul.calibrate(model.linear_weights(), self.runner.threads.possible_counts(),
                                   config.small_step_tokens, min(config.max_num_batched_tokens, TIMED_CHUNK))
            model.pack_weights()
        if self.runner.threads.needs_calibration:
            calibrate_threads(self.runner, self.scheduler, self.spec.eos_token_ids[0])
        elif device.type == "cuda":  # NOTE: its kernels loaded now, not on the first request
            warm_up(self.runner, self.scheduler, self.spec.eos_token_ids[0], self.sampler)
        if config.choose_weight_layout_while_serving:  # NOTE: after the threads' timing, whose steps serve no one
            layout = weight_layout(model.matmul, len(model.linear_weights()), model.relayout_weight)
            if layout is not None:  # NOTE: only where the products were timed (measure_matmul_forms)
                price_layouts(self.runner, self.scheduler, self.spec.eos_token_ids[0], layout)
            self.runner.layout = layout

    def add(self, request: DecodeRequest, matcher: Any = None, sibling: str | None = None) -> None:
        """Queue a request; raises CapacityError if it can never be scheduled, InvalidGrammarError if its
        structured output does not compile, InvalidRequestError if a prompt token id is not in the vocabulary.
        `matcher`: its grammar's matcher, made off the step thread (`grammars.matcher`); made here when None.
        `sibling`: another choice of the same request, whose place in the queue it takes (`Scheduler.add`)."""
        _check_ids(request.prompt_token_ids, self.spec.vocab_size)
        check_allowed(request.sampling, self.spec.never_sampled, self.spec.eos_token_ids)
        images = PromptImages.of(request.prompt_token_ids, request.features, self.spec.image_token_id) \
            if request.features else None
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            features=list(request.features),
            embeddings=list(request.embeddings),
            atomic_spans=images.spans() if images is not None and self.spec.attention.bidirectional_images else [],
            images=images,
            cache_salt=request.cache_salt,
            block_hashes=list(request.block_hashes),
        )
        structured = request.sampling.structured
        if structured is not None and matcher is None:
            matcher = self.grammars.matcher(structured)  # before any KV is held
        # NOTE: everything that may raise before the scheduler takes it: a sequence it holds without a state here
        # would fail every later step
        state = _OutputState(seq=seq, detokenizer=IncrementalDetokenizer.for_request(self.tokenizer, request.sampling),
                             generator=make_generator(request.sampling.seed), matcher=matcher,
                             history=TokenHistory(seq.token_ids, seq.num_prompt_tokens)
                             if request.sampling.adjusts_logits else None)
        self.scheduler.add(seq, sibling)
        self._states[seq.request_id] = state

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is unknown or already finished."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort(request_id)
        return self._output(state, [], "", finish_reason="abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> None:
        """Abort every request (after a failed step)."""
        for request_id in list(self._states):
            self.abort(request_id)

    def request_ids(self) -> list[str]:
        """Requests added and not yet finished or aborted."""
        return list(self._states)

    def step(self) -> list[RequestOutput | RequestFailed]:
        """Run one batched forward over everything scheduled; one output per request that sampled, and a
        RequestFailed for each request whose own computation failed (it is aborted; the others go on)."""
        if self.runner.layout is not None:  # NOTE: here, once the last step's outputs have gone
            self.runner.layout.relay_one()
        plan = self.scheduler.schedule()
        self.preemptions += len(plan.preempted)
        self._ask_for_missing(plan.missing)
        if not plan.scheduled:
            return []
        scheduled = [(s.seq, s.num_new_tokens) for s in plan.scheduled]
        num_new, attended = step_size(scheduled)
        # NOTE: a kernel's fault surfaces at a later wait (the tokens' read): the step's requests are named
        with naming_faults(lambda: [seq.request_id for seq, _ in scheduled]):
            masks = self.grammar_step.start([(s.seq.request_id, self._states[s.seq.request_id].matcher)
                                             for s in plan.scheduled if s.samples],
                                            beside=self.runner.threads.leaves_a_core(num_new, attended))
            result, failed = self._execute(scheduled)
            self.steps += 1
            self.computed_tokens += num_new
            ids = [seq.request_id for seq in result.seqs]
            if self.on_logits is not None:
                self.on_logits(ids, result.logits)
            row_masks = self.grammar_step.finish(masks, ids)
            samplings = [seq.sampling for seq in result.seqs]
            sampled = self.sampler.sample(
                result.logits,
                samplings,
                [self._states[rid].generator for rid in ids],
                [self._states[rid].history for rid in ids],
                row_masks,
            )  # (n,)
            asked = asked_logprobs(result.logits, sampled, samplings, row_masks)
            tokens, table = read_tokens(sampled, asked)  # NOTE: the step's one wait for the device
        self.sampled_tokens += sum(t >= 0 for t in tokens)  # NOTE: -1: a row whose masks left no token
        logprobs = shaped_logprobs(asked, table, tokens, samplings, self._piece)
        ended, broken = self.grammar_step.advance(ids, tokens, [self._states[rid].matcher for rid in ids])
        failed += [self._fail(self._states[rid].seq, exc) for rid, exc in broken.items()]  # before update
        finished = {seq.request_id for seq in self.scheduler.update(plan, dict(zip(ids, tokens, strict=True)))}
        for rid in ended:  # the grammar is complete: nothing may follow, and it ends as a stop, not a length
            if rid in finished:
                self._states[rid].seq.finish_reason = "stop"
            else:
                self.scheduler.finish(rid, "stop")
        finished |= ended
        return [*(self._emit(rid, tok, rid in finished, logprobs.get(i))
                  for i, (rid, tok) in enumerate(zip(ids, tokens, strict=True)) if rid not in broken), *failed]

    def _execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[StepLogits, list[RequestFailed]]:
        """The step's forward. If it raises, each sequence runs again alone, and only those that fail by
        themselves are aborted and reported: one bad request (a token id past the vocabulary, a broken
        embedding) must not take its batch mates down.

        NOTE: safe to repeat: a forward only writes the KV slots of the positions it computes, and the
        rerun writes the same ones; progress is recorded after the step (`Scheduler.update`), which skips
        the aborted.
        """
        try:
            return self.runner.execute(scheduled), []
        except Exception as exc:
            if device_fatal(exc):  # NOTE: every forward after it fails too (`step` names the requests)
                raise
            if len(scheduled) == 1:
                return self._no_logits(), [self._fail(scheduled[0][0], exc)]
            log.warning("decoder step of %d sequences failed (%r); running each alone", len(scheduled), exc)
        parts: list[StepLogits] = []
        failed: list[RequestFailed] = []
        for one in scheduled:
            try:
                parts.append(self.runner.execute([one]))
            except Exception as alone:
                if device_fatal(alone):
                    raise
                failed.append(self._fail(one[0], alone))
        if not parts:
            return self._no_logits(), failed
        seqs = [seq for part in parts for seq in part.seqs]
        return StepLogits(seqs, torch.cat([part.logits for part in parts])), failed  # (len(seqs), vocab)

    def _fail(self, seq: Sequence, error: Exception) -> RequestFailed:
        log.warning("request %s failed in a decoder step: %r", seq.request_id, error)
        self.abort(seq.request_id)  # its blocks back to the pool; update() skips it
        return RequestFailed(seq.request_id, error)

    def _no_logits(self) -> StepLogits:
        return StepLogits([], torch.zeros((0, self.spec.vocab_size), device=self.runner.device))

    def _emit(self, request_id: str, token: int, finished: bool, logprob: TokenLogprob | None) -> RequestOutput:
        state = self._states[request_id]
        # NOTE: the token that stops a sequence is in its token ids, not in its text, as vLLM leaves it out (with
        # include_stop_str_in_output its text is kept, and searched for stop strings as vLLM's is since v0.10.1)
        stop = finished and state.seq.finish_reason == "stop" and self.scheduler.is_stop_token(state.seq, token) \
            and not state.seq.sampling.include_stop_str_in_output
        text = "" if stop else state.detokenizer.add(token)
        if state.detokenizer.stopped:  # NOTE: this token completed a stop string (it finishes only once)
            if not finished:
                self.scheduler.finish(request_id, "stop")
            state.seq.finish_reason, finished = "stop", True  # NOTE: on the last token allowed too, as vLLM
        reason = None
        if finished:
            text += state.detokenizer.flush()
            del self._states[request_id]
            reason = state.seq.stop_reason(token, state.detokenizer.stop_string, self._named_ends, self._tokenizer_end)
        return self._output(state, [token], text, finish_reason=state.seq.finish_reason if finished else None,
                            finished=finished, logprobs=None if logprob is None else [logprob], stop_reason=reason)

    def _output(self, state, tokens, text, *, finish_reason, finished: bool = True,
                logprobs: list[TokenLogprob] | None = None, stop_reason: str | int | None = None) -> RequestOutput:
        seq = state.seq
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            new_text=text,
            finished=finished,
            finish_reason=finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            logprobs=logprobs if logprobs is not None or seq.sampling.logprobs is None else [],
            stop_reason=stop_reason,
        )

    def prefix_hit_tokens(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Prompt tokens a request of `num_tokens` with these block hashes would find cached now (no hold)."""
        kv = self.scheduler.kv
        return kv.cached_prefix(block_hashes, (num_tokens - 1) // kv.block_size) * kv.block_size

    def provide_embeddings(self, request_id: str, embeddings: dict[int, object]) -> None:
        """Embeddings of features a request was added without (see `on_missing`)."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return  # finished or aborted meanwhile
        for index, emb in embeddings.items():
            seq.embeddings[index] = emb
            seq.requested.discard(index)

    def fetch_failed(self, request_id: str, indices: list[int], error: Exception) -> None:
        """A fetch of embeddings the request was added without failed: raise `error` (failing the request) if
        it still needs them; else forget the ask, so that a later need (after a preemption) asks again."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return
        if needs_items(seq, indices):
            raise error
        seq.requested.difference_update(indices)

    def _ask_for_missing(self, missing: list[tuple[Sequence, list[int]]]) -> None:
        for seq, indices in missing:
            new = [i for i in indices if i not in seq.requested]
            if not new:
                continue
            if self.on_missing is None:
                raise RuntimeError(f"request {seq.request_id} lacks embeddings and nobody can fetch them")
            seq.requested.update(new)
            self.on_missing(seq.request_id, new)

    def stats(self) -> DecoderStats:
        s = self.scheduler.stats()
        return DecoderStats(
            running=s.running, waiting=s.waiting, free_blocks=s.free_blocks,
            total_blocks=s.total_blocks, steps=self.steps, kv_cache_bytes=self.kv.nbytes,
            cached_blocks=s.cached_blocks, prefix_queries=s.prefix_queries, prefix_hits=s.prefix_hits,
            allocated_blocks=self.pool.allocated, preemptions=self.preemptions,
            computed_tokens=self.computed_tokens, sampled_tokens=self.sampled_tokens,
        )


def _check_ids(prompt: list[int], vocab: int) -> None:
    """Refuse a prompt whose token ids are not all in [0, vocab).

    NOTE: here, not in the step: on an accelerator an id past the embedding table is a device-side assert,
    which ends the process's CUDA context instead of raising in the step that could fail it alone.
    """
    ids = np.asarray(prompt, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise InvalidRequestError(f"prompt token id {bad} is not in the model's vocabulary (0 to {vocab - 1})")
