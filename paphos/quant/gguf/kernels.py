"""Matmul kernels for GGUF weights, and the rule that picks one per layer.

Data flow: `GGUFLinearMethod.process_weights_after_loading` -> `select_kernel(shards, device,
dtype)`: the first class of `KERNELS` whose `can_implement` accepts the layer wins (design.md §7;
the choice is logged once per distinct outcome) -> `kernel.prepare(layer)` repacks the raw blocks
once -> `kernel.apply(layer, x)` on every forward. The GPU kernel (`TritonGGUFKernel`,
triton_gguf.py: a batch-1 GEMV (triton_gemv.py), fused dequant x matmul up to FUSED_MAX_TOKENS
tokens per step, dequantize into a shared scratch buffer + cuBLAS above) is at the front of `KERNELS`; it repacks the raw blocks into
planes of the same size (+<4% for K-quant scales) and checks itself once per type at start-up
against the torch reference, falling back to dequantize-at-load if it fails. A weight that only
serves row lookups (an untied token embedding) takes `select_embedding_kernel` instead (Triton
planes on CUDA, else the raw blocks): it is never dequantized whole. Kernels with an `embed` give
the rows of a token embedding (a head tied to it shares the one layout).

The CPU choice (bf16 models; float32 models dequantize every layer once at load: the exact
reference). Per-call dequantization costs several times the matmul it feeds, and a bf16 weight
twice to four times the memory traffic of the packed one, so decode reads packed weights:
  * Q4_0 / Q4_1 / Q4_K: torch's int4pack (`Int4PackCPUKernel`: their scale/zero groups of 32 map
    onto its layout exactly; bf16 activations);
  * Q8_0 / Q5_0 / Q6_K: int8 codes and float32 group scales (`Int8GroupCPUKernel`): one byte per
    value, and exact rows for a tied embedding;
  * the rest: dequantized at load into the model dtype.
Measured with benchmarks/gguf_cpu.py (bf16, 2 cores, compiled decode step, best of 3 alternating
rounds, 2026-12-04):
  SmolLM2-135M Q4_1    decode 112.9 tok/s (llama.cpp 135.8), weights 93.7 MiB (file 93.8, llama.cpp
                       92.1; 119.3 with the Q8_0 tied head in bf16), prefill 256: 569 tok/s
  Gemma-3-270M Q4_K_M  decode 54.7 tok/s (llama.cpp 65.6), weights 277.8 MiB (file 241.4, llama.cpp
                       235.2; 544 with Q5_0 / Q6_K / Q8_0 dequantized at load), prefill 256: 361 tok/s (924 with them
                       dequantized at load: int8 layers dequantize per prefill call)
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from paphos.native import cpu as native_cpu
from paphos.quant.gguf.base import (
    DequantizedAtLoadKernel,
    GGUFKernel,
    GGUFShard,
    dequantize_layer,
    drop_raw,
    raw_shard,
)
from paphos.quant.gguf.dequant import (
    INT8_GROUP_TYPES,
    Q4_AFFINE_TYPES,
    dequantize,
    int8_groups,
    q4_affine_groups,
)
from paphos.quant.gguf.triton_gguf import TritonGGUFKernel
from paphos.quant.kernels import int4pack_cpu, int8_group_cpu

logger = logging.getLogger(__name__)

GROUP = 32  # values per scale/offset group of the int4pack layout



class Int4PackCPUKernel:
    """Q4_0 / Q4_1 / Q4_K shards in torch's int4pack CPU layout (paphos/quant/kernels/int4pack_cpu.py:
    groups of 32, scale/zero in bf16). Memory: the same as Q4_1, 0.5 bit per value more than Q4_0 /
    Q4_K."""

    name = "int4pack-cpu"

    @classmethod
    def can_implement(cls, shards: tuple[GGUFShard, ...], device: torch.device, dtype: torch.dtype) -> bool:
        rows = sum(s.rows for s in shards)
        return (
            device.type == "cpu"
            and dtype == torch.bfloat16
            and all(s.type_name in Q4_AFFINE_TYPES for s in shards)
            and int4pack_cpu.supported(rows, GROUP, GROUP)
        )

    def prepare(self, layer: nn.Module, shards: tuple[GGUFShard, ...], dtype: torch.dtype) -> None:
        qs, scales, zeros = [], [], []
        for s in shards:
            q, scale, offset = q4_affine_groups(raw_shard(layer.weight, s), s.type_name)
            qs.append(q)
            scales.append(scale)
            zeros.append(offset + 8.0 * scale)  # scale * q + offset = (q - 8) * scale + zero
        packed, scale_zero = int4pack_cpu.pack(torch.cat(qs), torch.cat(scales), torch.cat(zeros))
        layer.register_buffer("gguf_int4", packed, persistent=False)
        layer.register_buffer("gguf_scale_zero", scale_zero, persistent=False)
        drop_raw(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return int4pack_cpu.matmul(x, layer.gguf_int4, layer.gguf_scale_zero, GROUP)


# Whether bf16 CPU layers of Q8_0 / Q5_0 / Q6_K stay int8 (`Int8GroupCPUKernel`). That pays only
# where the decode step is compiled (its batch-1 matmul is then one fused pass over the codes); an
# eager engine keeps them dequantized at load, whose bf16 GEMVs beat a per-call dequantization
# (worker/setup.py sets this around loading).
INT8_GROUPS_ON_CPU: ContextVar[bool] = ContextVar("INT8_GROUPS_ON_CPU", default=True)


class Int8GroupCPUKernel:
    """Q8_0 / Q5_0 / Q6_K shards as int8 codes and float32 group scales (paphos/quant/kernels/
    int8_group_cpu.py): ~1 byte per value where a bf16 weight takes 2, exact rows for a tied
    embedding. Memory: 8 bits + 32 bits per group (Q8_0 9, Q5_0 9 (5.5 in the file), Q6_K 10 (6.6)),
    the smallest group of a merged layer's shards for all of them."""

    name = "int8-groups-cpu"

    @classmethod
    def can_implement(cls, shards: tuple[GGUFShard, ...], device: torch.device, dtype: torch.dtype) -> bool:
        return (
            device.type == "cpu"
            and dtype == torch.bfloat16
            and INT8_GROUPS_ON_CPU.get()
            and all(s.type_name in INT8_GROUP_TYPES for s in shards)
        )

    def prepare(self, layer: nn.Module, shards: tuple[GGUFShard, ...], dtype: torch.dtype) -> None:
        # Shards of different group sizes (a merged Q5_0 + Q6_K layer) share the smallest one.
        group = min(INT8_GROUP_TYPES[s.type_name] for s in shards)
        codes, scales = [], []
        for s in shards:
            q, scale = int8_groups(raw_shard(layer.weight, s), s.type_name)
            codes.append(q)
            scales.append(scale.repeat_interleave(INT8_GROUP_TYPES[s.type_name] // group, dim=1))
        native_cpu.load()
        layer.register_buffer("gguf_codes", torch.cat(codes).contiguous(), persistent=False)
        layer.register_buffer("gguf_scales", torch.cat(scales).contiguous(), persistent=False)
        self.dtype = dtype
        drop_raw(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return int8_group_cpu.matmul(x, layer.gguf_codes, layer.gguf_scales)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = int8_group_cpu.dequantize_rows(layer.gguf_codes[flat], layer.gguf_scales[flat], self.dtype)
        return rows.view(*ids.shape, -1)


class DequantPerCallKernel:
    """Torch reference: dequantize every shard on each call, then one GEMM. Keeps the raw blocks
    (memory = file bytes); the reference of the GPU kernels, not chosen for serving."""

    name = "dequant-per-call"

    @classmethod
    def can_implement(cls, shards: tuple[GGUFShard, ...], device: torch.device, dtype: torch.dtype) -> bool:
        return device.type != "cpu"

    def prepare(self, layer: nn.Module, shards: tuple[GGUFShard, ...], dtype: torch.dtype) -> None:
        self.shards, self.dtype = shards, dtype

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_layer(layer.weight, self.shards, x.dtype))

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return embed_raw(layer.weight, self.shards, ids, self.dtype)


def embed_raw(
    weight: torch.Tensor, shards: tuple[GGUFShard, ...], ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` of a one-shard raw weight, dequantized (torch; a gather of block rows, then the
    dequantizer on those rows only): [*ids.shape, in] in `dtype`. No host sync: CUDA-graph safe."""
    if len(shards) != 1:
        raise ValueError("row lookups need a weight of one GGUF tensor")
    raw = raw_shard(weight, shards[0])
    rows = raw.index_select(0, ids.reshape(-1))  # uint8 [T, row_bytes]
    return dequantize(rows, shards[0].type_name).to(dtype).view(*ids.shape, -1)


# First match wins; GPU kernels go in front.
# TritonGGUFKernel (triton_gguf.py): CUDA, bf16/fp16, layers whose every shard has a Triton
# format (Q4_0/1, Q5_0/1, Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS); others (and a kernel failing its
# start-up self-check) dequantize at load.
# DequantPerCallKernel is not a candidate: on a GPU it dequantizes every weight on every step
# (tens of ms for an 8B model); it stays as a torch reference.

KERNELS: list[type[GGUFKernel]] = [TritonGGUFKernel, Int4PackCPUKernel, Int8GroupCPUKernel, DequantizedAtLoadKernel]

# For weights that only serve row lookups (an untied embedding): kept in blocks, never
# dequantized whole. The Triton layout on CUDA (one launch per lookup), else the raw blocks.
EMBEDDING_KERNELS: list[type[GGUFKernel]] = [TritonGGUFKernel, DequantPerCallKernel]

_logged: set[tuple[str, str, str]] = set()


def select_kernel(shards: tuple[GGUFShard, ...], device: torch.device, dtype: torch.dtype) -> GGUFKernel:
    """An instance of the first kernel of `KERNELS` that accepts the layer; logged once per
    (kernel, types, device)."""
    for cls in KERNELS:
        if cls.can_implement(shards, device, dtype):
            types = "+".join(sorted({s.type_name for s in shards}))
            key = (cls.name, types, device.type)
            if key not in _logged:
                _logged.add(key)
                logger.info("GGUF %s weights on %s (%s): %s kernel", types, device.type, dtype, cls.name)
            return cls()
    raise RuntimeError("no GGUF kernel accepts the layer")  # DequantizedAtLoadKernel accepts all


def select_embedding_kernel(
    shards: tuple[GGUFShard, ...], device: torch.device, dtype: torch.dtype
) -> GGUFKernel:
    """The kernel of a weight that is only an embedding: Triton planes where the Triton kernels
    take the type (CUDA, bf16/fp16), else the raw blocks dequantized per lookup (any device)."""
    types = "+".join(sorted({s.type_name for s in shards}))
    if TritonGGUFKernel.can_implement(shards, device, dtype):
        kernel: GGUFKernel = TritonGGUFKernel(matmul=False)
    else:
        kernel = DequantPerCallKernel()
    key = (f"{kernel.name} (embedding)", types, device.type)
    if key not in _logged:
        _logged.add(key)
        logger.info("GGUF %s embedding on %s (%s): %s kernel", types, device.type, dtype, kernel.name)
    return kernel
