"""llama.cpp-compatible CPU numerics for GGUF checkpoints: a `QuantConfig` and its linear method.

Data flow: worker setup -> `quant_config_for_source` (GGUF source, requested mode) ->
`LlamaCppQuantConfig` -> the model asks `get_linear_method(prefix)` for each linear layer (and
for 'lm_head') -> `LlamaCppLinearMethod`: the weight is loaded dequantized to float32 as usual;
`process_weights_after_loading` reads the per-block minima it also needs from the file; `apply`
rounds the activations the way ggml-cpu does before its integer dot products
(`activations.py`) and multiplies with the float weight.

Why: llama.cpp's CPU kernels never multiply float activations with a quantized weight. Every
matmul first quantizes the activation rows to the weight type's `vec_dot_type` (Q8_0, Q8_1, Q8_K,
F16), and for Q4_1/Q5_1 adds the block minimum times a separately fp16-rounded activation block
sum. With this method each linear layer (output projection included) reproduces llama.cpp's
result on the same input up to float32 summation order (~1e-7 relative, checked against tensors
dumped from llama.cpp in tests/quant).

What it does not buy: llama.cpp's Q4_1 forward pass is chaotic at the level of summation order.
A one-ulp difference moves some activation across a rounding boundary of the next quantization
(or of the f16 attention operands), and the flips cascade: llama.cpp against itself, fed the
prompt token by token instead of in one batch (only the attention and output matmuls change
their reduction order), differs by 0.047 mean |delta logprob|, 97.2% top-1 agreement, 12 of 21
identical greedy continuations. This mode measures the same distance to llama.cpp as float32 does
(~0.06, ~96%); only outputs near the start of a sequence get closer (position 0 logits: 0.047 ->
0.012 mean |delta| with f16 attention rounding). Matching llama.cpp token for token needs kernels
that also reproduce ggml's reduction order (tests/quant/ggml_reference_ops.py specifies the elementwise side).

Scope: weights stay float32 in memory (the default GGUF mode, `GGUFLinearMethod`, keeps them
quantized; this mode is for numerics studies); the embedding lookup needs nothing (ggml's get_rows
dequantizes exactly as `gguf` does).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers.linear import LinearBase, UnquantizedLinearMethod
from paphos.loader.gguf_loader import GGUFCheckpoint, unpermute_qk
from paphos.loader.gguf_reader import GGUFTensor
from paphos.quant.gguf.activations import TYPES_WITH_BLOCK_MIN, activation_format, quantize_activations
from paphos.quant.gguf.linear import checkpoint_names

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Segment:
    """Output rows [start, end) whose weights share one activation format."""

    start: int
    end: int
    fmt: str


class LlamaCppLinearMethod:
    """y = round_fmt(x) @ W^T (+ s_err @ M^T for Q4_1/Q5_1) (+ b), per run of output rows.

    `tensors`: the GGUF tensors the layer's weight is made of, in output order (one, or the
    q/k/v or gate/up projections of a merged layer). Shards of different types get their own
    activation rounding; a layer whose shards agree runs one GEMM.

    Q4_1/Q5_1: ggml computes sum_b d_w*d_x*sum(q_w*q_x) + m_w*s with s = fp16(d_x*sum(q_x)) rounded
    on its own. The GEMM of the rounded activations with the dequantized weight d_w*q_w + m_w gives
    m_w * d16*sum(q_x) instead, so `apply` adds (s - d16*sum(q_x)) @ M^T with M the weight's block
    minima [out, K/32] (read from the file: they cannot be recovered from dequantized values in
    general). The extra GEMM is 1/32 of the main one.
    """

    def __init__(self, names: list[str], tensors: list[GGUFTensor], head_dim: int | None = None) -> None:
        self.names = names
        self.tensors = tensors
        self.head_dim = head_dim
        self.segments = self._segments(tensors)
        self._float = UnquantizedLinearMethod()

    @staticmethod
    def _segments(tensors: list[GGUFTensor]) -> list[_Segment]:
        """Adjacent shards that round their input alike share a segment (one GEMM)."""
        segments: list[_Segment] = []
        start = 0
        for t in tensors:
            fmt, n = activation_format(t.tensor_type.name), t.shape[0]
            if segments and segments[-1].fmt == fmt:
                segments[-1] = _Segment(segments[-1].start, start + n, fmt)
            else:
                segments.append(_Segment(start, start + n, fmt))
            start += n
        return segments

    def create_weights(
        self, layer: LinearBase, input_size: int, output_size: int, params_dtype: torch.dtype
    ) -> None:
        # The float weight, loaded dequantized like the unquantized path (same loaders, shards).
        self._float.create_weights(layer, input_size, output_size, params_dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight: torch.Tensor = layer.weight
        rows = [t.shape[0] for t in self.tensors]
        if sum(rows) != weight.shape[0] or any(t.shape[-1] != weight.shape[1] for t in self.tensors):
            raise ValueError(
                f"{'+'.join(self.names)}: GGUF shapes {[list(t.shape) for t in self.tensors]} do not "
                f"make the layer's weight {list(weight.shape)}"
            )
        if any(t.tensor_type.name in TYPES_WITH_BLOCK_MIN for t in self.tensors):
            mins = torch.zeros(weight.shape[0], weight.shape[1] // 32, dtype=torch.float32)
            start = 0
            for name, t, n in zip(self.names, self.tensors, rows, strict=True):
                if t.tensor_type.name in TYPES_WITH_BLOCK_MIN:
                    mins[start : start + n] = self._aligned_block_mins(name, t, weight[start : start + n])
                start += n
            # A buffer, so it follows the layer across devices; derived data, never checkpointed.
            layer.register_buffer("gguf_block_min", mins.to(weight.device), persistent=False)

    def _aligned_block_mins(self, name: str, t: GGUFTensor, loaded: torch.Tensor) -> torch.Tensor:
        """The tensor's block minima [rows, K/32] in the row order of the loaded weight.

        The loader may have permuted rows (llama.cpp's Q/K RoPE interleave, see
        `unpermute_qk`); rather than repeat its per-architecture rules, find the order whose first
        block dequantizes to the loaded values. This also proves the file and the weight agree.
        """
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        rows, nb = t.shape[0], t.shape[-1] // block
        raw = np.asarray(t.data).reshape(rows, nb, type_size)
        # block_q4_1 / block_q5_1 both start with fp16 d, then fp16 m.
        mins = torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        first = torch.from_numpy(dequantize(raw[:, 0].copy(), t.tensor_type).reshape(rows, block))
        want = loaded[:, :block].detach().float().cpu()
        if torch.equal(first, want):
            return mins
        if self.head_dim and self.head_dim % 2 == 0 and rows % self.head_dim == 0:
            n_head = rows // self.head_dim
            if torch.equal(unpermute_qk(first, n_head), want):
                return unpermute_qk(mins, n_head)
        raise ValueError(f"{name}: the loaded weight does not match the GGUF tensor's blocks")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight: torch.Tensor = layer.weight
        x2 = x.reshape(-1, x.shape[-1])
        rounded: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        outs = []
        for seg in self.segments:
            if seg.fmt not in rounded:
                rounded[seg.fmt] = quantize_activations(x2, seg.fmt)
            xq, s_err = rounded[seg.fmt]
            whole = len(self.segments) == 1
            w = weight if whole else weight[seg.start : seg.end]
            y = F.linear(xq, w.float())
            if s_err is not None:
                mins = layer.gguf_block_min if whole else layer.gguf_block_min[seg.start : seg.end]
                y = torch.addmm(y, s_err, mins.t())
            outs.append(y)
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class LlamaCppQuantConfig:
    """`QuantConfig` giving every linear layer whose weights come from a quantized GGUF tensor a
    `LlamaCppLinearMethod`; layers with float32 weights (and names the file lacks) stay float.

    `tensors`: GGUF tensors by HF parameter name (as the GGUF loader names them). 'lm_head'
    resolves to the embedding when the file has no separate output tensor (tied embeddings), as in
    llama.cpp.
    """

    def __init__(self, tensors: Mapping[str, GGUFTensor], head_dim: int | None = None) -> None:
        self.tensors = dict(tensors)
        self.head_dim = head_dim

    @classmethod
    def from_gguf(cls, path: str | Path, hf_config: Any | None = None) -> LlamaCppQuantConfig:
        from paphos.models import hf_config as hf

        tensors = GGUFCheckpoint(path).tensors_by_hf_name()
        return cls(tensors, hf.head_dim(hf_config) if hf_config is not None else None)

    def _shard_names(self, prefix: str) -> list[str]:
        if prefix == "lm_head" and "lm_head.weight" not in self.tensors:
            return ["model.embed_tokens.weight"]
        return checkpoint_names(prefix)

    def get_linear_method(self, prefix: str) -> LlamaCppLinearMethod | None:
        names = self._shard_names(prefix)
        missing = [n for n in names if n not in self.tensors]
        if missing:
            logger.warning("%s: no GGUF tensor %s; this layer keeps float32 numerics", prefix, missing)
            return None
        tensors = [self.tensors[n] for n in names]
        if all(activation_format(t.tensor_type.name) == "F32" for t in tensors):
            return None  # float32 weights: ggml multiplies float32 activations too
        return LlamaCppLinearMethod(names, tensors, self.head_dim)
