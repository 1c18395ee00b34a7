"""Tile helpers of the int8 tensor-core GEMMs (triton_int_i8.py: GPTQ / AWQ / compressed-tensors
planes; paphos/quant/gguf/triton_gguf_i8.py: GGUF planes) over x's int8 parts from
paphos/layers/x_int8_blocks.py: which weight rows, tokens and K blocks a program covers, where its
x operand's columns (both parts of each token side by side) are, and the parts' join.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None

if triton is not None:

    @triton.jit
    def program_tile(pid_n, pid_m, pid_k, N, M, n_blocks, iters_per_split, BN: tl.constexpr, BM: tl.constexpr):
        """What a GEMM program on these parts covers: BN weight rows (rows, row_ok), BM tokens (ms,
        m_ok), x blocks it0 .. it1 of its K slice; and the 2 BM columns of its x operand, both
        parts side by side: column j is part j // BM (first: j < BM) of token tok = pid_m * BM +
        j % BM (tok_ok)."""
        rows = pid_n * BN + tl.arange(0, BN)
        ms = pid_m * BM + tl.arange(0, BM)
        cols = tl.arange(0, 2 * BM)
        tok = pid_m * BM + cols % BM
        it0 = pid_k * iters_per_split
        it1 = tl.minimum(it0 + iters_per_split, n_blocks)
        return rows, rows < N, ms, ms < M, cols < BM, tok, tok < M, it0, it1

    @triton.jit
    def part_pointers(q_ptr, first, tok, M, K, KB: tl.constexpr):
        """[KB, 2 BM] pointers to the first KB positions of each x operand column's part."""
        return q_ptr + (tl.where(first, 0, M) + tok).to(tl.int64)[None, :] * K + tl.arange(0, KB)[:, None]

    @triton.jit
    def sum_parts(acc, BN: tl.constexpr, BM: tl.constexpr):
        """[BN, 2 BM] (each column one part of a token, scaled) -> [BN, BM]: the two parts summed."""
        return tl.sum(tl.reshape(tl.permute(tl.reshape(acc, (BN, 2, BM)), (0, 2, 1)), (BN, BM, 2)), axis=2)


