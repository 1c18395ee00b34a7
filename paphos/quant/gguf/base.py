"""What every GGUF kernel shares: the record of one checkpoint tensor inside a (merged) layer
(`GGUFShard`), the kernel protocol, and the universal fallback every other kernel falls back to
(`DequantizedAtLoadKernel`). kernels.py (the CPU kernels and the selection rule) and
triton_gguf.py (the CUDA kernels) both build on it, so neither imports the other's module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paphos.quant.gguf.dequant import dequantize


@dataclass(frozen=True)
class GGUFShard:
    """One checkpoint tensor of a (possibly merged) layer: output rows [row_start, row_start +
    rows) of the layer, stored as `rows x row_bytes` raw bytes at `byte_offset` of the layer's flat
    `weight` parameter."""

    name: str  # HF name, e.g. model.layers.0.self_attn.q_proj.weight
    type_name: str  # ggml type, e.g. Q4_K
    rows: int
    row_bytes: int
    row_start: int
    byte_offset: int

    @property
    def n_bytes(self) -> int:
        return self.rows * self.row_bytes


def raw_shard(weight: torch.Tensor, shard: GGUFShard) -> torch.Tensor:
    """The raw blocks of `shard` as uint8 [rows, row_bytes] (a view of the flat weight)."""
    return weight[shard.byte_offset : shard.byte_offset + shard.n_bytes].view(shard.rows, shard.row_bytes)


def dequantize_layer(weight: torch.Tensor, shards: tuple[GGUFShard, ...], dtype: torch.dtype) -> torch.Tensor:
    """The whole weight [out, in] in `dtype`, shard by shard."""
    return torch.cat([dequantize(raw_shard(weight, s), s.type_name).to(dtype) for s in shards])


class GGUFKernel(Protocol):
    name: ClassVar[str]

    @classmethod
    def can_implement(
        cls, shards: tuple[GGUFShard, ...], device: torch.device, dtype: torch.dtype
    ) -> bool: ...

    def prepare(self, layer: nn.Module, shards: tuple[GGUFShard, ...], dtype: torch.dtype) -> None:
        """Repack `layer.weight` (flat raw blocks) once, for activations of `dtype`; may free it."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype (bias not added)."""

    # Optional, for weights that are also an embedding (see `GGUFLinearMethod`):
    # def embed(self, layer, ids) -> rows `ids` of the weight [*ids.shape, in] in the layer's
    # dtype, bit-equal to `dequantize(raw)[ids].to(dtype)`. Int4PackCPUKernel has none (its scales
    # are rounded to bf16).


def drop_raw(layer: nn.Module) -> None:
    # The raw blocks are no longer read: free them (the parameter stays, so its name is stable).
    layer.weight.data = torch.empty(0, dtype=torch.uint8, device=layer.weight.device)


class DequantizedAtLoadKernel:
    """Dequantize once at load into the model dtype and run a float GEMM: any type, any device.
    With float32 it is the exact reference (bit-exact dequantization, as `gguf` computes it)."""

    name = "dequantized-at-load"

    @classmethod
    def can_implement(cls, shards: tuple[GGUFShard, ...], device: torch.device, dtype: torch.dtype) -> bool:
        return True

    def prepare(self, layer: nn.Module, shards: tuple[GGUFShard, ...], dtype: torch.dtype) -> None:
        layer.register_buffer(
            "gguf_dequantized", dequantize_layer(layer.weight, shards, dtype), persistent=False
        )
        drop_raw(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.gguf_dequantized)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.gguf_dequantized)
