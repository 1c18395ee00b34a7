"""Triton kernels of EXL2 weights (ExLlamaV2's per-group mixed bit widths) on CUDA, and `matmul`,
the one entry point an EXL2 layer calls every step.

Data flow: paphos/quant/exl2.py loads each shard's checkpoint tensors, exl2_layout.pack turns
them into one `EXL2Planes` per layer (all shards of a merged q|k|v or gate|up layer in one set
of planes) and frees the checkpoint tensors (with `-tp N`, a rank's part: its output columns,
or a row-parallel rank's stored rows as a layer of their own, exl2.py; the layout is the same);
then every forward is `matmul(x, planes)`, by tokens per step M:
  - M <= GEMV_MAX_TOKENS (decode): `_quantize_kernel` gathers x into every shard's stored order
    and quantizes each run of 32 values into two int8 parts (about 15 bits), then
    `_gemv_kernel`, one launch per layer (merged shards included), reads each packed word once
    for all M tokens and multiplies codes by x with integer dot products (`dp4a`, four codes at
    a time), the group scale once per run, fp32 accumulation, output in x's dtype.
  - above: `_dequant_kernel` writes W^T [K, N] in the model dtype, rows in input order, into the
    scratch buffer shared with the GGUF and int families (triton_gguf.scratch; in column chunks
    where it is smaller), then cuBLAS (`x @ W^T`).

The layout on the GPU is exl2_layout.py's (`pack`, `EXL2Planes`).

Numerics: the dequantization is exact to exl2.dequantize (the bit-exact rule): the scale is
fp16((qs + 1)**2 * smax), the weight fp16(code * scale), both rounded from float32 products that
are exact (codes become floats by the 2**23 mantissa trick: no integer conversion). The GEMV
computes scale * dx * sum((code - 2**(b-1)) * (q1 + q2 / 254)) per run: the weights unrounded
(within 2**-12 of the fp16 values) and x to ~15 bits, the integer family's GEMV numerics
(triton_int.py). CUDA-graph safe: no host syncs, buffers sized by shapes only; split-K partials
are added into a zeroed float32 plane that the last program of each tile reads and zeroes again
(split_k.py's atomic launch; the adds' order, so the sum's last float32 bit, varies from run to
run); the GEMV uses programmatic dependent launch (paphos/layers/pdl.py): a program's first run
is loaded before it waits for x, and (by GEMV_CLASSES, up to AHEAD_MAX_TOKENS tokens) each next
run while the current one is multiplied.
Measured (benchmarks/bench_quant_gpu.py `exl2_kernels`; 4.0 bpw, batch 1, CUDA-graph replays,
against bf16 cuBLAS, at the launch GEMV_CLASSES picks): H100, a Llama-3-8B layer's four linears
76.7 us against 162.4 (2.1x; 89.4 before the loads ahead, the 16-byte loads and the unrolled
final sum: q|k|v 17.1 -> 14.0, o 14.4 -> 11.0, gate|up 32.6 -> 30.9, down 25.4 -> 20.9 us), the
6-bit head 141 us (2.7x bf16); H200 (before the 16-byte loads) a layer 83.3 -> 74.5 us (1.53x
bf16's 114.4). The atomic sums then took the H100 layer from 76.4 to 71.5 us (q|k|v 14.0 -> 12.9,
o 10.9 -> 9.5, down 21.0 -> 19.1, gate|up 30.5 -> 30.0). Engine, H100: 334.3 tok/s at batch 1
against bf16's 161.6 (2.07x; 318.0 with stored partials, 274.5 before the loads ahead), 1485 at
16 tokens (1262). The narrow layers still run at a third of copy bandwidth: each is a chain of
dependent latencies (the quantizing launch, x, one or two runs, the split-K sum) more than a
stream of bytes. Moving the quantization into the GEMV's programs (each gathering and quantizing
its own slice of x) was slower: 320.7 -> 314.8 tok/s at batch 1 and 1290 -> 825 at 16 on an H100
(benchmarks/README.md, "EXL2: x quantized inside the GEMV").
"""

from __future__ import annotations

import torch

from paphos.layers import pdl
from paphos.quant.kernels.exl2_layout import EXL2Planes

