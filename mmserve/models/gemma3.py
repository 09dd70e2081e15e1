"""Gemma 3, as data and parts: what the rest of mmserve may know about it.

Owns: reading a local Gemma 3 checkpoint folder (config, generation config, safetensors through
transformers), Gemma 3's `ModelSpec` (image token, attention pattern, stop tokens), its vision
encoder (SigLIP + AvgPool -> RMSNorm -> Linear projector) and its text decoder over our KV cache.
Does not own: prompt placeholder expansion (`gemma3_prompt.py`), batching or caching.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from mmserve.config import EngineConfig
from mmserve.models.base import FULL, SLIDING, AttentionPattern, ModelSpec, VisionEncoder, checkpoint_name
from mmserve.models.gemma3_prompt import Gemma3PromptRule
from mmserve.models.gemma3_text import Gemma3PagedText
from mmserve.models.generation_defaults import sampling_defaults
from mmserve.models.pixels import PixelNormalization
from mmserve.models.weights_id import safetensors_files, weights_fingerprint
from mmserve.runtime.matmul_forms import pack_linears

log = logging.getLogger(__name__)


def _eos_ids(model_dir: Path, config: Any) -> tuple[int, ...]:
    """Every stop token the checkpoint names: generation_config.json's, config.json's own (google's Gemma 3
    releases list `[1, 106]` there: `<eos>` and `<end_of_turn>`) and the text config's."""
    ids: list[int] = []
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        ids += _as_list(json.loads(gen_path.read_text()).get("eos_token_id"))
    ids += _as_list(json.loads((model_dir / "config.json").read_text()).get("eos_token_id"))
    ids += _as_list(config.text_config.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _as_list(ids: int | list[int] | None) -> list[int]:
    return ids if isinstance(ids, list) else [ids] if ids is not None else []


# The text model's tensors in every checkpoint layout (google's, older transformers', current): all but these are the
# vision tower's and projector's (Gemma3VisionParts skips these when it reads the vision parts alone)
TEXT_WEIGHTS = re.compile(r"(^|\.)(language_model|lm_head)\.")
# dtypes Gemma 3 is not served in -> why (EngineConfig.dtype)
REFUSED_DTYPES = {"float16": "Gemma 3's activations overflow float16 (use bfloat16)"}

# Text-config values the paged model's arithmetic assumes (every Gemma 3 release has them): a checkpoint that
# sets another is refused at load rather than served with arithmetic that is not its own.
SERVED_TEXT_CONFIG: dict[str, tuple[Any, ...]] = {
    "hidden_activation": ("gelu_pytorch_tanh",),  # the MLP's tanh-approximated GELU
    "use_bidirectional_attention": (False, None),  # causal text attention (images both ways, as Gemma 3's prefill)
}


# RoPE types whose frequencies are fixed by the config (the paged model keeps one table of every position);
# `dynamic` and `longrope` change them with each call's longest position, which a shared table cannot follow.
SERVED_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def gemma3_spec(model_dir: Path, config: Any, engine: EngineConfig) -> ModelSpec:
    text = config.text_config
    for key, served in SERVED_TEXT_CONFIG.items():
        value = getattr(text, key, served[0])
        if value not in served:
            raise ValueError(f"{model_dir}: text_config.{key} is {value!r}; mmserve serves Gemma 3 with "
                             f"{' or '.join(map(repr, served))} only")
    _check_rope(model_dir, text)
    _check_unquantized(model_dir, config)
    kinds = tuple(text.layer_types)
    assert set(kinds) <= {FULL, SLIDING}, f"unknown Gemma 3 layer types {set(kinds)}"
    return ModelSpec(
        family="gemma3",
        model_id=engine.served_name or checkpoint_name(model_dir),
        image_token_id=int(config.image_token_id),
        mm_tokens_per_image=int(config.mm_tokens_per_image),
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        num_layers=int(text.num_hidden_layers),
        num_kv_heads=int(text.num_key_value_heads),
        head_dim=int(text.head_dim),
        max_model_len=_max_model_len(model_dir, text, engine),
        eos_token_ids=_eos_ids(model_dir, config),
        attention=AttentionPattern(
            layer_kinds=kinds,
            sliding_window=int(text.sliding_window) if SLIDING in kinds else None,
            bidirectional_images=True,  # Gemma 3 prefill: an image's tokens see each other both ways
            scaling=float(text.query_pre_attn_scalar) ** -0.5,
            # NOTE: transformers' Gemma 3 attention never caps its logits, whatever attn_logit_softcapping says
            softcap=None,
        ),
        never_sampled=(int(config.image_token_id),),  # an image row only exists inside a placeholder
        image_size=int(config.vision_config.image_size),
        sampling_defaults=sampling_defaults(model_dir, enabled=engine.sampling_defaults_from_checkpoint),
    )


def _max_model_len(model_dir: Path, text: Any, engine: EngineConfig) -> int:
    """The engine's bound on a sequence (tokens), the checkpoint's own by default; refused past it: positions
    beyond `max_position_embeddings` were never trained (vLLM refuses them too)."""
    positions = int(text.max_position_embeddings)
    if engine.max_model_len is not None and engine.max_model_len > positions:
        raise ValueError(f"max_model_len={engine.max_model_len} is past {model_dir}'s max_position_embeddings "
                         f"({positions})")
    return engine.max_model_len or positions


def _check_rope(model_dir: Path, text: Any) -> None:
    """Refuse a RoPE type whose frequencies follow the sequence's length (SERVED_ROPE_TYPES)."""
    params = getattr(text, "rope_parameters", None) or {}
    # NOTE: the rotary reads the set of each layer type where there is one, whatever stands beside them
    by_kind = {kind: rope for kind, rope in params.items() if isinstance(rope, dict)} or {"every layer": params}
    for kind, rope in by_kind.items():
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SERVED_ROPE_TYPES:
            raise ValueError(f"{model_dir}: text_config.rope_parameters[{kind!r}] has rope_type {rope_type!r}; "
                             f"mmserve serves Gemma 3 with {', '.join(SERVED_ROPE_TYPES)} only")


def _check_unquantized(model_dir: Path, config: Any) -> None:
    """Refuse a quantized checkpoint before its weights load: the paged model multiplies plain weight tensors."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        raise ValueError(f"{model_dir} is quantized (quantization_config, quant_method {method!r}); mmserve serves "
                         "unquantized weights only (Gemma 3's bfloat16 release)")


def served_dtype(name: str, config: Any, model_dir: Path | None = None) -> torch.dtype:
    """EngineConfig.dtype's `name` as a torch dtype: "auto" is the checkpoint's own (`saved_dtype`); raises
    ValueError for one the model refuses."""
    dtype = saved_dtype(config, model_dir) if name == "auto" else getattr(torch, name)
    why = REFUSED_DTYPES.get(str(dtype).removeprefix("torch."))
    if why:
        raise ValueError(f"dtype {str(dtype).removeprefix('torch.')} is not served: {why}")
    return dtype


def saved_dtype(config: Any, model_dir: Path | None = None) -> torch.dtype:
    """The checkpoint's own dtype: its config's, else its weights' (as transformers reads it), else float32."""
    dtype = config.dtype or (model_dir and weights_dtype(model_dir))
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype or "float32")


