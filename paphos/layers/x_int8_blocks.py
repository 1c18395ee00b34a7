"""x as two int8 parts per value in blocks, for the int8 tensor-core GEMMs of a few tokens
(paphos/quant/kernels/triton_int_i8.py: GPTQ / AWQ / compressed-tensors planes;
paphos/quant/gguf/triton_gguf_i8.py: GGUF planes): x = dx * (q1 + q2 / 254) with dx = max|x| /
127 per token and block of `xb` values of K (the batch-1 GEMV's numerics, x_int8.py: about 15
bits of x), written in the order in which the GEMM multiplies a weight plane's codes. It lives
with the layers, as x_int8.py does, because the layers produce it.

That order: `order` [xb] says which value of the block each position holds (a permutation of
0 .. xb - 1). With act-order the block's values are x[:, perm] (the gather happens in the
quantizing launch, straight into registers). Beside the parts: dx per token and block, and the
integer sum of 254 * q1 + q2 over every `sum_every` positions (what zero points and minimums
multiply).

Data flow: the kernel that produces a linear layer's input (residual add + RMSNorm, SiLU x mul:
fused.py) writes these parts too where the layer's GEMM reads them at that token count
(`BlockLayout.serves`; x_int8_outputs.feed wires it after loading), attached to x; otherwise `quantize`
does, one launch per linear and step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from paphos.layers import pdl, x_int8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None

QUANTIZE_BLOCKS = 4  # x blocks per program of `_quantize_kernel`
_ORDERS: dict[tuple[str, torch.device], torch.Tensor] = {}


@dataclass(frozen=True)
class BlockLayout:
    """How one int8 tensor-core GEMM reads x: blocks of `xb` values in the order `make_order()`
    gives (named `name`), an integer sum every `sum_every` positions; it runs at `min_tokens` to
    `max_tokens` tokens. The batched-decode counterpart of x_int8.Int8Layout: x's producer
    writes these parts too at those token counts (x_int8_outputs.feed)."""

    name: str
    make_order: Callable[[], torch.Tensor] = field(compare=False)
    xb: int
    sum_every: int
    # where the parts are written, not what they are: layouts equal in the fields above are one
    min_tokens: int = field(compare=False)
    max_tokens: int = field(compare=False)

    def order(self, device: torch.device) -> torch.Tensor:
        """The order as the int32 tensor the kernels read, on `device`: made once per device, not
        at every call of a linear."""
        key = (self.name, device)
        if key not in _ORDERS:
            _ORDERS[key] = self.make_order().to(device=device, dtype=torch.int32)
        return _ORDERS[key]

    def serves(self, tokens: int, k: int) -> bool:
        """Whether the GEMM reads these parts for x [tokens, k]."""
        return self.min_tokens <= tokens <= self.max_tokens and k % self.xb == 0


def reference_quantize(
    x: torch.Tensor, order: torch.Tensor, xb: int, sum_every: int, perm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `quantize`: x [M, K] -> (parts int8 [2, M, K], dx float32 [M, K / xb],
    sums int32 [M, K / sum_every])."""
    m, k = x.shape
    xf = x.float() if perm is None else x.float()[:, perm.long()]
    blocks = xf.reshape(m, k // xb, xb)
    amax = blocks.abs().amax(-1, keepdim=True)
    # a tensor divided by a tensor: torch divides a Python scalar by a tensor as a multiplication by
    # the reciprocal, 1 ulp off the IEEE quotient the kernel takes
    v = blocks * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)
    v = v[..., order.long().to(x.device)]
    q1 = torch.round(v)
    q2 = torch.round((v - q1) * 254.0)
    parts = torch.stack([q1, q2]).to(torch.int8).reshape(2, m, -1)
    sums = (254 * q1 + q2).reshape(m, -1, sum_every).sum(-1).to(torch.int32)
    return parts, amax[..., 0] * (1.0 / 127.0), sums


