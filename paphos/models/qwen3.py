"""Qwen3 (dense; HF `Qwen3ForCausalLM`, GGUF architecture `qwen3`): the Llama decoder with an
RMSNorm over each head of q and of k (weights of head_dim entries, `x / rms(x) * w` as Llama's
norms) between the q/k projection and RoPE. Biases follow `attention_bias` (q/k/v and o_proj, off
in released models); `head_dim` is explicit in the config, so q_proj's width may differ from the
hidden size; sliding-window layers are read from the config as for Qwen2. Data flow as in
`llama.py`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paphos.attention.backend import AttentionBackend
from paphos.layers.linear import QuantConfig
from paphos.layers.norm import RMSNorm
from paphos.models.llama import LlamaForCausalLM, LlamaModel


class Qwen3ForCausalLM(LlamaForCausalLM):
    def build_model(
        self, config: Any, dtype: torch.dtype, attn_backend: AttentionBackend, quant_config: QuantConfig | None
    ) -> nn.Module:
        return LlamaModel(config, dtype, attn_backend, self.biases(config), quant_config, qk_norm=RMSNorm)
