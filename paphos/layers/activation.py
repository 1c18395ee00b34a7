"""Gated activations applied to the output of a merged gate_up projection (model MLP -> here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers import fused
from paphos.layers.x_int8_outputs import Int8Outputs


class SiluAndMul(nn.Module):
    """x = [gate | up] on the last axis -> silu(gate) * up (SwiGLU, Llama-family MLPs)."""

    def __init__(self) -> None:
        super().__init__()
        # Set after loading (x_int8_outputs.feed), as RMSNorm's: the down projection's int8 layouts.
        self.int8_outputs: Int8Outputs | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.available(x):
            return fused.silu_and_mul(x, self.int8_outputs)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """x = [gate | up] on the last axis -> gelu_tanh(gate) * up (GeGLU with HF's
    `gelu_pytorch_tanh`, Gemma MLPs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
