"""Every object that crosses a stage boundary (ingress -> preprocess -> encoder -> decoder -> ingress).

Owns: the typed, picklable dataclasses passed between stages, each field commented with its unit.
Does not own: how they travel (in-process call, Ray handle, object store) nor what any stage does
with them. Big payloads (`ProcessedItem.pixel_values`, embeddings) are numpy arrays so that the
Ray object store can share them zero-copy; a field typed `Any` may hold the array itself or a
reference to it (an ObjectRef in the Ray app).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from mmserve.errors import InvalidSamplingError

FinishReason = Literal["stop", "length", "abort"]
# a stage's own time on one request, phase by phase: (`stage.phase`, milliseconds). A call's phase (e.g.
# `decoder.encode_call`) holds those its callee reported (`encoder.*`): nested by name, not by position; a
# stage's `*.replica` comes after its own phases (mmserve/runtime/timeline.py)
PhaseTimes = tuple[tuple[str, float], ...]


MAX_TOP_LOGPROBS = 20  # as OpenAI allows
# NOTE: each is read per token of every step of the request's sequences (a scan, a logits update): a list of
# millions in a 64 MiB body slowed every step of its replica to seconds
MAX_TOKEN_ID_ENTRIES = 1024  # `stop_token_ids` and `logit_bias` entries at most, each
MAX_CHOICES = 16  # `n` at most; NOTE: OpenAI allows 128, but each choice is a running sequence of its own


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match (response_format / vLLM's structured outputs)."""

    kind: Literal["json", "regex", "choice", "lark"]  # how `spec` reads
    spec: str  # a JSON Schema as JSON text, a regex, a JSON list of choice strings, or a Lark grammar


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 1.0  # below 1e-5 (0 too) means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one, in [0, 1]; 0 = off (vLLM's)
    seed: int | None = None  # per-request RNG seed; None = nondeterministic
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before them
    include_stop_str_in_output: bool = False  # the text keeps the stop string or stop token that ended it (vLLM's)
    skip_special_tokens: bool = True  # special tokens are left out of the text (vLLM's)
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation (model eos added)
    ignore_eos: bool = False  # keep going past eos / end-of-turn (benchmarks)
    # log-probabilities of each sampled token and of this many top alternatives (0-20); None = none
    logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted from a token's logit once it occurs in the output, [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output, [-2, 2]
    repetition_penalty: float = 1.0  # > 0; divides positive logits of prompt and output tokens (vLLM's)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100])
    allowed_token_ids: tuple[int, ...] | None = None  # the only token ids the output may hold; None = all (vLLM's)
    bad_words: tuple[str, ...] = ()  # words the output may not complete (vLLM's)
    # bad_words as the token sequences that spell them, filled in by the preprocess stage (token ids)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0  # end-of-sequence and stop token ids are masked until this many tokens (vLLM's)
    structured: StructuredOutput | None = None  # the output must match it; None = free text
    n: int = 1  # choices generated from the prompt, which is computed once (choices)
    # the caller reads only the whole answer (a non-streamed response): after the first output, one message
    # at the end with all the rest merged (vLLM's RequestOutputKind.FINAL_ONLY)
    final_only: bool = False

    def __post_init__(self) -> None:
        # NOTE: one string is one stop string (OpenAI's `stop` and vLLM's SamplingParams take either), not its letters
        for name in ("stop", "bad_words"):
            if isinstance(value := getattr(self, name), str):
                object.__setattr__(self, name, (value,))

    def validate(self) -> None:
        """Raise InvalidSamplingError naming the first out-of-range field."""
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (math.isfinite(self.temperature) and self.temperature >= 0.0,
             f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words must be non-empty words"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
            (len(self.logit_bias) <= MAX_TOKEN_ID_ENTRIES,
             f"logit_bias may hold {MAX_TOKEN_ID_ENTRIES} token ids at most, got {len(self.logit_bias)}"),
            (len(self.stop_token_ids) <= MAX_TOKEN_ID_ENTRIES,
             f"stop_token_ids may hold {MAX_TOKEN_ID_ENTRIES} ids at most, got {len(self.stop_token_ids)}"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "allowed_token_ids must not be empty (leave it out to allow every token)"),
            (0 <= self.min_tokens <= self.max_tokens, f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            # NOTE: a grammar's end is no end token that min_tokens could hold back: the matcher stops the output
            # where the grammar completes (min_tokens ignored), or, where the grammar could go on, the held-back
            # end forces more of it (an integer of min_tokens digits). vLLM leaves the pair undefined.
            (self.structured is None or self.min_tokens == 0,
             "min_tokens cannot be combined with structured output (response_format, structured_outputs): the "
             "grammar decides where the output ends"),
            (1 <= self.n <= MAX_CHOICES, f"n must be in [1, {MAX_CHOICES}], got {self.n}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"),
            # NOTE: int64, as OpenAI documents; choice i's seed + i stays within torch's range (up to 2**64 - 1)
            (self.seed is None or -(2**63) <= self.seed < 2**63,
             f"seed must be a 64-bit signed integer, got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidSamplingError(message)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias, `allowed_token_ids`, `bad_words` or `min_tokens` changes this request's
        logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids is not None
                    or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        """NOTE: a temperature below 1e-5 is greedy too (vLLM's sampler's cutoff): dividing by it only magnifies
        ties. vLLM's request path first raises a temperature in (0, 0.01) to 0.01; not done here."""
        return self.temperature < 1e-5 or self.top_k == 1


@dataclass(frozen=True)
class TemplateOptions:
    """How the chat template renders a request's messages (vLLM's request fields of these names)."""

    add_generation_prompt: bool = True  # end the prompt with the header of the model's turn (flag)
    continue_final_message: bool = False  # end the prompt inside the final message, for the model to go on (flag)
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs: template variable -> JSON value


@dataclass(frozen=True)
class ChatRequest:
    request_id: str  # unique per request, chosen by the ingress
    messages: list[dict[str, Any]]  # OpenAI chat messages (role, content: str | list of parts)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # how to sample the output, and when to stop
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. do_pan_and_scan
    cache_salt: str | None = None  # requests with another salt share no cached KV, processed image or embedding
    # the field with which the client set the output's length ("max_tokens" or "max_completion_tokens"), None when
    # it took the default: a prompt that leaves a length asked for less room is refused (OpenAI's and vLLM's
    # rule, naming that field), where a default one is cut at the end of the context
    max_tokens_asked: str | None = None
    template: TemplateOptions = field(default_factory=TemplateOptions)  # how the messages become the prompt


@dataclass(frozen=True)
class ProcessedItem:
    """The image processor's output for one item; cached by content hash."""

    # (n_tiles, 3, H, W) uint8: resized, before rescale/normalize (the encoder does those, see
    # mmserve/models/pixels.py); tile 0 is the whole image, then its crops
    pixel_values: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.pixel_values.nbytes)

    @property
    def num_tiles(self) -> int:
        return int(self.pixel_values.shape[0])


@dataclass(frozen=True)
class StoredItem:
    """A ProcessedItem kept in a shared store (the Ray object store); `ref` resolves to it."""

    ref: Any  # a reference (e.g. ObjectRef) to a ProcessedItem
    num_tiles: int  # images the item encodes: the whole image plus its crops (images)
    nbytes: int  # bytes of its pixel values (bytes)
    kept: bool = False  # the shared store's own copy, which outlives the replica that made the item (flag)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request's unset sampling fields take: the model's recommended sampling, read from its checkpoint's
    generation_config.json as vLLM does by default; None = OpenAI's default."""

    temperature: float | None = None  # the draws' temperature (OpenAI: 1.0)
    top_p: float | None = None  # nucleus mass in (0, 1] (OpenAI: 1.0)
    top_k: int | None = None  # the k most likely tokens kept; 0 = off (OpenAI has none)
    repetition_penalty: float | None = None  # > 0, 1.0 = off (vLLM's extension)
    min_p: float | None = None  # in [0, 1], 0 = off (vLLM's extension)

    def describe(self) -> str:
        """What unset fields take, e.g. "top_p=0.95, top_k=64 (the checkpoint's generation_config.json)"; "OpenAI's
        defaults" when no field is set."""
        set_ = [f"{name}={value}" for name, value in vars(self).items() if value is not None]
        return f"{', '.join(set_)} (the checkpoint's generation_config.json)" if set_ else "OpenAI's defaults"


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP edge says of the model it serves (read from the checkpoint by a model stage)."""

    model_id: str  # the name served: OpenAI's `model`
    max_model_len: int  # prompt + output tokens a sequence may hold (tokens)
    # what a request's unset sampling fields take (the checkpoint's recommendation, or OpenAI's defaults)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


@dataclass(frozen=True)
class StoreLookup:
    """The shared ProcessorCache store's answer to a lookup."""

    epoch: str  # the store replica's identity: a replacement (after a death) starts empty under a new one
    item: StoredItem | None  # the entry, or None on a miss
    key: str | None = None  # the entry's content hash (hex), on a hit by source key


@dataclass(frozen=True)
class PlaceholderRange:
    offset: int  # index of the item's first prompt token (tokens)
    length: int  # prompt tokens the item spans, image tokens and the text between crops (tokens)


@dataclass(frozen=True)
class MultiModalFeatureSpec:
    identifier: str  # hex content hash: pixels + mode + size + model id + output-changing kwargs + cache salt
    modality: str  # "image"
    placeholder: PlaceholderRange  # where the item sits in the prompt
    num_embeds: int  # embedding rows the encoder yields = image-token positions in the range
    data: Any = None  # ProcessedItem, StoredItem, or None once no stage needs it


@dataclass(frozen=True)
class PreprocessedRequest:
    request_id: str  # the ChatRequest's, unique per request
    prompt_token_ids: list[int]  # the whole prompt, placeholders expanded (tokens)
    features: list[MultiModalFeatureSpec]  # one per item, in prompt order
    sampling: SamplingParams  # the ChatRequest's, plus the prompt's bad_words_token_ids (defaults were resolved before)
    processor_cache_hits: int = 0  # items of this request served by the ProcessorCache (items)
    cache_salt: str | None = None  # as in ChatRequest
    # the prefix cache's chained digest of each full block of the prompt (32 bytes each), items and salt
    # included; () unless the decoder's router keys on them (the decoder computes its own).
    block_hashes: tuple[bytes, ...] = ()
    timings: PhaseTimes = ()  # the Preprocess stage's own time on it (phase, ms)

    def for_attempt(self, request_id: str, *, kept: bool) -> PreprocessedRequest:
        """This request as one attempt sends it to the Decoder: under the attempt's own id; when `kept` from an
        earlier attempt (a retry after a lost Decoder), without the Preprocess phases, which were that one's."""
        return replace(self, request_id=request_id, timings=() if kept else self.timings)


@dataclass(frozen=True)
class EncoderOutput:
    """What the encoder stage hands the decoder for one request."""

    request_id: str  # the encode call's: the request's own, or an attempt's (request id)
    embeddings: list[Any]  # per feature, in feature order: (num_embeds, text_hidden) numpy or tensor
    dtype: str = "float32"  # torch dtype of the embeddings; numpy ones may carry its bits (embeddings_wire)
    timings: PhaseTimes = ()  # the encoder stage's own time on the call (phase, ms)
    host: str = ""  # the host whose CPU computes this encoder's forwards (its name, runtime/shared_cores.py); "" = an
    # accelerator (the answer may come from its cache, with no forward run)
    vision_weights: str = ""  # the weights the embeddings were computed with (models/weights_id.py); "" = unknown


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str  # the PreprocessedRequest's
    prompt_token_ids: list[int]  # as in PreprocessedRequest (tokens)
    features: list[MultiModalFeatureSpec]  # specs; `data` no longer needed here
    embeddings: list[Any]  # per feature: (num_embeds, text_hidden) array, tensor or reference; None when
    # its placeholder was in the cached prefix (fetched later if the cache lets the blocks go first)
    sampling: SamplingParams  # the PreprocessedRequest's
    cache_salt: str | None = None  # as in ChatRequest
    block_hashes: tuple[bytes, ...] = ()  # digests of the prompt's full KV blocks (prefix_cache.py); () = compute


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and its top alternatives, from the model's raw logits
    (before temperature, top-k/top-p and the never-sampled mask), as vLLM's default reports them."""

    token_id: int  # the sampled token (token id)
    token: str  # the token's own text, decoded alone (a byte of a character may decode to U+FFFD)
    logprob: float  # natural log of its probability
    token_bytes: bytes  # its own bytes (a byte token's one byte, else its text as UTF-8): OpenAI's `bytes`
    top: tuple[tuple[int, str, float, bytes], ...] = ()  # (id, text, logprob, bytes) of the likeliest, best first


@dataclass(frozen=True)
class RequestOutput:
    """What one decoder step produced for one request: a delta, not the whole text."""

    request_id: str  # the request this delta belongs to
    new_token_ids: list[int]  # tokens sampled since the request's previous output (tokens)
    new_text: str  # text completed since the previous output; never ends inside a UTF-8 character
    finished: bool  # the last delta of its choice (flag)
    finish_reason: FinishReason | None  # set when finished
    num_prompt_tokens: int  # prompt tokens, image tokens included (tokens)
    num_output_tokens: int  # tokens generated so far (tokens)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (tokens)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    index: int = 0  # which of the request's `n` choices this output belongs to (choice index)
    # vLLM's: what ended a "stop": the stop string, or the stop token id (the request's own, or a checkpoint end id
    # other than the tokenizer's, outside structured output and ignore_eos); None for the tokenizer's end
    stop_reason: str | int | None = None
    # on a choice's first output: the stages' own time up to it (phase, ms): the preprocess phases its request
    # carried, then the decoder's (with the encoder's inside); () on the others
    timings: PhaseTimes = ()


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one delta; counts and finish come from the last."""
    if len(outputs) == 1:
        return outputs[0]
    return replace(
        outputs[-1],
        timings=outputs[0].timings,  # a first output's, if it is among them
        new_token_ids=[t for out in outputs for t in out.new_token_ids],
        new_text="".join(out.new_text for out in outputs),
        logprobs=None if outputs[-1].logprobs is None else [lp for out in outputs for lp in out.logprobs or []],
    )


@dataclass(frozen=True)
class RequestFailed:
    """A request that a stage could not serve after accepting it; ends the request's stream.

    NOTE: in the Ray app a stage also *returns* (or yields) one for a client fault instead of raising
    it: an exception raised out of a replica is logged there as a failed request with a traceback and
    counted in Serve's error metrics, which should count our faults, not the client's bad image.
    """

    request_id: str  # the request that failed
    error: Exception  # an InvalidRequestError subclass for client faults (4xx), else a server fault
    finished: bool = True  # always True: nothing follows
