"""What a kernel that produces a linear layer's input writes beside it: the int8 parts of x that
the layer's quantized GEMV (x_int8.py, batch 1) or int8 tensor-core GEMM (x_int8_blocks.py, a
few tokens) would otherwise quantize in a launch of its own.

Data flow: after loading, `feed` puts the consumer's `Int8Outputs` on its producer (the
residual add + RMSNorm, SiLU x mul: paphos/layers/fused.py; the split-KV attention merge:
paphos/attention/triton_attention.py). Each step the producer's launcher calls `prepare` on its
output (allocates the parts the consumer reads at this token count and attaches them to the
output), passes `Prepared.args` and `Prepared.constexprs` to its kernel, and the kernel calls
`write_after_store` once it has stored a run of columns of one row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from paphos.layers import x_int8, x_int8_blocks
from paphos.layers.x_int8_blocks import BlockLayout, BlockParts

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the producers run their torch references
    triton = None


class Int8Outputs(NamedTuple):
    """The int8 layouts a producer's consumer reads: the batch-1 GEMV's and the int8 tensor-core
    GEMM's (either may be None)."""

    gemv: x_int8.Int8Layout | None = None
    blocks: BlockLayout | None = None

    def at(self, tokens: int, k: int) -> Int8Outputs:
        """The layouts read for x [tokens, k]: the GEMV's at one token (K whole tile groups), the
        GEMM's where it serves that count (BlockLayout.serves)."""
        gemv = self.gemv if self.gemv is not None and tokens == 1 and k % self.gemv.tile_values == 0 else None
        blocks = self.blocks if self.blocks is not None and self.blocks.serves(tokens, k) else None
        return Int8Outputs(gemv, blocks)

    def columns_per_write(self) -> int:
        """The fewest contiguous columns a `write_after_store` call must cover: a GEMV tile group
        or a GEMM block."""
        return max(self.gemv.tile_values if self.gemv else 1, self.blocks.xb if self.blocks else 1)


def feed(producer: nn.Module, consumer: nn.Module) -> None:
    """After loading: `producer` (RMSNorm, SiluAndMul, an attention layer) also writes its output's
    int8 parts in the layouts `consumer` (a linear layer) reads them in, if its quant method has
    any: the batch-1 GEMV's (`int8_input_layout`) and the int8 tensor-core GEMM's for a few tokens
    (`int8_block_layout`), as `producer.int8_outputs`."""
    method = consumer.quant_method
    gemv = getattr(method, "int8_input_layout", None)
    blocks = getattr(method, "int8_block_layout", None)
    producer.int8_outputs = Int8Outputs(
        gemv(consumer) if gemv is not None else None, blocks(consumer) if blocks is not None else None
    )


class Prepared(NamedTuple):
    """A producer kernel's arguments for one output: six pointers (GEMV words and floats; block
    order, parts, dx, sums; the output itself stands in for any not written) and the constexprs
    QLO, QTW (0, 1: no GEMV parts) and BXB, BSUM (0, 1: no block parts)."""

    args: tuple[torch.Tensor, ...]
    constexprs: dict[str, int]

    @property
    def writes(self) -> bool:
        return self.constexprs["QLO"] > 0 or self.constexprs["BXB"] > 0


def prepare(out: torch.Tensor, wanted: Int8Outputs | None, columns_per_program: int = 0) -> Prepared:
    """The parts of out (contiguous, T rows of K values: [T, K], or [T, heads, head_dim]) its
    consumer reads at T tokens, allocated and attached to `out`: GEMV parts for one row, block
    parts where the layout serves T (BlockLayout.serves). With `columns_per_program` (each
    program stores that many contiguous columns of a row, then calls `write_after_store`), only
    layouts whose groups or blocks fit whole in it are written."""
    gemv = blocks = None
    if wanted is not None:
        rows = out.view(out.shape[0], -1)
        used = wanted.at(*rows.shape)
        cols = columns_per_program or rows.shape[1]
        if used.gemv is not None and cols % used.gemv.tile_values == 0:
            gemv = x_int8.empty(rows, used.gemv)
            x_int8.attach(out, used.gemv, gemv)
        if used.blocks is not None and cols % used.blocks.xb == 0:
            blocks = x_int8_blocks.empty(rows, used.blocks)
            x_int8.attach(out, used.blocks, blocks)
    gemv_args = (gemv.words, gemv.scales) if gemv is not None else (out, out)
    block_args: BlockParts | tuple[torch.Tensor, ...] = (
        (wanted.blocks.order(out.device), *blocks) if blocks is not None else (out,) * 4
    )
    lo, tw = gemv.layout if gemv is not None else (0, 1)
    xb, every = (wanted.blocks.xb, wanted.blocks.sum_every) if blocks is not None else (0, 1)
    return Prepared((*gemv_args, *block_args), {"QLO": lo, "QTW": tw, "BXB": xb, "BSUM": every})


if triton is not None:

    @triton.jit
    def write_after_store(
        row_ptr, q_ptr, f_ptr, order_ptr, bq_ptr, bdx_ptr, bsum_ptr, row, n_rows, col0, n_cols,
        BLOCK: tl.constexpr, QLO: tl.constexpr, QTW: tl.constexpr, BXB: tl.constexpr, BSUM: tl.constexpr,
    ):  # fmt: skip
        """After a program stored columns col0 .. col0 + BLOCK of row `row` (row_ptr: its start) of
        an [n_rows, n_cols] output: the parts `prepare` asked for of those columns, read back from
        what was stored (past n_cols masked). BLOCK is a multiple of the tile group and block."""
        if QLO > 0 or BXB > 0:
            tl.debug_barrier()  # the values were stored by other threads of this program
        if QLO > 0:
            TV: tl.constexpr = QTW * 32 // QLO
            t = col0 // TV + tl.arange(0, BLOCK // TV)
            x_int8.store_groups(row_ptr, q_ptr, f_ptr, t, t < n_cols // TV, n_cols // TV, QLO, QTW)
        if BXB > 0:
            blk = col0 // BXB + tl.arange(0, BLOCK // BXB)
            blk_ok = blk < n_cols // BXB
            k = x_int8_blocks.block_positions(order_ptr, order_ptr, blk, blk_ok, BXB, False)
            v = tl.load(row_ptr + k, mask=blk_ok[:, None], other=0).to(tl.float32)
            x_int8_blocks.store_blocks(v, row, n_rows, n_cols, blk, blk_ok, bq_ptr, bdx_ptr, bsum_ptr, BXB, BSUM,
                                       BLOCK // BXB)  # fmt: skip