# ---------------------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def block_positions(order_ptr, perm_ptr, blk, blk_ok, XB: tl.constexpr, HAS_PERM: tl.constexpr):
        """[B, XB] index in x's row of each position of blocks blk (`order`, then act-order's perm)."""
        k = blk[:, None] * XB + tl.load(order_ptr + tl.arange(0, XB))[None, :]
        if HAS_PERM:
            k = tl.load(perm_ptr + k, mask=blk_ok[:, None], other=0)
        return k

    @triton.jit
    def store_blocks(
        v, m, M, K, blk, blk_ok, q_ptr, dx_ptr, sum_ptr, XB: tl.constexpr, SUM: tl.constexpr, B: tl.constexpr,
    ):  # fmt: skip
        """Token m's blocks blk, v [B, XB] float32 in block order -> parts, dx and sums; the
        rounding is x_int8's (`rounded_parts`). Shared by `quantize`'s launch and the kernels
        that produce x (paphos/layers/fused.py)."""
        ok = blk_ok[:, None]
        j = tl.arange(0, XB)
        n_blocks = K // XB
        amax = tl.max(tl.abs(v), axis=1)
        # IEEE division (Triton's `/` is approximate on the GPU): the parts are the reference's
        v = v * tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30)),
                         0.0)[:, None]  # fmt: skip
        f1, f2 = x_int8.rounded_parts(v)
        r1 = f1 - 12582912.0
        r2 = f2 - 12582912.0
        at = m.to(tl.int64) * K + blk[:, None] * XB + j[None, :]
        tl.store(q_ptr + at, r1.to(tl.int32).to(tl.int8), mask=ok)
        tl.store(q_ptr + M.to(tl.int64) * K + at, r2.to(tl.int32).to(tl.int8), mask=ok)
        tl.store(dx_ptr + m * n_blocks + blk, amax * (1.0 / 127.0), mask=blk_ok)
        sums = tl.sum(tl.reshape((254.0 * r1 + r2).to(tl.int32), (B, XB // SUM, SUM)), axis=2)
        per: tl.constexpr = XB // SUM
        s_at = m * (n_blocks * per) + blk[:, None] * per + tl.arange(0, per)[None, :]
        tl.store(sum_ptr + s_at, sums, mask=ok)

    @triton.jit
    def _quantize_kernel(
        x_ptr, order_ptr, perm_ptr, q_ptr, dx_ptr, sum_ptr, M, K, stride_xm,
        XB: tl.constexpr, SUM: tl.constexpr, HAS_PERM: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """BLOCKS blocks of one token per program (grid: tokens x block groups), `order`'s gather
        (through perm with act-order) straight into registers."""
        pdl.release(PDL)
        m = tl.program_id(0)
        blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        blk_ok = blk < K // XB
        k = block_positions(order_ptr, perm_ptr, blk, blk_ok, XB, HAS_PERM)  # static: read before the wait
        pdl.wait(PDL)
        v = tl.load(x_ptr + m.to(tl.int64) * stride_xm + k, mask=blk_ok[:, None], other=0).to(tl.float32)
        store_blocks(v, m, M, K, blk, blk_ok, q_ptr, dx_ptr, sum_ptr, XB, SUM, BLOCKS)


BlockParts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (parts, dx, sums): `reference_quantize`'s


def empty(x: torch.Tensor, layout: BlockLayout) -> BlockParts:
    """Uninitialised parts of x [M, K] in `layout`."""
    m, k = x.shape
    return (
        torch.empty(2, m, k, dtype=torch.int8, device=x.device),
        torch.empty(m, k // layout.xb, dtype=torch.float32, device=x.device),
        torch.empty(m, k // layout.sum_every, dtype=torch.int32, device=x.device),
    )


def quantize(x: torch.Tensor, layout: BlockLayout, perm: torch.Tensor | None = None) -> BlockParts:
    """x [M, K] (unit stride on K, K a multiple of layout.xb) -> `reference_quantize`'s (parts,
    dx, sums) in one launch, unless x's producer attached them (x_int8.attached); perm int32 on
    x's device (act-order: never attached)."""
    if perm is None and (fed := x_int8.attached(x, layout)) is not None:
        return fed
    m, k = x.shape
    order = layout.order(x.device)
    out = empty(x, layout)
    _quantize_kernel[(m, triton.cdiv(k // layout.xb, QUANTIZE_BLOCKS))](
        x, order, order if perm is None else perm, *out, m, k, x.stride(0),  # (perm unread without one)
        XB=layout.xb, SUM=layout.sum_every, HAS_PERM=perm is not None, BLOCKS=QUANTIZE_BLOCKS, num_warps=4,
        **pdl.options(x),
    )  # fmt: skip
    return out
