"""Packed 4-bit weights on the CPU: torch's int4pack layout and matmul, shared by GGUF (Q4_0 / Q4_1
/ Q4_K, groups of 32: paphos/quant/gguf/kernels.py) and the integer checkpoints (GPTQ, AWQ,
compressed-tensors 4-bit, groups of 32 to 256: paphos/quant/int_linear.py) in bf16 models.

w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g], scale and zero in bf16 (a checkpoint's fp16
scales are rounded to bf16: ~2^-9 relative, far below the 4-bit step). Memory: K/2 bytes + 4 bytes
per group per row. Per-call dequantization would cost several times the matmul it feeds on the
CPU, and a bf16 weight four times the memory traffic of the packed one, so decode stays packed.

Several rows (2 up to a few hundred) go to native/cpu.py's kernel where the CPU has AVX512-BF16:
it reads this same layout, turns each block of 16 rows into bf16 codes in cache and sums exact
products per group (at 16 rows: gate|up 3072 x 576 98 us against int4pack's 165; one SmolLM2
layer's four weights at 256 rows 2.55 ms against 3.08 ms for unpack + GEMM). Long prefill chunks
unpack the weight to bf16 and run a dense GEMM, which amortises the unpacking over its rows: 512
rows 4.90 ms a layer against the native 5.00 ms (the two meet near 400). Without the native
kernel, that pays from 128 rows with the compiled unpack (compiled_dequant.py; 4.7 vs 5.4 ms for
int4pack) and from 768 with the eager one (15 ms a layer), int4pack's matmul taking the rest. Unpacking
reads torch's packed layout (64-row tiles: byte [tile, k, i] holds row i in its low nibble and
row i + 32 in its high one), checked once per process against the packer itself; if a torch
version packs differently, several rows simply stay on int4pack.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from paphos.native import cpu as native_cpu
from paphos.quant.kernels import compiled_dequant

# Rows from which unpack + GEMM beats int4pack: with the eager and with the compiled unpack.
DENSE_MIN_TOKENS = 768
DENSE_MIN_TOKENS_COMPILED = 128
DENSE_MIN_TOKENS_OVER_NATIVE = 384  # with the native kernel below it (compiled unpack only)
TILE = 64  # output rows per tile of the packed layout
GROUP_SIZES = (32, 64, 128, 256)


class _Native:
    """Whether the native int4 kernel may run here: set where weights are packed (outside any
    graph), as it reads the layout `_layout_known` checks."""

    ready = False


def supported(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether torch here has the kernel and it takes the shape: groups of 32-256 dividing K, and
    output rows in tiles of 16."""
    return (
        hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and group_size in GROUP_SIZES
        and in_features % group_size == 0
        and out_features % 16 == 0
    )


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] (0..15), scales and zeros [N, G] (w = (q - 8) * scale + zero) -> (packed
    weight, bf16 scale_zero [G, N, 2]) for `matmul`."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
    _Native.ready = native_cpu.load() and _layout_known()
    scale_zero = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scale_zero


def matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype (computed in bf16)."""
    xb = x.to(torch.bfloat16)
    rows = x.shape[0]
    native = rows > 1 and _Native.ready and native_cpu.int4pack_supported(xb, packed)
    if compiled_dequant.is_enabled():
        dense_from = DENSE_MIN_TOKENS_OVER_NATIVE if native else DENSE_MIN_TOKENS_COMPILED
    else:
        dense_from = None if native else DENSE_MIN_TOKENS  # the eager unpack never beats the native kernel
    if dense_from is not None and rows >= dense_from and packed.shape[0] % TILE == 0 and _layout_known():
        y = F.linear(xb, compiled_dequant.dequantize(unpack, packed, scale_zero, group_size))
    elif native:
        y = native_cpu.int4pack_mm(xb, packed, scale_zero, group_size)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, group_size, scale_zero)
    return y.to(x.dtype)


def unpack(packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """The bf16 weight [N, K] of a packed weight whose N is a multiple of 64."""
    n, k = packed.shape[0], packed.shape[1] * 2
    tiles = packed.view(n // TILE, k, TILE // 2)
    q = torch.cat([tiles & 0xF, tiles >> 4], dim=2).transpose(1, 2).reshape(n, k // group_size, group_size)
    scale = scale_zero[..., 0].t().float().unsqueeze(-1)
    zero = scale_zero[..., 1].t().float().unsqueeze(-1)
    return torch.addcmul(zero, q.float() - 8.0, scale).to(torch.bfloat16).reshape(n, k)


@cache
def _layout_known() -> bool:
    """Whether this torch packs int4 weights as `unpack` reads them (a 128 x 64 probe)."""
    q = torch.arange(128 * 64, dtype=torch.int32).reshape(128, 64) * 7 % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    if tuple(packed.shape) != (128, 32):
        return False
    ones = torch.ones(2, 128, 2, dtype=torch.bfloat16)
    ones[..., 1] = 8.0  # scale 1, zero 8: w = q
    return torch.equal(unpack(packed, ones, 32).float(), q.float())
