"""Gemma 3 text decoder (HF `Gemma3ForCausalLM`, `gemma3_text`; GGUF architecture `gemma3`).

Data flow as in `llama.py`: model runner -> Gemma3ForCausalLM.forward(input_ids [T], positions
[T], kv_caches, AttentionMetadata) over one flat batch -> hidden [T, H] -> compute_logits of the
rows that sample. What differs from Llama:
- embeddings scaled by sqrt(hidden) (in the model dtype, as HF);
- GeGLU MLP (gelu tanh approximation);
- RMSNorm with (1 + w) in fp32 before and after both attention and MLP, and on q/k per head;
- layers alternate local sliding-window attention (with their own RoPE base, usually 10000) and
  global attention (5:1 from `layer_types`), scores scaled by `query_pre_attn_scalar`^-0.5;
- optional final logit soft-capping. Attention scores are not capped: Gemma 3 dropped Gemma 2's
  attention soft-capping (HF's Gemma3Attention and llama.cpp ignore `attn_logit_softcapping`);
- tied embeddings.
Checkpoint names and merged layers are the Llama family's, so weight loading is shared.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paphos.attention.backend import AttentionBackend
from paphos.attention.metadata import AttentionMetadata
from paphos.layers.linear import QuantConfig
from paphos.layers.norm import GemmaRMSNorm
from paphos.layers.rotary import RotaryEmbedding
from paphos.models import hf_config
from paphos.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, _embedding

SLIDING = "sliding_attention"


def layer_types(config: Any) -> list[str]:
    """'sliding_attention' / 'full_attention' per layer: `layer_types`, else every
    `sliding_window_pattern`-th layer global (the older config field)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", 6))
    return [SLIDING if (i + 1) % pattern else "full_attention" for i in range(config.num_hidden_layers)]


class Gemma3Attention(LlamaAttention):
    """Llama's attention with (1 + w) norms on each head of q and k, biases (if any) on o_proj too,
    and scores scaled by `query_pre_attn_scalar`^-0.5."""

    def __init__(
        self,
        config: Any,
        layer_type: str,
        dtype: torch.dtype,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantConfig | None,
        prefix: str,
    ) -> None:
        window = int(config.sliding_window) if layer_type == SLIDING else None
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(
            config, window, dtype, backend, rotary_emb, bias, bias, quant_config, prefix, qk_norm=GemmaRMSNorm
        )
        self.scale = float(getattr(config, "query_pre_attn_scalar", self.head_dim)) ** -0.5


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_type: str,
        dtype: torch.dtype,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = Gemma3Attention(
            config, layer_type, dtype, backend, rotary_emb, quant_config, f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(config, dtype, False, quant_config, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, md)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(
        self, config: Any, dtype: torch.dtype, backend: AttentionBackend, quant_config: QuantConfig | None
    ) -> None:
        super().__init__()
        head_dim = hf_config.head_dim(config)
        types = layer_types(config)
        # One RoPE table per kind of layer (local layers have their own base and no scaling).
        rotary = {}
        for kind in sorted(set(types)):
            theta, scaling, partial = hf_config.rope_parameters(config, kind)
            rotary[kind] = RotaryEmbedding(
                head_dim, config.max_position_embeddings, theta, scaling, rotary_dim=int(head_dim * partial)
            )
        self.embed_tokens = _embedding(config, dtype, quant_config)
        self.embed_scale = math.sqrt(config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, kind, dtype, backend, rotary[kind], quant_config, f"model.layers.{i}")
            for i, kind in enumerate(types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF multiplies by the scale rounded to the model dtype.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, md)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's shell (checkpoint names, merged q/k/v and gate/up, KV layout, soft-capped head)
    around the Gemma 3 decoder; Gemma ties its embeddings unless the config says otherwise."""

    tie_word_embeddings_default = True

    def build_model(
        self, config: Any, dtype: torch.dtype, attn_backend: AttentionBackend, quant_config: QuantConfig | None
    ) -> nn.Module:
        return Gemma3Model(config, dtype, attn_backend, quant_config)

    @staticmethod
    def layer_sliding_windows(config: Any) -> list[int | None]:
        return [int(config.sliding_window) if kind == SLIDING else None for kind in layer_types(config)]
