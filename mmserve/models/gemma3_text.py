"""Gemma 3's text decoder run over our paged KV cache.

Owns: the per-layer forward of Gemma 3 (sandwich RMSNorms, q/k norms, two RoPE bases chosen by
layer kind, GeGLU MLP) on flat varlen tokens. The weights are transformers' own modules
(`Gemma3TextModel` + `lm_head`); only attention goes through `mmserve.decoder.attention`.
Does not own: batching, masks, KV memory, sampling.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmserve.decoder.attention import AttentionMetadata, paged_attention
from mmserve.decoder.kv_cache import KVCache
from mmserve.models.base import AttentionPattern


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (T, heads, head_dim); cos/sin (T, head_dim)
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Gemma3PagedText(nn.Module):
    def __init__(self, text_model: nn.Module, lm_head: nn.Module, pattern: AttentionPattern):
        super().__init__()
        self.text: Any = text_model  # transformers Gemma3TextModel (embed_tokens, layers, norm, rotary_emb)
        self.lm_head: Any = lm_head
        self.pattern = pattern
        cfg: Any = text_model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, hidden), scaled by sqrt(hidden) inside the embedding module."""
        return self.text.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) final hidden states -> (n, vocab) float32 logits."""
        # NOTE: Gemma3ForConditionalGeneration applies no final soft-capping; neither do we.
        return self.lm_head(hidden).float()

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache
    ) -> torch.Tensor:
        """(T, hidden) input embeddings at (T,) positions -> (T, hidden) final-normed hidden states."""
        h = embeds
        rope = {
            kind: self.text.rotary_emb(h[None], positions[None], kind)  # each (1, T, head_dim)
            for kind in set(self.pattern.layer_kinds)
        }
        for i, layer in enumerate(self.text.layers):
            kind = self.pattern.layer_kinds[i]
            cos, sin = rope[kind]
            h = self._layer(layer, h, cos[0], sin[0], meta, kv.layer(i), kind)
        return self.text.norm(h)

    def _layer(self, layer, h, cos, sin, meta, cache, kind) -> torch.Tensor:
        residual = h
        x = layer.input_layernorm(h)
        attn_out = self._attention(layer.self_attn, x, cos, sin, meta, cache, kind)
        h = residual + layer.post_attention_layernorm(attn_out)
        residual = h
        x = layer.mlp(layer.pre_feedforward_layernorm(h))
        return residual + layer.post_feedforward_layernorm(x)

    def _attention(self, attn, x, cos, sin, meta, cache, kind) -> torch.Tensor:
        t = x.shape[0]
        q = attn.q_norm(attn.q_proj(x).view(t, self.num_heads, self.head_dim))  # (T, heads, head_dim)
        k = attn.k_norm(attn.k_proj(x).view(t, self.num_kv_heads, self.head_dim))  # (T, kv_heads, head_dim)
        v = attn.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, cache, meta, kind, self.pattern)  # (T, heads, head_dim)
        return attn.o_proj(out.reshape(t, self.num_heads * self.head_dim))