try:
    import triton
    import triton.language as tl

    from paphos.quant.gguf import triton_gemv, triton_gguf
    from paphos.quant.kernels import split_k
except ImportError:  # CPU-only installs: the layers dequantize at load
    triton = None

# Up to this many tokens the GEMV runs (weights decoded once for all of them); above, dequantize
# + cuBLAS. bench_quant_gpu.py's `exl2_kernels` section times both at 1-16 tokens (gate|up at 16:
# 148 against 199 us, H100).
GEMV_MAX_TOKENS = 16
# The GEMV's launch by the layer's column tiles (GEMV_CLASSES: up to max_tiles tiles, the grid's
# programs per SM, whether each run's loads go out while the one before is multiplied): K slices
# (a power of two) are added while the grid stays within that many programs per SM and each slice
# keeps at least MIN_RUNS runs of 32 rows. Narrow layers take few programs, since every slice
# lengthens each tile's final sum; mid-width ones 16 a SM without loads ahead (which take 96
# registers instead of 66: 16 no longer fit one wave), wide ones (heads) many, with long slices,
# where loads ahead matter most. The winners of bench_quant_gpu.py's `exl2_kernels` sweep on the
# H100 and the H200 (Llama-3-8B, 4.0 bpw): q|k|v 32 slices, o and down 64 (ahead), gate|up 16
# (not ahead: 27.8 / 30.9 us on H200 / H100 against 29.9 / 35.1 at 32 slices ahead), the 6-bit
# head 8 (ahead).
GEMV_CLASSES = ((64, 8, True), (256, 16, False), (1 << 30, 32, True))
MIN_RUNS = 2
QUANTIZE_RUNS = 8  # runs of x per program of `_quantize_kernel`
# Up to this many tokens the GEMV loads each run's words while multiplying the one before (above,
# the accumulators of every token take the registers the second set of words would).
AHEAD_MAX_TOKENS = 4

