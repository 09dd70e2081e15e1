"""Gemma 3's text decoder run over our paged KV cache.

Owns: the per-layer forward of Gemma 3 (sandwich RMSNorms, q/k norms, two RoPE bases chosen by layer
kind, GeGLU MLP) on flat varlen tokens, from transformers' own weights (`Gemma3TextModel` + `lm_head`)
re-laid for few kernels per step: q, k and v projected by one matrix, gate and up by one, the
RMSNorm gains stored as (1 + w), q and k normed and rotated as one tensor. Only attention goes through
`mmserve.decoder.attention`. Does not own: batching, masks, KV memory, sampling.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from mmserve.decoder.attention import AttentionMetadata, paged_attention
from mmserve.decoder.kv_cache import KVCache
from mmserve.models.base import AttentionPattern
from mmserve.models.layers import RMSNorm, RopeTable
from mmserve.runtime.matmul_forms import MatmulForms


@dataclass(frozen=True)
class _LayerWeights:
    kind: str  # the layer's attention kind: which RoPE table it uses
    input_norm: RMSNorm  # over hidden
    qkv: torch.Tensor  # ((heads + 2 kv_heads) * head_dim, hidden): q, k, v projections stacked
    qk_norm: RMSNorm  # over head_dim, gains (heads + kv_heads, head_dim): q_norm's per query head, then k_norm's
    o: torch.Tensor  # (hidden, heads * head_dim)
    post_attention_norm: RMSNorm
    pre_feedforward_norm: RMSNorm
    gate_up: torch.Tensor  # (2 * intermediate, hidden): gate then up
    down: torch.Tensor  # (hidden, intermediate)
    post_feedforward_norm: RMSNorm


def _gain(norm: Any) -> torch.Tensor:
    """Gemma3RMSNorm's multiplier (1 + weight), float32 as it computes it."""
    return 1.0 + norm.weight.detach().float()


def _layer_weights(layer: Any, kind: str, heads: int, kv_heads: int, eps: float) -> _LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(m.bias is not None for m in linears):
        raise ValueError("Gemma 3 layers have no biases; this checkpoint's do")
    q_gain, k_gain = _gain(attn.q_norm), _gain(attn.k_norm)  # each (head_dim,)
    return _LayerWeights(
        kind=kind,
        input_norm=RMSNorm(_gain(layer.input_layernorm), eps),
        qkv=torch.cat((attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)).detach(),
        qk_norm=RMSNorm(torch.cat((q_gain.expand(heads, -1), k_gain.expand(kv_heads, -1))), eps),
        o=attn.o_proj.weight.detach(),
        post_attention_norm=RMSNorm(_gain(layer.post_attention_layernorm), eps),
        pre_feedforward_norm=RMSNorm(_gain(layer.pre_feedforward_layernorm), eps),
        gate_up=torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)).detach(),
        down=mlp.down_proj.weight.detach(),
        post_feedforward_norm=RMSNorm(_gain(layer.post_feedforward_layernorm), eps),
    )


_PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's product weights, in step order


