"""The preprocess stage: a ChatRequest -> prompt token ids + one FeatureSpec per image.

Owns: validating the request's shape (roles, content parts, item count, mm kwargs), rendering the
chat template, loading/hashing/processing each image through the ProcessorCache, expanding the
placeholders with the model's prompt rule, tokenizing, and locating each item's placeholder range.
Does not own: fetching and decoding bytes (media.py), the hash (hashing.py), the LRU
(processor_cache.py), the model's own token rule (models/gemma3_prompt.py), nor encoding.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from PIL import Image

from mmserve.config import EngineConfig, MediaConfig
from mmserve.errors import InvalidRequestError, PromptTooLongError, TooManyItemsError
from mmserve.hashing import hash_image
from mmserve.image_runs import image_token_runs
from mmserve.media import MediaLoader
from mmserve.messages import (
    ChatRequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    PreprocessedRequest,
    ProcessedItem,
)
from mmserve.models.gemma3_prompt import Gemma3PromptRule
from mmserve.models.pixels import DEFER_TO_ENCODER, as_uint8
from mmserve.processor_cache import CachedItem, ItemCache, ProcessorCache

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ParsedMessages:
    template_messages: list[dict[str, Any]]  # what the chat template reads; images as {"type": "image"}
    image_urls: list[str]  # in prompt order


class Preprocessor:
    """Turns requests into token ids and processed items; thread-safe."""

    def __init__(self, model_dir: str | Path, *, media: MediaConfig, cache: ItemCache, model_id: str,
                 max_model_len: int, rule: Gemma3PromptRule | None = None,
                 loader: MediaLoader | None = None) -> None:
        from transformers import AutoProcessor  # NOTE: deferred; importing transformers takes ~2 s

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.tokenizer = self.processor.tokenizer  # the decoder's detokenizer uses this one too
        self.image_processor = self.processor.image_processor
        self.rule = rule or Gemma3PromptRule.from_processor(self.processor)
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.rule.image_token))
        self.media = media
        self.loader = loader or MediaLoader(media)
        self.cache = cache
        self.model_id = model_id
        self.max_model_len = max_model_len
        self._lock = threading.Lock()  # counters and the (Rust) tokenizer, which is not re-entrant
        self._image_processor_calls = 0

    @classmethod
    def from_config(cls, config: EngineConfig, cache: ProcessorCache | None = None) -> Preprocessor:
        model = config.model
        model_dir = Path(model.model_dir)
        max_len = model.max_model_len or _max_positions(model_dir)
        return cls(model_dir, media=config.media,
                   cache=cache or ProcessorCache.from_config(config.processor_cache),
                   model_id=model.served_name or model_dir.name, max_model_len=max_len)

    @property
    def image_processor_calls(self) -> int:
        """HF image-processor invocations so far (one per processed image)."""
        with self._lock:
            return self._image_processor_calls

    def process(self, req: ChatRequest) -> PreprocessedRequest:
        req.sampling.validate()
        parsed = parse_messages(req.messages, reserved=self.rule.reserved_strings)
        n_items = len(parsed.image_urls)
        if n_items > self.media.max_images_per_prompt:
            raise TooManyItemsError(f"{n_items} images in one prompt; the limit is "
                                    f"{self.media.max_images_per_prompt}")
        if not isinstance(req.mm_processor_kwargs, dict):
            raise InvalidRequestError("mm_processor_kwargs must be an object")
        kwargs = self.rule.resolve_kwargs(req.mm_processor_kwargs)
        text = self._render(parsed, n_items)
        # Without crops the prompt is shortest: refuse a too-long one before fetching any image.
        ids = self._tokenize(self.rule.expand(text, [0] * n_items))
        self._check_length(ids)
        items, hits = self._load_items(parsed.image_urls, kwargs)
        crops = [item.num_tiles - 1 for _, item in items]
        if any(crops):
            ids = self._tokenize(self.rule.expand(text, crops))
            self._check_length(ids)
        features = self._features(ids, items, crops)
        return PreprocessedRequest(request_id=req.request_id, prompt_token_ids=ids, features=features,
                                   sampling=req.sampling, processor_cache_hits=hits)

    # --- steps -------------------------------------------------------------------------------

    def _render(self, parsed: ParsedMessages, n_items: int) -> str:
        try:
            text = self.processor.apply_chat_template(parsed.template_messages, tokenize=False,
                                                      add_generation_prompt=True)
        except jinja2.TemplateError as err:
            raise InvalidRequestError(f"messages rejected by the chat template: {err}") from err
        placed = text.count(self.rule.placeholder)
        if placed != n_items:  # e.g. an image in a message the template drops
            raise InvalidRequestError(f"the chat template placed {placed} image placeholders "
                                      f"for {n_items} images")
        return text

    def _tokenize(self, text: str) -> list[int]:
        with self._lock:  # NOTE: the template already starts with <bos>; add no special tokens
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_length(self, ids: list[int]) -> None:
        if len(ids) + 1 > self.max_model_len:
            raise PromptTooLongError(f"the prompt is {len(ids)} tokens (images expanded); with at least "
                                     f"one output token it exceeds max_model_len {self.max_model_len}")

    def _load_items(self, urls: list[str], kwargs: dict[str, Any]) -> tuple[list[tuple[str, CachedItem]], int]:
        """(hash, item) per image in prompt order, and how many the ProcessorCache served."""
        items: list[tuple[str, CachedItem]] = []
        local: dict[str, CachedItem] = {}  # repeats inside one request, even with the cache off
        hits = 0
        for index, url in enumerate(urls, start=1):
            image = self.loader.load(url, index=index)
            key = hash_image(image, model_id=self.model_id, kwargs=kwargs)
            item = self.cache.get(key)
            if item is not None:
                hits += 1
            elif key in local:
                item = local[key]
            else:
                item = self.cache.store(key, self._run_image_processor(image, kwargs))
            local[key] = item
            items.append((key, item))
        return items, hits

    def _run_image_processor(self, image: Image.Image, kwargs: dict[str, Any]) -> ProcessedItem:
        # NOTE: every output-changing kwarg is passed explicitly, so neither Gemma3Processor's class
        # defaults nor the saved config can silently disagree with the hash.
        # NOTE: rescale and normalize are left to the encoder (mmserve/models/pixels.py): items stay uint8.
        out = self.image_processor([image], return_tensors="np", **kwargs, **DEFER_TO_ENCODER)
        with self._lock:
            self._image_processor_calls += 1
        pixels = as_uint8(out["pixel_values"])  # (1 + n_crops, 3, H, W)
        if pixels.shape[0] != 1 + int(out["num_crops"][0]):
            raise RuntimeError(f"image processor returned {pixels.shape[0]} tiles for "
                               f"{int(out['num_crops'][0])} crops")
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


def _max_positions(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("text_config", config)["max_position_embeddings"])


# --- message validation ---------------------------------------------------------------------


def parse_messages(messages: Any, *, reserved: tuple[str, ...]) -> ParsedMessages:
    """Check the OpenAI message shape and collect image URLs; nothing is fetched here."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    urls: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        content = _parse_content(message.get("content"), where, reserved, urls)
        if role == "system":
            content = _system_text(content, where)
        out.append({"role": role, "content": content})
    return ParsedMessages(out, urls)