def weights_dtype(model_dir: Path) -> torch.dtype | None:
    """The dtype of the checkpoint's first floating tensor (its first shard's), None if it has none."""
    from safetensors import safe_open

    files = safetensors_files(model_dir)
    if not files or not files[0].exists():
        return None
    with safe_open(str(files[0]), "pt") as weights:
        for name in weights.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
            dtype = getattr(torch, _SAFETENSORS_DTYPES.get(weights.get_slice(name).get_dtype(), "int64"))
            if dtype.is_floating_point:
                return dtype
    return None


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class Gemma3Family:
    """A Gemma 3 checkpoint folder: its spec, prompt rule and loadable parts."""

    def __init__(self, model_dir: Path, config: EngineConfig):
        self.engine_config = config
        self.model_dir = model_dir
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.spec = gemma3_spec(self.model_dir, self.hf_config, config)
        self.prompt_rule = Gemma3PromptRule.from_checkpoint(self.model_dir, self.spec.mm_tokens_per_image)
        self.dtype: torch.dtype = served_dtype(config.dtype, self.hf_config, model_dir)
        # NOTE: the checkpoint's own, which may be one the model refuses (float16) and another dtype serves
        own = saved_dtype(self.hf_config, model_dir) if config.device != "cpu" else self.dtype
        if self.dtype.itemsize > own.itemsize:
            served_as_saved = str(own).removeprefix("torch.") not in REFUSED_DTYPES
            log.warning("serving %s's %s weights in %s on %s: %dx their memory; %s", model_dir.name, own, self.dtype,
                        config.device, self.dtype.itemsize // own.itemsize,
                        "dtype=auto serves them as saved" if served_as_saved else "dtype=bfloat16 serves them in half")
        self._hf_model: Any = None

    def _load(self) -> Any:
        # NOTE: the whole checkpoint, read once (transformers maps every checkpoint layout, e.g. the original
        # google/gemma-3-* key names) for the text model and, beside it, the vision parts; an Encoder alone reads
        # the vision parts only (`_load_vision`).
        if self._hf_model is None:
            from transformers import Gemma3ForConditionalGeneration

            self._hf_model = Gemma3ForConditionalGeneration.from_pretrained(
                self.model_dir, dtype=self.dtype
            ).eval()
        return self._hf_model

    def _load_vision(self, alone: bool) -> Any:
        """The vision tower and projector (under `.model`): read alone when no text model is loaded beside them
        (an Encoder replica reads no text weight), else the whole model's (an in-process Engine reads it once)."""
        if not alone or self._hf_model is not None:
            return self._load()
        from mmserve.models.gemma3_vision_parts import Gemma3VisionParts

        return Gemma3VisionParts.from_pretrained(self.model_dir, dtype=self.dtype).eval()

    def load_vision(self, *, alone: bool = False) -> VisionEncoder:
        inner = self._load_vision(alone).model
        device = torch.device(self.engine_config.device)
        tower = inner.vision_tower.to(device)
        projector = inner.multi_modal_projector.to(device)
        vision = self.hf_config.vision_config
        if device.type == "cpu" and self.engine_config.encoder.measure_matmul_forms:
            pack_linears(tower, rows=(vision.image_size // vision.patch_size) ** 2)  # one image's patch rows
        normalize, dtype = PixelNormalization.from_checkpoint(self.model_dir), self.dtype

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            # (n_images, 3, H, W) uint8 -> (n_images, mm_tokens, text_hidden)
            pixel_values = normalize(pixels).to(dtype)  # (n_images, 3, H, W), what HF's processor gives
            hidden = tower(pixel_values=pixel_values).last_hidden_state  # (n_images, patches, vision_hidden)
            return projector(hidden)

        return encode

    def load_text(self) -> Gemma3PagedText:
        hf = self._load()
        device = torch.device(self.engine_config.device)
        language_model = hf.model.language_model
        for name, part in language_model.named_children():
            if name != "layers":
                part.to(device)
        hf.lm_head.to(device)  # NOTE: tied to the embeddings: moved in place, it stays the same parameter
        return Gemma3PagedText(language_model, hf.lm_head, self.spec.attention,
                               layers=one_at_a_time(language_model.layers, device))

    def vision_weights_id(self) -> str:
        return weights_fingerprint(self.model_dir, lambda name: TEXT_WEIGHTS.search(name) is None)

    def release_unused(self) -> None:
        """Drop the reference to the whole HF model; parts handed out stay alive."""
        self._hf_model = None


def one_at_a_time(layers: torch.nn.ModuleList, device: torch.device) -> Iterator[Any]:
    """Each of transformers' decoder `layers` moved to `device` as it is asked for, and dropped from the list
    when the next one is.

    NOTE: the paged model stacks each layer's q/k/v and gate/up weights into copies of its own: so loading
    holds at most two of transformers' layers on the device beside the paged ones (the one being re-laid and
    the next, moved while the caller still holds the last), not a second copy of them all (~1.8x the text
    weights at the peak), and the KV cache allocated next has that room.
    """
    for i in range(len(layers)):
        yield layers[i].to(device)
        layers[i] = torch.nn.Identity()