# ---------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _pick(w0, w1, w2, w3, w4, w5, w6, w7, WORD: tl.constexpr):
        """Word WORD of a run (a compile-time choice among the loaded word rows)."""
        if WORD == 0:
            return w0
        elif WORD == 1:
            return w1
        elif WORD == 2:
            return w2
        elif WORD == 3:
            return w3
        elif WORD == 4:
            return w4
        elif WORD == 5:
            return w5
        elif WORD == 6:
            return w6
        else:
            return w7

    @triton.jit
    def _field(w0, w1, w2, w3, w4, w5, w6, w7, J: tl.constexpr, FIRST: tl.constexpr, WIDTH: tl.constexpr):
        """The WIDTH-bit plane fields of stored rows 4J .. 4J + 3 at the low bits of bytes 0-3 (the
        plane's words start at word FIRST of the run; higher bits of each byte not cleared)."""
        PER: tl.constexpr = 8 // WIDTH
        return _pick(w0, w1, w2, w3, w4, w5, w6, w7, FIRST + J // PER) >> (WIDTH * (J % PER))

    @triton.jit
    def _code_bytes(w0, w1, w2, w3, w4, w5, w6, w7, J: tl.constexpr, BITS: tl.constexpr):
        """The codes of stored rows 4J .. 4J + 3 as the four signed bytes of an int32 (row 4J + l
        in byte l): low plane | high plane << LO, one shift and mask per plane; 8-bit codes as
        code - 128 (the top bit of each byte flipped), so that every byte is a valid int8."""
        LO: tl.constexpr = 2 + 2 * (BITS >= 4) + 4 * (BITS == 8)
        HI: tl.constexpr = BITS - LO
        if LO == 8:
            c = _pick(w0, w1, w2, w3, w4, w5, w6, w7, J) ^ -0x7F7F7F80  # ^ 0x80808080
        else:
            c = _field(w0, w1, w2, w3, w4, w5, w6, w7, J, 0, LO) & (((1 << LO) - 1) * 0x01010101)
            if HI > 0:
                PER: tl.constexpr = 8 // HI
                SHIFT: tl.constexpr = HI * (J % PER) - LO  # the high field down (or up) to bit LO
                h = _pick(w0, w1, w2, w3, w4, w5, w6, w7, LO + J // PER)
                if SHIFT >= 0:
                    h = h >> SHIFT
                else:
                    h = h << -SHIFT
                c = c | (h & ((((1 << HI) - 1) << LO) * 0x01010101))
        return c

    @triton.jit
    def _code_at(w0, w1, w2, w3, w4, w5, w6, w7, V: tl.constexpr, BITS: tl.constexpr):
        """The unsigned code of stored row V of a run (int32)."""
        LO: tl.constexpr = 2 + 2 * (BITS >= 4) + 4 * (BITS == 8)
        HI: tl.constexpr = BITS - LO
        c = (_field(w0, w1, w2, w3, w4, w5, w6, w7, V // 4, 0, LO) >> (8 * (V % 4))) & ((1 << LO) - 1)
        if HI > 0:
            h = (_field(w0, w1, w2, w3, w4, w5, w6, w7, V // 4, LO, HI) >> (8 * (V % 4))) & ((1 << HI) - 1)
            c = c | (h << LO)
        return c

    @triton.jit
    def _weight(c, scale, BITS: tl.constexpr):
        """fp16((code - 2**(BITS - 1)) * scale) as float32: the code OR-ed into the mantissa of
        2**23 is the float 2**23 + code exactly; the product with the fp16 scale is exact in
        float32 and rounded to fp16 once (exl2.dequantize's rule)."""
        f = (c | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + (1 << (BITS - 1)))
        return (f * scale).to(tl.float16).to(tl.float32)

    @triton.jit
    def _word_row(wp, w_stride, mask, width, ROW: tl.constexpr, ROWS: tl.constexpr, row0):
        """Word row ROW of a run (masked off at or past the run's width: no memory traffic), or
        row0 where ROW >= ROWS (never read)."""
        if ROW < ROWS:
            return tl.load(wp + ROW * w_stride, mask=mask & (width > ROW), other=0)
        return row0

    @triton.jit
    def _load_words(wp, w_stride, mask, bits, ROWS: tl.constexpr):
        """Word rows 0 .. ROWS - 1 of a run for the program's columns, int32; rows at or past
        `bits` masked off (no memory traffic), rows past ROWS alias row 0 (never read)."""
        w0 = tl.load(wp, mask=mask, other=0)
        width = tl.zeros(mask.shape, tl.int32) + bits  # (the interpreter cannot AND a scalar bool)
        w1 = _word_row(wp, w_stride, mask, width, 1, ROWS, w0)
        w2 = _word_row(wp, w_stride, mask, width, 2, ROWS, w0)
        w3 = _word_row(wp, w_stride, mask, width, 3, ROWS, w0)
        w4 = _word_row(wp, w_stride, mask, width, 4, ROWS, w0)
        w5 = _word_row(wp, w_stride, mask, width, 5, ROWS, w0)
        w6 = _word_row(wp, w_stride, mask, width, 6, ROWS, w0)
        w7 = _word_row(wp, w_stride, mask, width, 7, ROWS, w0)
        return w0, w1, w2, w3, w4, w5, w6, w7

    @triton.jit
    def _run_loads(
        run_ptr, run, ok, w_ptr, w_off, w_stride, s_ptr, m_ptr, s_off, s_stride, m_off, cols, col_ok,
        MAXBITS: tl.constexpr,
    ):  # fmt: skip
        """Everything static a run of the GEMV reads: its bit width, its columns' scales and its
        `bits` word rows (rows up to MAXBITS, the layer's widest, masked by the run's width: no
        memory traffic past it), so that they can be issued a run ahead. ok False (past the
        slice): nothing is read."""
        word_row = tl.load(run_ptr + 2 * run, mask=ok, other=0)
        info = tl.load(run_ptr + 2 * run + 1, mask=ok, other=0)
        bits = info & 15
        c_ok = col_ok & (tl.zeros_like(cols) + ok.to(tl.int32) > 0)  # (the interpreter cannot AND a scalar bool)
        scale = _run_scale(s_ptr, m_ptr, s_off, s_stride, m_off, info >> 4, cols, c_ok)
        wp = w_ptr + w_off + word_row.to(tl.int64) * w_stride + cols
        w0, w1, w2, w3, w4, w5, w6, w7 = _load_words(wp, w_stride, c_ok, bits, MAXBITS)
        return bits, scale, w0, w1, w2, w3, w4, w5, w6, w7

    @triton.jit
    def _run_any(
        acc, bits, w0, w1, w2, w3, w4, w5, w6, w7, scale, xq, xf, ms, MAXBITS: tl.constexpr, ASM: tl.constexpr,
    ):  # fmt: skip
        """`_run_gemv` at the run's width (a uniform branch; widths above MAXBITS never occur)."""
        if bits == 4:
            acc = _run_gemv(acc, w0, w1, w2, w3, w4, w5, w6, w7, scale, xq, xf, ms, 4, ASM)
        elif bits == 3:
            acc = _run_gemv(acc, w0, w1, w2, w3, w4, w5, w6, w7, scale, xq, xf, ms, 3, ASM)
        elif bits == 2:
            acc = _run_gemv(acc, w0, w1, w2, w3, w4, w5, w6, w7, scale, xq, xf, ms, 2, ASM)
        elif bits == 5:
            if MAXBITS >= 5:
                acc = _run_gemv(acc, w0, w1, w2, w3, w4, w5, w6, w7, scale, xq, xf, ms, 5, ASM)
        elif bits == 6:
            if MAXBITS >= 6:
                acc = _run_gemv(acc, w0, w1, w2, w3, w4, w5, w6, w7, scale, xq, xf, ms, 6, ASM)
        else:
            if MAXBITS >= 8:
                acc = _run_gemv(acc, w0, w1, w2, w3, w4, w5, w6, w7, scale, xq, xf, ms, 8, ASM)
        return acc

    @triton.jit
    def _run_gemv(
        acc, w0, w1, w2, w3, w4, w5, w6, w7, scale, xq, xf, ms, BITS: tl.constexpr, ASM: tl.constexpr,
    ):  # fmt: skip
        """acc [MP, BN] += scale * sum over the run's 32 stored rows v of (code - offset) * x[v]:
        per 4 rows one word of code bytes and two `dp4a`, with x's int8 parts (xq: [MP, 16] words,
        `_quantize_kernel`); then dx * (dot1 + dot2 / 254) - offset * sum(x), xf: [MP, 2] (dx,
        sum of the quantized x). 8-bit bytes are code - 128: no offset left to subtract."""
        d1 = tl.zeros(acc.shape, dtype=tl.int32)
        d2 = tl.zeros(acc.shape, dtype=tl.int32)
        for j in tl.static_range(8):
            c = tl.broadcast_to(_code_bytes(w0, w1, w2, w3, w4, w5, w6, w7, j, BITS)[None, :], acc.shape)
            x1 = tl.load(xq + ms * 16 + j)
            x2 = tl.load(xq + ms * 16 + (8 + j))
            d1 = triton_gemv._dp4a(c, tl.broadcast_to(x1[:, None], acc.shape), d1, ASM)
            d2 = triton_gemv._dp4a(c, tl.broadcast_to(x2[:, None], acc.shape), d2, ASM)
        dx = tl.load(xf + ms * 2)
        xsum = tl.load(xf + ms * 2 + 1)
        OFFSET: tl.constexpr = (1 << (BITS - 1)) * (BITS != 8)
        dot = (d1.to(tl.float32) + d2.to(tl.float32) * (1.0 / 254.0)) * dx[:, None] - OFFSET * xsum[:, None]
        return acc + dot * scale[None, :]

    @triton.jit
    def _run_store(
        out_ptr, stride_o, o_cols, wp, w_stride, col_ok, scale, pp, j0, K, BITS: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        """The run's 32 stored rows v of the program's columns into out[perm[j0 + v], o_cols]."""
        w0, w1, w2, w3, w4, w5, w6, w7 = _load_words(wp, w_stride, col_ok, BITS, BITS)
        for v in tl.static_range(32):
            w = _weight(_code_at(w0, w1, w2, w3, w4, w5, w6, w7, v, BITS), scale, BITS)
            if EVEN_K:
                row = tl.load(pp + v)
                tl.store(out_ptr + row.to(tl.int64) * stride_o + o_cols, w.to(out_ptr.dtype.element_ty), mask=col_ok)
            else:
                ok = j0 + v < K
                row = tl.load(pp + v, mask=ok, other=0)
                tl.store(out_ptr + row.to(tl.int64) * stride_o + o_cols, w.to(out_ptr.dtype.element_ty),
                         mask=col_ok & (o_cols * 0 + j0 + v < K))  # fmt: skip

    @triton.jit
    def _tile(meta_ptr, tile_ptr, tile, BN: tl.constexpr, ALIGNED: tl.constexpr):
        """A program tile's shard and its planes' offsets: (shard, w_off, w_stride, s_off,
        s_stride, m_off, first output column, columns of the tile (index), column ok). ALIGNED
        (`EXL2Planes.aligned`): word offsets, strides and column counts are multiples of 4, told
        to the compiler so that each thread's four columns load as one 16-byte access."""
        shard = tl.load(tile_ptr + 2 * tile)
        c0 = tl.multiple_of(tl.load(tile_ptr + 2 * tile + 1), BN)
        meta = meta_ptr + shard * 8
        w_off = tl.load(meta).to(tl.int64)
        w_stride = tl.load(meta + 1)
        s_off = tl.load(meta + 3).to(tl.int64)
        s_stride = tl.load(meta + 4)
        m_off = tl.load(meta + 5)
        col0 = tl.load(meta + 6)
        n_cols = tl.load(meta + 7)
        if ALIGNED:
            w_off = tl.multiple_of(w_off, 4)
            w_stride = tl.multiple_of(w_stride, 4)
            col0 = tl.multiple_of(col0, 4)
            n_cols = tl.multiple_of(n_cols, 4)
        cols = c0 + tl.arange(0, BN)
        return shard, w_off, w_stride, s_off, s_stride, m_off, col0, cols, cols < n_cols

    @triton.jit
    def _run_scale(s_ptr, m_ptr, s_off, s_stride, m_off, g, cols, col_ok):
        """The fp16 scales of group g for the columns, as float32: fp16((qs + 1)**2 * smax)."""
        qs = (tl.load(s_ptr + s_off + g * s_stride + cols // 8, mask=col_ok, other=0) >> ((cols % 8) * 4)) & 15
        smax = tl.load(m_ptr + m_off + g).to(tl.float32)
        return (((qs + 1) * (qs + 1)).to(tl.float32) * smax).to(tl.float16).to(tl.float32)

    @triton.jit
    def _gemv_kernel(
        xq_ptr, xf_ptr, out_ptr, part_ptr, count_ptr, w_ptr, s_ptr, m_ptr, run_ptr, meta_ptr, tile_ptr,
        M, N, n_runs, runs_per_split,
        BN: tl.constexpr, MP: tl.constexpr, MAXBITS: tl.constexpr, SPLIT: tl.constexpr, ATOMIC: tl.constexpr,
        AHEAD: tl.constexpr, ALIGNED: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """out [M, N] = x [M, K] W^T: one program per tile of BN columns (of one shard) and slice
        of runs_per_split runs (grid axis 1; SPLIT: more than one slice, the last program of a
        tile to finish sums the float32 partials, which ATOMIC adds into one zeroed plane). Per
        run: its bit width picks the unpacking (a uniform branch), its group the scales; x comes
        quantized per run, in stored order (`_quantize_kernel`). The first run's loads are issued
        before `pdl.wait`; AHEAD: each next run's while the current one is multiplied (a
        program's few runs were a chain of dependent latencies: the run's table, then its
        words), else after it (where the second set of words costs residency: several tokens'
        accumulators, or the mid-width layers' grids of 16 programs per SM; `gemv_launch`)."""
        pdl.release(PDL)
        tile = tl.program_id(0)
        pid_k = tl.program_id(1)
        shard, w_off, w_stride, s_off, s_stride, m_off, col0, cols, col_ok = _tile(meta_ptr, tile_ptr, tile, BN, ALIGNED)
        ms = tl.arange(0, MP)
        m_ok = ms < M
        r0 = pid_k * runs_per_split
        r1 = tl.minimum(r0 + runs_per_split, n_runs)
        acc = tl.zeros((MP, BN), dtype=tl.float32)
        run = shard * n_runs + r0
        # the first run's weights are static: in flight before waiting for the kernel that writes x
        bits_n, scale_n, v0, v1, v2, v3, v4, v5, v6, v7 = _run_loads(
            run_ptr, run, r0 < r1, w_ptr, w_off, w_stride, s_ptr, m_ptr, s_off, s_stride, m_off, cols, col_ok,
            MAXBITS,
        )  # fmt: skip
        pdl.wait(PDL)  # x's parts come from the kernel before
        for r in range(r0, r1):
            bits, scale, w0, w1, w2, w3, w4, w5, w6, w7 = bits_n, scale_n, v0, v1, v2, v3, v4, v5, v6, v7
            if AHEAD:  # the next run's loads in flight while this one is multiplied
                bits_n, scale_n, v0, v1, v2, v3, v4, v5, v6, v7 = _run_loads(
                    run_ptr, run + 1, r + 1 < r1, w_ptr, w_off, w_stride, s_ptr, m_ptr, s_off, s_stride, m_off, cols,
                    col_ok, MAXBITS,
                )  # fmt: skip
            xq = xq_ptr + run * (16 * MP)
            xf = xf_ptr + run * (2 * MP)
            acc = _run_any(acc, bits, w0, w1, w2, w3, w4, w5, w6, w7, scale, xq, xf, ms, MAXBITS, ASM)
            if not AHEAD:
                bits_n, scale_n, v0, v1, v2, v3, v4, v5, v6, v7 = _run_loads(
                    run_ptr, run + 1, r + 1 < r1, w_ptr, w_off, w_stride, s_ptr, m_ptr, s_off, s_stride, m_off, cols,
                    col_ok, MAXBITS,
                )  # fmt: skip
            run += 1
        o_cols = col0 + cols
        mask = m_ok[:, None] & col_ok[None, :]
        at = ms[:, None] * N + o_cols[None, :]  # out and the partial planes are [M, N]
        if SPLIT:
            last, total = split_k.sum_slices(acc, part_ptr, count_ptr, tile, at, mask, pid_k, tl.num_programs(1),
                                             M * N, ASM, ATOMIC)  # fmt: skip
            if last:
                tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_kernel(
        x_ptr, perm_ptr, xq_ptr, xf_ptr, M, K, n_runs, total_runs, stride_xm,
        MP: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """x[m, perm_s[32 r + v]] for RB (shard, run) pairs r and token m (grid axis 1; 0 past K
        or M) as two int8 parts per run: q1 = round(x / dx), dx = amax / 127, and q2 =
        round((x / dx - q1) * 254) (about 15 bits of x). xq [S * n_runs, MP, 16] int32: q1's
        bytes in words 0-7, q2's in 8-15, stored row 4j + l in byte l of word j (the GEMV's code
        bytes); xf [S * n_runs, MP, 2]: dx and the sum of the quantized x."""
        pdl.release(PDL)
        rr = tl.program_id(0) * RB + tl.arange(0, RB)
        m = tl.program_id(1)
        lane = tl.arange(0, 4)[None, None, :]
        row = (rr % n_runs)[:, None, None] * 32 + tl.arange(0, 8)[None, :, None] * 4 + lane
        r_ok = rr < total_runs
        ok = r_ok[:, None, None] & (row < K) & (row * 0 + m < M)  # (the interpreter cannot AND a scalar bool)
        src = tl.load(perm_ptr + (rr // n_runs)[:, None, None] * K + row, mask=ok, other=0)  # static: before the wait
        pdl.wait(PDL)
        v = tl.load(x_ptr + m * stride_xm + src, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(v), axis=2), axis=1)
        v = v * tl.where(amax > 0, 127.0 / amax, 0.0)[:, None, None]
        f1 = v + 12582912.0  # v + 1.5 * 2**23: the float's low byte is round(v), two's complement
        r1 = f1 - 12582912.0
        f2 = (v - r1) * 254.0 + 12582912.0
        xsum = (tl.sum(tl.sum(r1, axis=2), axis=1) + tl.sum(tl.sum(f2 - 12582912.0, axis=2), axis=1) * (1.0 / 254.0))
        # the bytes go to disjoint bits of a word: summing them is OR-ing them
        q1 = tl.sum((f1.to(tl.int32, bitcast=True) & 0xFF) << (8 * lane), axis=2)
        q2 = tl.sum((f2.to(tl.int32, bitcast=True) & 0xFF) << (8 * lane), axis=2)
        at = (rr * MP + m)[:, None] * 16 + tl.arange(0, 8)[None, :]
        tl.store(xq_ptr + at, q1, mask=r_ok[:, None])
        tl.store(xq_ptr + at + 8, q2, mask=r_ok[:, None])
        dx = amax * (1.0 / 127.0)
        tl.store(xf_ptr + (rr * MP + m) * 2, dx, mask=r_ok)
        tl.store(xf_ptr + (rr * MP + m) * 2 + 1, xsum * dx, mask=r_ok)

    @triton.jit
    def _dequant_kernel(
        out_ptr, w_ptr, s_ptr, m_ptr, run_ptr, perm_ptr, meta_ptr, tile_ptr, K, n_runs, col_a, col_b, stride_o,
        BN: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED: tl.constexpr,
    ):  # fmt: skip
        """Output columns [col_a, col_b) of W^T, rows in input order, into out [K, col_b - col_a]
        (its dtype): one program per column tile and run."""
        tile = tl.program_id(0)
        r = tl.program_id(1)
        shard, w_off, w_stride, s_off, s_stride, m_off, col0, cols, col_ok = _tile(meta_ptr, tile_ptr, tile, BN, ALIGNED)
        o_cols = col0 + cols
        col_ok = col_ok & (o_cols >= col_a) & (o_cols < col_b)
        rp = run_ptr + (shard * n_runs + r) * 2
        word_row = tl.load(rp)
        info = tl.load(rp + 1)
        bits = info & 15
        scale = _run_scale(s_ptr, m_ptr, s_off, s_stride, m_off, info >> 4, cols, col_ok)
        wp = w_ptr + w_off + word_row.to(tl.int64) * w_stride + cols
        pp = perm_ptr + shard * K + r * 32
        j0 = r * 32
        oc = o_cols - col_a
        if bits == 4:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, scale, pp, j0, K, 4, EVEN_K)
        elif bits == 3:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, scale, pp, j0, K, 3, EVEN_K)
        elif bits == 5:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, scale, pp, j0, K, 5, EVEN_K)
        elif bits == 6:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, scale, pp, j0, K, 6, EVEN_K)
        elif bits == 2:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, scale, pp, j0, K, 2, EVEN_K)
        else:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, scale, pp, j0, K, 8, EVEN_K)


# ---------------------------------------------------------------------------- launches


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA of compute capability 8.0 or later, Triton, fp16 / bf16 activations."""
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


def gemv_launch(planes: EXL2Planes, mp: int = 1) -> tuple[int, bool]:
    """The GEMV's K slices and whether it loads a run ahead, by the layer's column tiles
    (GEMV_CLASSES; loads ahead only up to AHEAD_MAX_TOKENS tokens, MP padded)."""
    launch = planes.launches.get(mp)
    if launch is None:
        tiles, split = planes.tiles.shape[0], 1
        _, per_sm, ahead = next(c for c in GEMV_CLASSES if tiles <= c[0])
        while tiles * split * 2 <= per_sm * split_k.NUM_SMS_GUESS and planes.n_runs // (split * 2) >= MIN_RUNS:
            split *= 2
        planes.launches[mp] = launch = (split, ahead and mp <= AHEAD_MAX_TOKENS)
    return launch


def gemv_warps(block_n: int, mp: int) -> int:
    """Four columns a thread (16-byte loads) for one or two tokens; two from four tokens on, where
    each token's accumulators and dot products take registers (Llama-3-8B o_proj at 4 tokens: 128
    registers and a spill on 2 warps, 80 on 4)."""
    return max(1, min(4, block_n // (128 if mp <= 2 else 64)))


def gemv(
    x: torch.Tensor, planes: EXL2Planes, split: int | None = None, num_warps: int | None = None,
    ahead: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (contiguous, M <= 16 or so: registers grow with M) -> [M, N] in x's dtype; split,
    num_warps and ahead (loads a run ahead) override the launch rule."""
    m = x.shape[0]
    mp = max(1, triton.next_power_of_2(m))
    n_runs = planes.n_runs
    rule_split, rule_ahead = gemv_launch(planes, mp)
    split = split or rule_split
    ahead = rule_ahead if ahead is None else ahead
    tiles = planes.tiles.shape[0]
    cut = split_k.slices(n_runs, split, tiles, m, planes.n, x.device, atomic=True)
    total_runs = planes.meta.shape[0] * n_runs
    xq = torch.empty(total_runs, mp, 16, dtype=torch.int32, device=x.device)
    xf = torch.empty(total_runs, mp, 2, dtype=torch.float32, device=x.device)
    _quantize_kernel[(triton.cdiv(total_runs, QUANTIZE_RUNS), mp)](
        x, planes.perm, xq, xf, m, planes.k, n_runs, total_runs, x.stride(0), MP=mp, RB=QUANTIZE_RUNS, num_warps=1,
        **pdl.options(x),
    )  # fmt: skip
    out = torch.empty(m, planes.n, dtype=x.dtype, device=x.device)
    warps = num_warps or gemv_warps(planes.block_n, mp)
    _gemv_kernel[(tiles, cut.count)](
        xq, xf, out, cut.partials, cut.counters, planes.words, planes.scales, planes.smax, planes.runs, planes.meta,
        planes.tiles, m, planes.n, n_runs, cut.per,
        BN=planes.block_n, MAXBITS=planes.max_bits, MP=mp, SPLIT=cut.split, ATOMIC=cut.atomic, AHEAD=ahead,
        ALIGNED=planes.aligned, ASM=x.is_cuda, num_warps=warps, **pdl.options(x),
    )  # fmt: skip
    return out


def dequantize_into(planes: EXL2Planes, col_a: int, col_b: int, dst: torch.Tensor) -> None:
    """Output columns [col_a, col_b) of W^T (rows in input order) into dst [K, col_b - col_a]
    (its dtype: fp16 / bf16 on the GPU, float32 in the interpreter)."""
    _dequant_kernel[(planes.tiles.shape[0], planes.n_runs)](
        dst, planes.words, planes.scales, planes.smax, planes.runs, planes.perm, planes.meta, planes.tiles,
        planes.k, planes.n_runs, col_a, col_b, dst.stride(0),
        BN=planes.block_n, EVEN_K=planes.k % 32 == 0, ALIGNED=planes.aligned, num_warps=max(1, min(4, planes.block_n // 64)),
    )  # fmt: skip


def dequant_matmul(x: torch.Tensor, planes: EXL2Planes) -> torch.Tensor:
    """x [M, K] -> [M, N]: W^T dequantized into the shared scratch buffer (in column chunks where
    it is smaller), then cuBLAS."""
    m, k = x.shape
    n = planes.n
    buf = triton_gguf.scratch(x.device, x.dtype, n * k)
    chunk = max(1, buf.numel() // k)
    if n <= chunk:
        wt = buf[: n * k].view(k, n)
        dequantize_into(planes, 0, n, wt)
        return x @ wt
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        wt = buf[: (b - a) * k].view(k, b - a)
        dequantize_into(planes, a, b, wt)
        out[:, a:b] = x @ wt
    return out


def matmul(x: torch.Tensor, planes: EXL2Planes) -> torch.Tensor:
    """x [M, K] bf16 / fp16 (contiguous) -> [M, N] in x's dtype: the GEMV up to GEMV_MAX_TOKENS,
    dequantize + cuBLAS above (module docstring)."""
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return gemv(x, planes)
    return dequant_matmul(x, planes)


def reserve_scratch(planes: EXL2Planes, device: torch.device, dtype: torch.dtype) -> None:
    """Size the shared scratch buffer and the GEMV's zeroed sum plane at load (before KV-cache
    sizing and CUDA-graph capture)."""
    triton_gguf.scratch(device, dtype, planes.n * planes.k)
    split_k.reserve_zeros(device, GEMV_MAX_TOKENS * planes.n)