def _parse_content(content: Any, where: str, reserved: tuple[str, ...],
                   urls: list[str]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        _check_text(content, f"{where}.content", reserved)
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{at}.text must be a string")
            _check_text(text, f"{at}.text", reserved)
            parts.append({"type": "text", "text": text})
        elif kind == "image_url":
            urls.append(_image_url(part.get("image_url"), at))
            parts.append({"type": "image"})
        else:
            raise InvalidRequestError(f"{at} has unsupported part type {kind!r}; "
                                      "supported: 'text', 'image_url'")
    return parts


def _image_url(value: Any, at: str) -> str:
    url = value.get("url") if isinstance(value, dict) else value  # NOTE: a bare string is accepted
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{at}.image_url.url must be a non-empty string")
    return url


def _check_text(text: str, at: str, reserved: tuple[str, ...]) -> None:
    for token in reserved:
        if token in text:
            raise InvalidRequestError(f"{at} contains the reserved image token {token!r}")


def _system_text(content: str | list[dict[str, Any]], where: str) -> str:
    """NOTE: Gemma's template reads only a system message's first part; we join all text parts."""
    if isinstance(content, str):
        return content
    if any(p["type"] != "text" for p in content):
        raise InvalidRequestError(f"{where}: a system message may contain text only")
    return "\n".join(p["text"] for p in content)
