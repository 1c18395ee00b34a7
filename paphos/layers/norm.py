"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer, and
Gemma's (1 + w) variant.

Data flow: model decoder layer -> norm. Arithmetic follows HF Llama exactly (residual add in the
model dtype, normalisation in fp32, cast back, then scale by the weight in the model dtype), so
bf16 logits match HF, not just fp32 ones; `GemmaRMSNorm` follows HF Gemma 3 the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from paphos.layers import fused
from paphos.layers.weights import default_weight_loader
from paphos.layers.x_int8_outputs import Int8Outputs


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        # Set after loading (x_int8_outputs.feed): the layouts in which the next layer's batch-1
        # GEMV and its int8 tensor-core GEMM of a few tokens read int8 parts of this norm's
        # output, which the fused kernel then writes too.
        self.int8_outputs: Int8Outputs | None = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: s = x + residual; returns (norm(s), s), s
        being the residual stream the next block adds into. x is [T, H], or [T, heads, head_dim]
        for a norm over each head (Qwen3's q and k)."""
        if fused.available(x):
            out, summed = fused.add_rmsnorm(x, residual, self.weight, self.eps, self.int8_outputs)
            return out if summed is None else (out, summed)
        if residual is None:
            return self._norm(x)
        s = x + residual
        return self._norm(s), s

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), all in fp32, cast back at the end (HF Gemma3RMSNorm;
    unlike Llama, the scale is applied before the cast). The weight is zero-centred as in HF
    checkpoints; the GGUF loader undoes llama.cpp's stored 1 + w. Models add the residual
    themselves (Gemma normalises after attention and MLP too)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.zeros(hidden_size, dtype=params_dtype or torch.get_default_dtype()), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