class Gemma3PagedText:
    """Gemma 3's text model over the paged cache; built on the device its HF modules are on. `layers`: the
    decoder layers to read, in order (default: `text_model.layers`; the loader hands them on one at a time)."""

    def __init__(self, text_model: Any, lm_head: Any, pattern: AttentionPattern, layers: Iterable[Any] | None = None):
        cfg = text_model.config
        self.pattern = pattern
        self.matmul = MatmulForms()  # x @ w.T in the form measured fastest here (F.linear until measured)
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self._qk_v = ((self.heads + self.kv_heads) * self.head_dim, self.kv_heads * self.head_dim)  # qkv's columns
        self._q_k = (self.heads, self.kv_heads)  # q and k's heads in the normed, rotated qk
        eps = cfg.rms_norm_eps
        self.embed_tokens = text_model.embed_tokens  # scales by sqrt(hidden) itself
        self._embedding = self.embed_tokens.weight.detach()  # (vocab, hidden)
        self._embed_scale = self.embed_tokens.embed_scale.to(self._embedding.dtype)  # () as its forward casts it
        self.lm_head = lm_head.weight.detach()  # (vocab, hidden), tied to the embeddings
        self.final_norm = RMSNorm(_gain(text_model.norm), eps)
        self.layers = [_layer_weights(layer, kind, self.heads, self.kv_heads, eps) for layer, kind in
                       zip(text_model.layers if layers is None else layers, pattern.layer_kinds, strict=True)]
        weight = self.lm_head
        rotary = text_model.rotary_emb

        def table(kind: str) -> RopeTable:
            def compute(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                probe = torch.empty(1, device=weight.device, dtype=torch.float32)
                cos, sin = rotary(probe, positions[None], kind)  # each (1, n, head_dim), float32
                return cos[0], sin[0]

            return RopeTable(compute, self.head_dim, weight.device, weight.dtype, cfg.max_position_embeddings)

        self.rope = {kind: table(kind) for kind in dict.fromkeys(pattern.layer_kinds)}

    def linear_weights(self) -> list[torch.Tensor]:
        """The (out, in) weights of the layers' products, in step order (the lm_head is the embeddings')."""
        return [getattr(layer, name) for layer in self.layers for name in _PRODUCTS]

    def relayout_weight(self, index: int) -> None:
        """Store the `index`-th of `linear_weights()` as `self.matmul.relaid` lays it out now (packed or plain;
        the tied lm_head stays as it is)."""
        layer, field = divmod(index, len(_PRODUCTS))
        w, name = self.layers[layer], _PRODUCTS[field]
        relaid: dict[str, Any] = {name: self.matmul.relaid(getattr(w, name))}
        self.layers[layer] = replace(w, **relaid)

    def pack_weights(self) -> None:
        """Store every one of `linear_weights()` as `self.matmul.relaid` lays it out now."""
        for index in range(len(self.layers) * len(_PRODUCTS)):
            self.relayout_weight(index)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, hidden), scaled by sqrt(hidden) as the embedding module does."""
        # NOTE: its forward's two kernels without nn.Module's call machinery (a step's fixed cost)
        return F.embedding(input_ids, self._embedding) * self._embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) final hidden states -> (n, vocab) float32 logits."""
        # NOTE: Gemma3ForConditionalGeneration applies no final soft-capping; neither do we.
        return self.matmul.product(hidden, self.lm_head).float()

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        """(T, hidden) input embeddings at (T,) positions -> (T, hidden) final-normed hidden states."""
        rope = {kind: table.lookup(positions, meta.max_position) for kind, table in self.rope.items()}
        h = embeds
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, rope[layer.kind], meta, kv)
        return self.final_norm(h)

    def _layer(self, index: int, w: _LayerWeights, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        t, heads, kv_heads, d, mm = h.shape[0], self.heads, self.kv_heads, self.head_dim, self.matmul.product
        # (T, (heads + kv_heads) * d), (T, kv_heads * d)
        qk, v = mm(w.input_norm(h), w.qkv).split_with_sizes(self._qk_v, dim=-1)
        qk = w.qk_norm(qk.view(t, heads + kv_heads, d))
        q, k = self.rope[w.kind].rotate(qk, *rope).split_with_sizes(self._q_k, dim=1)  # (T, heads | kv_heads, d)
        out = paged_attention(q, k, v.view(t, kv_heads, d), kv, meta, index, self.pattern)  # (T, heads * d)
        h = h + w.post_attention_norm(mm(out, w.o))
        gate, up = mm(w.pre_feedforward_norm(h), w.gate_up).chunk(2, dim=-1)
        return h + w.post_feedforward_norm(mm(F.gelu(gate, approximate="tanh") * up, w.down))
