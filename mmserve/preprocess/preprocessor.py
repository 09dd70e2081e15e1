"""The preprocess stage: a ChatRequest -> prompt token ids + one FeatureSpec per image.

Owns: validating the request's shape (roles, content parts, item count, mm kwargs), reading/decoding/
hashing/processing each image through the ProcessorCache (a repeat of the same bytes is found before it is
decoded), expanding the placeholders with the model's prompt rule, tokenizing, locating each item's placeholder
range, and stamping the prompt's prefix-cache block hashes (with the decoder's hashing, handed in).
Does not own: the message shape (chat_messages.py), the chat template and its options (chat_template.py), the
sampling fields' limits (sampling_checks.py), fetching and decoding bytes (media.py), the hash (hashing.py), the
LRU (processor_cache.py), one processing of an image for requests that bring it at once (single_flight.py), the
model's own placeholder rule (its family's `PromptRule`), nor encoding.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import replace
from pathlib import Path
from typing import Any

from PIL import Image

from mmserve.config import LimitsConfig, MediaConfig
from mmserve.errors import InvalidRequestError, PromptTooLongError, TooManyItemsError
from mmserve.messages import (
    ChatRequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    PreprocessedRequest,
    ProcessedItem,
    SamplingParams,
    TemplateOptions,
)
from mmserve.models.base import PromptRule
from mmserve.models.pixels import DEFER_TO_ENCODER, as_uint8
from mmserve.preprocess.chat_messages import ParsedMessages, parse_messages
from mmserve.preprocess.chat_template import ChatTemplate
from mmserve.preprocess.hashing import hash_image, hash_source, processor_fingerprint
from mmserve.preprocess.image_runs import image_token_runs
from mmserve.preprocess.image_slots import ImageSlots, held
from mmserve.preprocess.media import MediaLoader, fetched
from mmserve.preprocess.processor_cache import CachedItem, ItemCache
from mmserve.preprocess.sampling_checks import check_strings, check_token_ids
from mmserve.preprocess.single_flight import SingleFlight
from mmserve.runtime.timeline import Timeline

# Seconds a request waits for another's processing of the same image before it processes the image itself
FLIGHT_WAIT_S = 60.0
# (prompt token ids, features, cache salt) -> the prefix cache's digest per full block (decoder.prefix_cache)
BlockHashes = Callable[[list[int], list[MultiModalFeatureSpec], str | None], tuple[bytes, ...]]


class Preprocessor:
    """Turns requests into token ids and processed items; thread-safe."""

    def __init__(self, model_dir: str | Path, *, media: MediaConfig, cache: ItemCache, rule: PromptRule,
                 model_id: str, max_model_len: int, vocab_size: int | None = None, loader: MediaLoader | None = None,
                 limits: LimitsConfig | None = None, block_hashes: BlockHashes | None = None,
                 image_slots: ImageSlots | None = None, fetch_slots: ImageSlots | None = None) -> None:
        from transformers import AutoProcessor  # NOTE: deferred; importing transformers takes seconds

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.tokenizer = self.processor.tokenizer  # the decoder's detokenizer uses this one too
        if not self.processor.chat_template:
            # NOTE: a re-export may keep its template in tokenizer_config.json only, which the processor's
            # apply_chat_template does not read: every request would fail
            self.processor.chat_template = getattr(self.tokenizer, "chat_template", None)
            if not self.processor.chat_template:
                raise ValueError(f"{model_dir} has no chat template (chat_template.jinja, chat_template.json "
                                 "or tokenizer_config.json)")
        self.image_processor = self.processor.image_processor
        self.rule = rule
        self.template = ChatTemplate(self.processor, rule.reserved_strings)
        self._processor_keys = frozenset(rule.resolve_kwargs({}))  # the image processor's output-changing kwargs
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.rule.image_token))
        self.media = media
        self.loader = loader or MediaLoader(media)
        self.cache = cache
        self.model_id = model_id
        self._keys_model = f"{model_id}@{processor_fingerprint(model_dir)}"  # the model id the item keys carry
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # the model's token ids (its logits' width); None = not checked
        self.limits = limits or LimitsConfig()
        self.max_prompt_chars = self.limits.max_prompt_chars or 32 * max_model_len
        self.block_hashes = block_hashes  # the decoder's prefix-cache hashing, when it caches prefixes
        self._lock = threading.Lock()  # counters and the (Rust) tokenizer, which is not re-entrant
        self._flights: SingleFlight[str, tuple[tuple[str, CachedItem], bool]] = SingleFlight(FLIGHT_WAIT_S)
        self._slots = image_slots  # images worked on at once in this process; None = as many as the callers
        self._fetching = fetch_slots  # requests fetching images at once in this process; None = as many
        self._image_processor_calls = 0

    def slots(self) -> dict[str, int | None]:
        """How many images it works on at once, and how many requests may fetch images at once (None: no bound)."""
        return {"image": self._slots.slots if self._slots else None,
                "fetch": self._fetching.slots if self._fetching else None}

    @property
    def image_processor_calls(self) -> int:
        """HF image-processor invocations so far (one per processed image)."""
        with self._lock:
            return self._image_processor_calls

    def process(self, req: ChatRequest, cancelled: Callable[[], bool] = lambda: False) -> PreprocessedRequest:
        """NOTE: `cancelled()` (its caller left) is asked before each image's work: a thread cannot be stopped,
        so the work stops there, raising concurrent.futures.CancelledError."""
        timeline = Timeline()
        req.sampling.validate()
        check_strings(req.sampling.stop, self.limits)
        check_strings(req.sampling.bad_words, self.limits, "bad_words")
        check_token_ids(req.sampling, self.vocab_size)
        sampling = self._with_bad_words(req.sampling)
        parsed = parse_messages(req.messages, reserved=self.rule.reserved_strings,
                                max_parts=self.limits.max_message_parts)
        n_items = len(parsed.image_urls)
        if n_items > self.media.max_images_per_prompt:
            raise TooManyItemsError(f"{n_items} images in one prompt; the limit is "
                                    f"{self.media.max_images_per_prompt}")
        kwargs = self.rule.resolve_kwargs(self._processor_kwargs(req))
        text = self._render(parsed, n_items, req.template)
        if len(text) > self.max_prompt_chars:
            raise PromptTooLongError(f"the prompt is {len(text)} characters; the limit is {self.max_prompt_chars}",
                                     param="messages")
        # Without crops the prompt is shortest: refuse a too-long one before fetching any image.
        ids = self._tokenize(self.rule.expand(text, [0] * n_items))
        room = req.sampling.max_tokens if req.max_tokens_asked else 1  # output tokens the context must hold
        self._check_length(ids, room, req.max_tokens_asked)
        timeline.mark("preprocess.prompt")  # rendered, tokenized, checked
        items, hits = self._load_items(parsed.image_urls, kwargs, req.cache_salt, timeline, cancelled)
        crops = [item.num_tiles - 1 for _, item in items]
        if any(crops):
            ids = self._tokenize(self.rule.expand(text, crops))
            self._check_length(ids, room, req.max_tokens_asked)
        features = self._features(ids, items, crops)
        hashes = self.block_hashes(ids, features, req.cache_salt) if self.block_hashes is not None else ()
        timeline.mark("preprocess.features")
        return PreprocessedRequest(request_id=req.request_id, prompt_token_ids=ids, features=features,
                                   sampling=sampling, processor_cache_hits=hits, cache_salt=req.cache_salt,
                                   block_hashes=hashes, timings=timeline.phases)

    # --- steps -------------------------------------------------------------------------------

    def _processor_kwargs(self, req: ChatRequest) -> dict[str, Any]:
        """`mm_processor_kwargs`, with the image processor's keys sent in `chat_template_kwargs` that the template
        does not read (transformers' `apply_chat_template` passes such keys on to the processor, and a client of
        `transformers serve` sends `do_pan_and_scan` there); `mm_processor_kwargs` wins where both set one.

        NOTE: vLLM drops them; dropped, they gave a client who asked for crops none and no error."""
        if not isinstance(req.mm_processor_kwargs, dict):
            raise InvalidRequestError("mm_processor_kwargs must be an object")
        given = req.template.kwargs if isinstance(req.template.kwargs, dict) else {}
        passed = {k: v for k, v in given.items() if k in self._processor_keys and k not in self.template.variables}
        return {**passed, **req.mm_processor_kwargs}

    def _with_bad_words(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with its bad words spelled in tokens, as vLLM does: each word as written (leading spaces
        stripped), and with one leading space where that spells it with other tokens of the same count."""
        if not sampling.bad_words or sampling.bad_words_token_ids:
            return sampling
        spelled: list[tuple[int, ...]] = []
        for word in sampling.bad_words:
            _check_unicode(word, "bad_words")
            plain = tuple(self._tokenize(word.lstrip()))
            spaced = tuple(self._tokenize(" " + word.lstrip()))
            spelled.append(plain)
            if spaced[:1] != plain[:1] and len(spaced) == len(plain):
                spelled.append(spaced)
        return replace(sampling, bad_words_token_ids=tuple(spelled))

    def _render(self, parsed: ParsedMessages, n_items: int, options: TemplateOptions) -> str:
        text = self.template.render(parsed, options)
        placed = text.count(self.rule.placeholder)
        if placed != n_items:  # e.g. an image in a message the template drops
            raise InvalidRequestError(f"the chat template placed {placed} image placeholders "
                                      f"for {n_items} images")
        _check_unicode(text, "messages")
        return text

    def _tokenize(self, text: str) -> list[int]:
        # NOTE: no special tokens: a chat template writes its own (Gemma's <bos>), the rule of transformers'
        # apply_chat_template and vLLM's chat default (add_special_tokens false)
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_length(self, ids: list[int], room: int, field: str | None) -> None:
        """The prompt and `room` output tokens (asked for with `field`, else 1) must fit the context."""
        if len(ids) + room <= self.max_model_len:
            return
        if room == 1:
            raise PromptTooLongError(f"the prompt is {len(ids)} tokens (images expanded); with at least "
                                     f"one output token it exceeds max_model_len {self.max_model_len}",
                                     param="messages")
        if room >= self.max_model_len:
            raise PromptTooLongError(f"{field} is {room}; the context is {self.max_model_len} tokens "
                                     "(max_model_len), the prompt included", param=field)
        raise PromptTooLongError(f"the context is {self.max_model_len} tokens (max_model_len), and {len(ids) + room} "
                                 f"were asked for: {len(ids)} in the prompt (images expanded) and {room} for the "
                                 f"output ({field}); shorten the messages or lower {field}", param="messages")

    def _load_items(self, urls: list[str], kwargs: dict[str, Any], salt: str | None, timeline: Timeline,
                    cancelled: Callable[[], bool]) -> tuple[list[tuple[str, CachedItem]], int]:
        """(content hash, item) per image in prompt order, and how many the ProcessorCache served; each image's
        phases marked on `timeline` (`preprocess.image_*`). Both keys carry the request's cache `salt`."""
        items: list[tuple[str, CachedItem]] = []
        local: dict[str, tuple[str, CachedItem]] = {}  # repeats inside one request, even with the cache off
        hits = 0
        fetching = self._fetching is not None and any(fetched(url) for url in urls)
        with held(self._fetching if fetching else None, cancelled):  # NOTE: its reads and their bytes, until done
            for index, data in enumerate(self.loader.read_all(urls, cancelled), start=1):
                if cancelled():  # NOTE: asked once an image is read, before its work; leaving ends the other reads
                    raise CancelledError(f"the caller left before image {index} was processed")
                source = hash_source(data, model_id=self._keys_model, kwargs=kwargs, salt=salt)
                timeline.mark("preprocess.image_read")  # its bytes fetched or read from the URL, and hashed
                # NOTE: requests that bring the same new image at once process it once: the others wait for it,
                # holding no slot (the one processing it holds one)
                (local[source], hit), shared = self._flights.run(source, functools.partial(
                    self._held_item, cancelled, data, index, source, kwargs, salt, local.get(source), timeline),
                    cancelled)
                if shared:
                    timeline.mark("preprocess.image_lookup")  # the wait for another request's processing of it
                hits += hit or shared
                items.append(local[source])
        return items, hits

    def _held_item(self, cancelled: Callable[[], bool], *args: Any) -> tuple[tuple[str, CachedItem], bool]:
        """`_item(*args)` holding an image slot (a wait for one ends when `cancelled()`)."""
        with held(self._slots, cancelled):
            return self._item(*args)

    def _item(self, data: bytes, index: int, source: str, kwargs: dict[str, Any], salt: str | None,
              earlier: tuple[str, CachedItem] | None, timeline: Timeline) -> tuple[tuple[str, CachedItem], bool]:
        """One image's (content hash, item) and whether the cache had it: by its bytes (never decoded
        then), else the same bytes `earlier` in the request, else by its pixels, else processed and stored.

        NOTE: while a lookup travels (the shared store's hop) the work it may spare runs meanwhile: the
        decode beside the lookup by bytes, the processor beside the lookup by pixels. The processor's run is
        wasted only when other bytes of the same pixels were processed elsewhere (a PNG, then its WebP);
        a lookup answered at once (this process's cache, a replica's own items) spares it.
        """
        # NOTE: each phase is marked where its work ran: a work item may run beside a lookup or after it
        by_source = self.cache.find_source(source)
        image = None if by_source.done() or earlier else self._decode(data, index, timeline)
        found = by_source.result()
        timeline.mark("preprocess.image_lookup")  # (what is left of) the wait for a lookup's answer
        if found is not None:
            return found, True
        if earlier is not None:
            return earlier, False
        if image is None:
            image = self._decode(data, index, timeline)
        key = hash_image(image, model_id=self._keys_model, kwargs=kwargs, salt=salt)
        timeline.mark("preprocess.image_hash")
        by_key = self.cache.find(key, source)
        processed = None if by_key.done() else self._process(image, kwargs, timeline)
        item = by_key.result()
        timeline.mark("preprocess.image_lookup")
        if item is not None:
            return (key, item), True
        if processed is None:
            processed = self._process(image, kwargs, timeline)
        stored = self.cache.store(key, processed, source)
        timeline.mark("preprocess.image_store")  # kept in the cache (the object store's put in the Ray app)
        return (key, stored), False

    def _decode(self, data: bytes, index: int, timeline: Timeline) -> Image.Image:
        image = self.loader.decode(data, index)
        timeline.mark("preprocess.image_decode")
        return image

    def _process(self, image: Image.Image, kwargs: dict[str, Any], timeline: Timeline) -> ProcessedItem:
        processed = self._run_image_processor(image, kwargs)
        timeline.mark("preprocess.image_process")
        return processed

    def _run_image_processor(self, image: Image.Image, kwargs: dict[str, Any]) -> ProcessedItem:
        # NOTE: every output-changing kwarg is passed explicitly, so neither the processor's class
        # defaults nor the saved config can silently disagree with the hash.
        # NOTE: rescale and normalize are left to the encoder (mmserve/models/pixels.py): items stay uint8.
        out = self.image_processor([image], return_tensors="np", **kwargs, **DEFER_TO_ENCODER)
        with self._lock:
            self._image_processor_calls += 1
        pixels = as_uint8(self.rule.tiles(out))  # (1 + n_crops, 3, H, W)
        pixels.flags.writeable = False  # NOTE: shared through the cache; nobody may edit it in place
        return ProcessedItem(pixel_values=pixels)

    def _features(self, ids: list[int], items: list[tuple[str, CachedItem]],
                  crops: list[int]) -> list[MultiModalFeatureSpec]:
        runs = image_token_runs(ids, self.image_token_id)  # one run per image or crop
        if len(runs) != sum(c + 1 for c in crops) or any(e - s != self.rule.mm_tokens for s, e in runs):
            raise RuntimeError(f"found image-token runs {[e - s for s, e in runs]} for crops {crops}")
        features, k = [], 0
        for (key, item), n_crops in zip(items, crops, strict=True):
            mine = runs[k : k + n_crops + 1]
            k += n_crops + 1
            start, end = mine[0][0], mine[-1][1]
            features.append(MultiModalFeatureSpec(
                identifier=key, modality="image", placeholder=PlaceholderRange(start, end - start),
                num_embeds=sum(e - s for s, e in mine), data=item))
        return features


def _check_unicode(text: str, param: str) -> None:
    """Refuse text the tokenizer cannot take. NOTE: JSON's \\ud800 escape decodes to a lone surrogate, which is
    no character (the HTTP edge refuses such a body first; this guards the in-process Engine)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(f"{param}: the text is not valid Unicode ({err.reason} at character "
                                  f"{err.start})", param=param) from None
