"""Triton kernels of the integer-weight family (int_layout.py: W4A16 / W8A16 for GPTQ, AWQ and
compressed-tensors) on CUDA, and `matmul`, the one entry point a linear layer calls every step.

Data flow: a format module packs its checkpoint once (`int_layout.pack`), checks `supports`, then
calls `matmul(x, planes, spec)` for every forward; by the number of tokens M:
  - M <= GEMV_MAX_TOKENS (batch-1 decode, and 2 tokens): `_gemv_kernel`, integer dot products
    (`dp4a`) of the codes with x quantized to two int8 parts per tile group
    (paphos/layers/x_int8.py: about 15 bits of x), in the layout the GGUF GEMV reads for 4-bit
    and 8-bit codes, so x's producer can write it (`int8_layout`; x_int8.attached). Scales and
    zero points apply once per tile group: s * (sum(code * x) - zero * sum(x)). With act-order,
    `_permute_quantize_kernel` gathers x[:, perm] straight into registers and quantizes it in
    the same launch (one launch per layer and step; without act-order x's producer writes them).
  - M <= I8_MAX_TOKENS (32 with 4-bit codes, 64 with 8-bit), where every 128 values of K lie in
    one scale group: triton_int_i8.py, x quantized to two int8 parts per 128 values and the
    codes multiplied on the int8 tensor cores, unpacked in registers (3 instructions per 8
    codes) and fed to wgmma from there.
  - M <= FUSED_MAX_TOKENS: `_gemm_kernel`, dequantization fused with `tl.dot` (tensor cores,
    wgmma) on out^T = W x^T, so the weights are the large operand. 4-bit codes are read as bytes
    and become 16-bit floats without integer-to-float conversions (`_bytes4`, inline PTX on
    four bytes at a time): PRMT spreads two bytes into the halves of a register, a code OR-ed
    into 128.0 (bf16 0x4300; fp16 1024.0, 0x6400) is 128 + code exactly, one packed subtraction
    of 128 + zero gives code - zero exactly; the scale multiplies the float32 product of a K step
    that lies in one group (`SCALE_AFTER`), else once per value in 16-bit (`_tile4`): 12
    instructions per 8 codes, about 4 per code in the loop (the nibble-wise `_nibbles` path
    that multiplied by the scale first took 6.6). Split-K programs write float32 partials and
    the last one to finish a tile (an atomic counter it resets) sums them: no memset, no cast
    launch. `gemm_config` picks tiles, warps and K slices per shape. With act-order x is
    gathered by one launch first.
  - above: `_dequant_kernel` writes the weights in x's dtype into the scratch buffer shared with
    the GGUF family (triton_gguf.scratch), then cuBLAS (F.linear; x gathered by perm first).
Every kernel is CUDA-graph safe (no host syncs; buffers sized by shapes only); the decode-path
kernels use programmatic dependent launch (paphos/layers/pdl.py).

Measured on the H200 (benchmarks/bench_int_gpu.py; a Llama-3-8B layer's q|k|v, o, gate|up and
down summed; CUDA-graph replays, weights read from memory; 4-bit groups of 128, symmetric):
batch 1 43.2 us against bf16 cuBLAS 116.6 (2.70 x; 38.7 us = 3.2 x when x's producer writes
its int8 parts, gate|up at 78-82 % of copy bandwidth, q|k|v / down 55-63 %, o 41-49 %: too few
programs), act-order the same; asymmetric 2.46 x. 16 tokens: 94.2 us against 117.8 (1.25 x;
the fused kernel before the byte unpacking and the per-shape rule: 142.5 us, 0.84 x), 64
tokens 0.96 x (0.61 x before). The fused kernel still streams only 18-34 % of copy bandwidth
at 16 tokens (gate|up best): neither more pipeline stages, nor 128-row tiles, nor L2
prefetches issued steps ahead or before `pdl.wait` moved it (measured and dropped), so it is
bound inside the multiprocessor (Triton's per-step barriers, the shared-memory round trip of
the dequantized tile, the wgmma wait), not by memory latency. 512 / 2048 tokens: 1.51 / 1.15 x
bf16's time (the dequantization's write and re-read of bf16 weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paphos.layers import pdl, x_int8
from paphos.layers.x_int8_blocks import BlockLayout
from paphos.quant.kernels import int_layout
from paphos.quant.kernels.int_layout import BLOCK_VALUES, TILE_WORDS, IntSpec

try:
    import triton
    import triton.language as tl

    from paphos.quant.gguf import triton_gemv, triton_gguf
    from paphos.quant.kernels import split_k, triton_int_i8
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None

# ---------------------------------------------------------------------------- Triton kernels

if triton is not None:
    _TW = tl.constexpr(TILE_WORDS)
    _BV = tl.constexpr(BLOCK_VALUES)

    @triton.jit
    def _nibbles(words, zero, scale, FP16: tl.constexpr, PACKED: tl.constexpr):
        """Tile-group words [BN, T, 4] -> [BN, T, 4, 8] weights: element p of word w is (code p -
        zero) * scale; zero and scale broadcast to it (float32). PACKED (inline PTX): in the
        16-bit float type (fp16 if FP16, else bf16), two elements at a time (whichever two Triton
        packs: each brings its own code at bits 0-3): their low halves joined (PRMT), OR-ed into
        128.0 (bf16 0x4300; fp16 1024.0, 0x6400) = 128 + code exactly (LOP3), minus 128 + zero,
        times the scale: (code - zero) * scale rounded once, with packed 16-bit math. Else in
        float32."""
        src = words[:, :, :, None] >> (4 * tl.arange(0, 8))[None, None, None, :]
        if PACKED:
            dt = tl.float16 if FP16 else tl.bfloat16
            zm = (zero + (1024.0 if FP16 else 128.0)).to(dt)  # broadcast by the asm
            sc = scale.to(dt)
            if FP16:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 t; prmt.b32 t, $1, $2, 0x5410; lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; "
                    "sub.rn.f16x2 t, t, $3; mul.rn.f16x2 $0, t, $4; }", "=r,r,r,r,r", [src, zm, sc], dtype=dt,
                    is_pure=True, pack=2,
                )  # fmt: skip
            else:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 t; prmt.b32 t, $1, $2, 0x5410; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; "
                    "sub.rn.bf16x2 t, t, $3; mul.rn.bf16x2 $0, t, $4; }", "=r,r,r,r,r", [src, zm, sc], dtype=dt,
                    is_pure=True, pack=2,
                )  # fmt: skip
        else:
            return ((src & 0xF).to(tl.float32) - zero) * scale

    @triton.jit
    def _bytes4(b, zm, sc, FP16: tl.constexpr, ASM: tl.constexpr, SCALED: tl.constexpr):
        """Bytes of 4-bit codes b (uint8, any shape) -> (lo, hi): the code in each byte's low and
        high nibble, minus its zero point (zm: 128 + zero on the GPU, the zero itself in the
        interpreter), times sc if SCALED. GPU (ASM): 16-bit floats, four bytes (one register) per
        asm instance: PRMT puts bytes 0 / 1 (2 / 3) into the two halves, LOP3 ORs their nibble
        into 128.0 (bf16 0x4300; fp16 1024.0, 0x6400) = 128 + code exactly, one packed
        subtraction makes code - zero (exact), one packed multiplication by the scale rounds it
        once: 12 (16 SCALED) instructions per 8 codes. Output element j comes from input byte j
        whichever bytes Triton packs together. Interpreter: float32."""
        if ASM:
            dt = tl.float16 if FP16 else tl.bfloat16
            magic: tl.constexpr = "0x64006400" if FP16 else "0x43004300"
            op: tl.constexpr = "f16x2" if FP16 else "bf16x2"
            body: tl.constexpr = (
                "prmt.b32 a, $4, $4, 0x1100; prmt.b32 b, $4, $4, 0x3322; "
                "lop3.b32 $0, a, 0x000F000F, " + magic + ", 0xEA; lop3.b32 $1, b, 0x000F000F, " + magic + ", 0xEA; "
                "shr.u32 a, a, 4; shr.u32 b, b, 4; "
                "lop3.b32 $2, a, 0x000F000F, " + magic + ", 0xEA; lop3.b32 $3, b, 0x000F000F, " + magic + ", 0xEA; "
                "sub.rn." + op + " $0, $0, $5; sub.rn." + op + " $1, $1, $6; "
                "sub.rn." + op + " $2, $2, $5; sub.rn." + op + " $3, $3, $6; "
            )  # fmt: skip
            if SCALED:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 a, b; " + body + "mul.rn." + op + " $0, $0, $7; mul.rn." + op + " $1, $1, $8; "
                    "mul.rn." + op + " $2, $2, $7; mul.rn." + op + " $3, $3, $8; }",
                    "=r,=r,=r,=r,r,r,r,r,r", [b, zm.to(dt), sc.to(dt)], dtype=(dt, dt), is_pure=True, pack=4,
                )  # fmt: skip
            else:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 a, b; " + body + "}", "=r,=r,=r,=r,r,r,r", [b, zm.to(dt)], dtype=(dt, dt),
                    is_pure=True, pack=4,
                )  # fmt: skip
        else:
            lo = (b & 0xF).to(tl.float32) - zm
            hi = ((b >> 4) & 0xF).to(tl.float32) - zm
            if SCALED:
                lo = lo * sc
                hi = hi * sc
            return lo, hi

    @triton.jit
    def _tile4(
        wb_ptr, s_ptr, z_ptr, rows, row_ok, k0, N, stride_wb, group_shift,
        HAS_Z: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE_GROUP: tl.constexpr, FP16: tl.constexpr,
        ASM: tl.constexpr, SCALED: tl.constexpr, TT: tl.constexpr,
    ):  # fmt: skip
        """4-bit weights [BN, BK] of rows `rows`, K values k0 .. k0 + BK in K order, read as bytes
        (wb_ptr: the qweight plane as uint8, stride_wb bytes per row; one 16-byte load per row
        and tile group): (code - zero), times the scale if SCALED (else the caller scales the
        product: ONE_GROUP required), through `_bytes4`. Byte 4w + b of a tile group holds codes
        2b (low nibble) and 2b + 1 of word w, values p * 4 + w of the group: joined, reshaped and
        permuted into K order (one layout conversion, which the dot operand needs anyway)."""
        T: tl.constexpr = BK // 32
        c = tl.arange(0, BK // 2)  # byte c of the tile's row: tile group c // 16
        at = int_layout.plane_offset(rows.to(tl.int64)[:, None], (k0 // 2 + c)[None, :], stride_wb, TT,
                                     _BV // 2)  # fmt: skip
        b = tl.load(wb_ptr + at, mask=row_ok[:, None], other=0)
        if ONE_GROUP:
            at = (k0 >> group_shift).to(tl.int64) * N + rows
            scale = tl.load(s_ptr + at, mask=row_ok, other=0).to(tl.float32)[:, None]
            if HAS_Z:
                zero = tl.load(z_ptr + at, mask=row_ok, other=0).to(tl.float32)[:, None]
        else:
            at = ((k0 + c * 2) >> group_shift).to(tl.int64)[None, :] * N + rows[:, None]
            scale = tl.load(s_ptr + at, mask=row_ok[:, None], other=0).to(tl.float32)
            if HAS_Z:
                zero = tl.load(z_ptr + at, mask=row_ok[:, None], other=0).to(tl.float32)
        if not HAS_Z:
            zero = tl.full(scale.shape, 8.0, tl.float32)
        if ASM:
            zero = zero + (1024.0 if FP16 else 128.0)
        lo, hi = _bytes4(b, zero, scale, FP16, ASM, SCALED)  # [BN, BK / 2] each
        v = tl.reshape(tl.join(lo, hi), (BN, T, 4, 8))  # [BN, T, w, p]
        return tl.reshape(tl.permute(v, (0, 1, 3, 2)), (BN, BK))

    @triton.jit
    def _dequant_tile(
        w_ptr, s_ptr, z_ptr, rows, row_ok, k0, N, stride_w, group_shift,
        BITS: tl.constexpr, HAS_Z: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE_GROUP: tl.constexpr,
        FP16: tl.constexpr, ASM: tl.constexpr, PACKED: tl.constexpr, TT: tl.constexpr,
    ):  # fmt: skip
        """Weights [BN, BK] of rows `rows`, K values k0 .. k0 + BK in K order: in the 16-bit float
        type on the GPU (ASM), else float32 (the interpreter); 4-bit codes through packed 16-bit
        math where PACKED (`_nibbles`). One 16-byte load per row and tile group;
        the scales (and zeros) of the tile are BN contiguous values per group (ONE_GROUP: the
        tile lies in one group), loads the software pipeline can issue ahead."""
        TV: tl.constexpr = _TW * 32 // BITS  # values per tile group
        T: tl.constexpr = BK // TV
        r = rows.to(tl.int64)[:, None, None]
        m3 = row_ok[:, None, None]
        t = k0 // TV + tl.arange(0, T)
        at = (t * _TW)[None, :, None] + tl.arange(0, _TW)[None, None, :]
        words = tl.load(w_ptr + int_layout.plane_offset(r, at, stride_w, TT, _BV * BITS // 32),
                        mask=m3, other=0)  # fmt: skip
        if ONE_GROUP:
            at = (k0 >> group_shift).to(tl.int64) * N + rows
            scale = tl.load(s_ptr + at, mask=row_ok, other=0).to(tl.float32)[:, None, None, None]
            if HAS_Z:
                zero = tl.load(z_ptr + at, mask=row_ok, other=0).to(tl.float32)[:, None, None, None]
        else:
            at = ((t * TV) >> group_shift).to(tl.int64)[None, :] * N + rows[:, None]
            scale = tl.load(s_ptr + at, mask=row_ok[:, None], other=0).to(tl.float32)[:, :, None, None]
            if HAS_Z:
                zero = tl.load(z_ptr + at, mask=row_ok[:, None], other=0).to(tl.float32)[:, :, None, None]
        if not HAS_Z:
            zero = tl.full(scale.shape, 1 << (BITS - 1), tl.float32)
        if BITS == 4:
            v = _nibbles(words, zero, scale, FP16, ASM and PACKED)  # [BN, T, w, p]
        else:
            p = tl.arange(0, 4)[None, None, None, :]
            # the signed byte q - 128 -> 2^23 + q as a float's bits, minus 2^23 + zero: exact
            b = ((words[:, :, :, None] >> (8 * p)) & 0xFF) ^ 0x4B000080
            v = (b.to(tl.float32, bitcast=True) - (8388608.0 + zero)) * scale
        if ASM:
            v = v.to(tl.float16 if FP16 else tl.bfloat16)
        # code p of word w is value p * 4 + w of its tile group
        return tl.reshape(tl.permute(v, (0, 1, 3, 2)), (BN, BK))

    @triton.jit
    def _gemm_kernel(
        x_ptr, out_ptr, part_ptr, count_ptr, w_ptr, s_ptr, z_ptr, M, N, K, stride_xm, stride_om,
        stride_w, group_shift, iters_per_split,
        BITS: tl.constexpr, HAS_Z: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr, ONE_GROUP: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, PACKED: tl.constexpr,
        BYTES: tl.constexpr, SCALE_AFTER: tl.constexpr, PDL: tl.constexpr, TT: tl.constexpr,
    ):  # fmt: skip
        """out [M, N] = x [M, K] W^T for BN rows and BM tokens per program, a slice of K per
        program along grid axis 1 (SPLIT: more than one slice; the last program of a tile to
        finish sums the float32 partials). BYTES (4-bit): the weights through `_tile4` (w_ptr
        the plane as bytes, stride_w in bytes); SCALE_AFTER (BYTES and ONE_GROUP): the tile's
        product with x is taken on (code - zero) and scaled per row after the dot, in float32."""
        pdl.release(PDL)
        pdl.wait(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        FP16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
        rows = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < N
        it0 = pid_k * iters_per_split
        it1 = tl.minimum(it0 + iters_per_split, K // BK)
        ms = pid_m * BM + tl.arange(0, BM)
        m_ok = ms < M
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        x_rows = x_ptr + ms.to(tl.int64)[None, :] * stride_xm
        if SCALE_AFTER:
            s_next = tl.load(s_ptr + ((it0 * BK) >> group_shift).to(tl.int64) * N + rows, mask=row_ok, other=0)
        for it in range(it0, it1):
            k0 = it * BK
            if BYTES:
                w = _tile4(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, N, stride_w, group_shift, HAS_Z, BN, BK, ONE_GROUP,
                           FP16, ASM, not SCALE_AFTER, TT)  # fmt: skip
            else:
                w = _dequant_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, N, stride_w, group_shift, BITS, HAS_Z, BN,
                                  BK, ONE_GROUP, FP16, ASM, PACKED, TT)  # fmt: skip
            x = tl.load(x_rows + (k0 + tl.arange(0, BK))[:, None], mask=m_ok[None, :], other=0.0)  # [BK, BM]
            if not ASM:  # the interpreter multiplies bf16 as raw integers: float32 operands
                x = x.to(tl.float32)
            if SCALE_AFTER:  # this step's scales were loaded a step ahead (not a dot operand: not pipelined)
                s_cur = s_next
                k1 = tl.minimum(it + 1, it1 - 1) * BK
                s_next = tl.load(s_ptr + (k1 >> group_shift).to(tl.int64) * N + rows, mask=row_ok, other=0)
                acc += tl.dot(w, x) * s_cur.to(tl.float32)[:, None]
            else:
                acc = tl.dot(w, x, acc)
        split_k.store_tile(acc, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om,
                           pid_m * tl.num_programs(0) + pid_n, pid_k, tl.num_programs(1), SPLIT, ASM)  # fmt: skip

    @triton.jit
    def _dequant_kernel(
        out_ptr, w_ptr, s_ptr, z_ptr, row0, row_end, N, stride_w, group_shift, stride_o,
        BITS: tl.constexpr, HAS_Z: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE_GROUP: tl.constexpr,
        ASM: tl.constexpr, TT: tl.constexpr,
    ):  # fmt: skip
        """Rows [row0, row_end) of the weights, in the kernel's K order, into out (its dtype)."""
        rows = row0 + tl.program_id(0) * BN + tl.arange(0, BN)
        row_ok = rows < row_end
        k0 = tl.program_id(1) * BK
        FP16: tl.constexpr = out_ptr.dtype.element_ty == tl.float16
        w = _dequant_tile(w_ptr, s_ptr, z_ptr, rows, row_ok, k0, N, stride_w, group_shift, BITS, HAS_Z, BN, BK,
                          ONE_GROUP, FP16, ASM, True, TT)  # fmt: skip
        o = out_ptr + (rows - row0).to(tl.int64)[:, None] * stride_o + (k0 + tl.arange(0, BK))[None, :]
        tl.store(o, w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _gemv_loads(
        w_ptr, s_ptr, z_ptr, rows, N, t, t_ok, g, stride_w, HAS_Z: tl.constexpr, BITS: tl.constexpr,
        TT: tl.constexpr,
    ):  # fmt: skip
        """A block of rows' code words [BN, T, 4] and their tile groups' scales and zeros [BN, T]
        (g: each tile group's scale group)."""
        r = rows.to(tl.int64)[:, None]
        m2 = (rows < N)[:, None] & t_ok[None, :]
        at = (t * _TW)[None, :, None] + tl.arange(0, _TW)[None, None, :]
        words = tl.load(w_ptr + int_layout.plane_offset(r[:, :, None], at, stride_w, TT, _BV * BITS // 32),
                        mask=m2[:, :, None], other=0)  # fmt: skip
        scale = tl.load(s_ptr + g[None, :] * N + r, mask=m2, other=0)
        zero = scale
        if HAS_Z:
            zero = tl.load(z_ptr + g[None, :] * N + r, mask=m2, other=0)
        return words, scale, zero

    @triton.jit
    def _gemv_rows(
        words, scale, zero, q1a, q1b, q2a, q2b, dx, xsum, rows, N, out_ptr,
        BITS: tl.constexpr, HAS_Z: tl.constexpr, ASM: tl.constexpr,
    ):  # fmt: skip
        """A block of rows' outputs for one token: per tile group the integer dots of the stored
        codes (q, or q - 128 for 8 bits) with x's two int8 parts, then s * (dot - (zero - stored
        offset) * sum(x)), summed over K."""
        ca, cb = triton_gemv._code_bytes(words, words, BITS, 0)
        dot = (triton_gemv._int8_dot(ca, cb, q1a, q1b, BITS, ASM).to(tl.float32) * dx[None, :]
               + triton_gemv._int8_dot(ca, cb, q2a, q2b, BITS, ASM).to(tl.float32)
               * (dx * (1.0 / 254.0))[None, :])  # fmt: skip
        stored: tl.constexpr = 128 if BITS == 8 else 0
        if HAS_Z:
            dot -= (zero.to(tl.float32) - stored) * xsum[None, :]
        elif (1 << (BITS - 1)) != stored:
            dot -= ((1 << (BITS - 1)) - stored) * xsum[None, :]
        y = tl.sum(scale.to(tl.float32) * dot, axis=1)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)

    @triton.jit
    def _gemv_kernel(
        q_ptr, f_ptr, out_ptr, w_ptr, s_ptr, z_ptr, M, N, K, stride_w, stride_om, group_shift,
        BITS: tl.constexpr, HAS_Z: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, RPP: tl.constexpr,
        MULTI: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, TT: tl.constexpr,
    ):  # fmt: skip
        """One program per RPP rows and the whole of K (T tile groups, a power of two >= K / TV).
        One token: x's int8 parts stay in registers, BN rows at a time, software-pipelined as the
        GGUF GEMV (the next row block's loads issued before this block's sums, the first block's
        before waiting for the kernels that write x). MULTI (M tokens, RPP = BN): the block of
        weights is read once, then multiplied with each token's parts in turn (x of all tokens
        quantized as one vector: token m's tile groups follow token m - 1's; from L1)."""
        pdl.release(PDL)
        TV: tl.constexpr = _TW * 32 // BITS
        t = tl.arange(0, T)
        t_ok = t < K // TV
        g = ((t * TV) >> group_shift).to(tl.int64)
        rows = tl.program_id(0) * RPP + tl.arange(0, BN)
        words, scale, zero = _gemv_loads(w_ptr, s_ptr, z_ptr, rows, N, t, t_ok, g, stride_w, HAS_Z, BITS, TT)
        pdl.wait(PDL)
        n_groups = M * (K // TV)
        if MULTI:
            for m in range(0, M):
                q1a, q1b, q2a, q2b, dx, xsum = x_int8.load_groups(
                    q_ptr, f_ptr, t + m * (K // TV), t_ok, n_groups, BITS, _TW
                )
                _gemv_rows(words, scale, zero, q1a, q1b, q2a, q2b, dx, xsum, rows, N, out_ptr + m * stride_om, BITS,
                           HAS_Z, ASM)  # fmt: skip
        else:
            q1a, q1b, q2a, q2b, dx, xsum = x_int8.load_groups(q_ptr, f_ptr, t, t_ok, n_groups, BITS, _TW)
            for rb in tl.static_range(0, RPP, BN):
                if rb + BN < RPP:
                    words_n, scale_n, zero_n = _gemv_loads(w_ptr, s_ptr, z_ptr, rows + BN, N, t, t_ok, g, stride_w,
                                                           HAS_Z, BITS, TT)  # fmt: skip
                _gemv_rows(
                    words, scale, zero, q1a, q1b, q2a, q2b, dx, xsum, rows, N, out_ptr, BITS, HAS_Z, ASM
                )
                if rb + BN < RPP:
                    words, scale, zero = words_n, scale_n, zero_n
                    rows += BN

    @triton.jit
    def _permute_quantize_kernel(
        x_ptr, perm_ptr, q_ptr, f_ptr, K, n_groups,
        LO: tl.constexpr, TB: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """x[:, perm] of every token (x [M, K] flat; tile group t of token m is group m * K / TV
        + t of the flat vector) quantized into its int8 parts, TB tile groups per program, one
        per lane: the values are gathered straight into registers ([TB, TW, PER]: code p of
        word w), the arithmetic is x_int8's `_quantize_x` (the GEMV reads what
        `x_int8.quantize` would write for x[:, perm], up to the summation order of sum(x))."""
        pdl.release(PDL)
        PER: tl.constexpr = 32 // LO
        t = tl.program_id(0) * TB + tl.arange(0, TB)
        t_ok = t < n_groups
        p = tl.arange(0, PER)[None, None, :]
        xk = (t * (_TW * PER))[:, None, None] + tl.arange(0, _TW)[None, :, None] + p * _TW  # flat index
        m3 = t_ok[:, None, None]
        cols = tl.load(perm_ptr + xk % K, mask=m3, other=0)  # perm is static: loaded before the wait
        pdl.wait(PDL)
        v = tl.load(x_ptr + (xk // K) * K + cols, mask=m3, other=0).to(tl.float32)
        amax_t = tl.max(tl.max(tl.abs(v), axis=2), axis=1)
        v = v * tl.where(amax_t > 0, 127.0 / amax_t, 0.0)[:, None, None]
        f1, f2 = x_int8.rounded_parts(v)
        sum1 = tl.sum(tl.sum(f1 - 12582912.0, axis=2), axis=1)
        sum2 = tl.sum(tl.sum(f2 - 12582912.0, axis=2), axis=1)
        b1 = f1.to(tl.int32, bitcast=True) & 0xFF
        b2 = f2.to(tl.int32, bitcast=True) & 0xFF
        # the bytes go to disjoint bits of a word: summing them is OR-ing them
        if LO == 8:
            q1a = tl.sum(b1 << (8 * p), axis=2)
            q2a = tl.sum(b2 << (8 * p), axis=2)
            q1b, q2b = q1a, q2a
        else:
            odd = (p % 2) == 1
            q1a = tl.sum(tl.where(odd, 0, b1 << (8 * (p // 2))), axis=2)
            q2a = tl.sum(tl.where(odd, 0, b2 << (8 * (p // 2))), axis=2)
            q1b = tl.sum(tl.where(odd, b1 << (8 * (p // 2)), 0), axis=2)
            q2b = tl.sum(tl.where(odd, b2 << (8 * (p // 2)), 0), axis=2)
        dx = amax_t * (1.0 / 127.0)
        xsum = (sum1 + sum2 * (1.0 / 254.0)) * dx
        x_int8.store_parts(q_ptr, f_ptr, t, t_ok, n_groups, q1a, q1b, q2a, q2b, dx, xsum, LO, _TW)


# ---------------------------------------------------------------------------- launch configuration


@dataclass(frozen=True)
class GemmConfig:
    """`_gemm_kernel`'s launch: tile rows (BN), tokens (BM), K per step (BK), K slices."""

    block_n: int = 64
    block_m: int = 16
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    packed_math: bool = True  # 4-bit codes through packed 16-bit PTX (False: float32 math)
    bytes_unpack: bool = True  # 4-bit: `_tile4` (bytes, 12-16 instructions per 8 codes) over `_nibbles`
    scale_after: bool = True  # with bytes_unpack, where a K step lies in one group: scale after the dot


@dataclass(frozen=True)
class GemvConfig:
    """`_gemv_kernel`'s launch: rows per step, warps, rows per program (one token; with several
    each program takes one step of block_n rows)."""

    block_n: int = 1
    num_warps: int = 4
    rows_per_program: int = 4


# Up to this many tokens the integer-dot GEMV runs (weights read once for all of them; it lost
# to the fused kernel from 4 tokens on the H200, bench_int_gpu.py).
GEMV_MAX_TOKENS = 2
# Up to this many tokens (by code width) the int8 tensor-core kernel runs where it supports the
# layer (triton_int_i8.py): the H100 sweeps' crossover with the fused kernel on a Llama-3-8B
# layer (bench_int_gpu.py; 4-bit at 32 tokens: 108 against 120 us, at 64: 178 against 128; 8-bit
# at 64: 144 against 279).
I8_MAX_TOKENS = {4: 32, 8: 64}
# Up to this many tokens (by code width) the fused kernel runs; above, dequantize + cuBLAS: the
# H200 crossover on a Llama-3-8B layer's four linears (bench_int_gpu.py).
FUSED_MAX_TOKENS = {4: 128, 8: 64}


def supports(spec: IntSpec, device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA of compute capability 9.0 or later (packed bf16 arithmetic in PTX), Triton, fp16 / bf16
    activations, and a spec the layout holds (`IntSpec.invalid`)."""
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and spec.invalid() is None
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def int8_layout(spec: IntSpec) -> x_int8.Int8Layout:
    """The layout in which the batch-1 GEMV reads x as int8 parts (what x's producer may write)."""
    return x_int8.Int8Layout(spec.bits, TILE_WORDS)



def int8_block_layout(spec: IntSpec) -> BlockLayout | None:
    """The layout in which the int8 tensor-core GEMM reads x at the token counts it runs at (what
    x's producer may write), if it takes this spec: not with act-order (x is gathered first)."""
    if spec.has_perm or not triton_int_i8.supports(spec):
        return None
    return triton_int_i8.x_layout(spec.bits, GEMV_MAX_TOKENS + 1, I8_MAX_TOKENS[spec.bits])


def fit_block_k(block_k: int, spec: IntSpec) -> int:
    """The largest power of two <= block_k dividing K (a multiple of 32); it lies within one scale
    group or covers whole ones, since group sizes are powers of two or K."""
    while block_k > 32 and spec.in_features % block_k:
        block_k //= 2
    return block_k


def gemm_config(spec: IntSpec, m: int) -> GemmConfig:
    """`_gemm_kernel`'s launch at M tokens, by the rule the H200 sweep's winners on the Llama-3-8B
    shapes follow (bench_int_gpu.py, 4-bit groups of 128; tokens padded to a power of two >= 16):
      - up to 32 tokens, 4-bit: rows longer than 8192 (down): 64 rows x 64 K values per step, 4
        stages, K split while the grid stays within 8 programs per SM; 16384 rows or more
        (gate|up): 64 x 128, split until it holds 4 per SM; else (q|k|v, o): 128 x 128, split
        while it stays within 3 per SM, on 8 warps where it holds at most 2 per SM (o), else 4;
      - 64 tokens, 4-bit: 64 x 64 per step, 4 stages, K split while the grid stays within 4
        programs per SM;
      - otherwise (8-bit, 128 tokens): 64 x 128, split towards 4 programs per SM (2 from 64 tokens).
    Each K slice keeps at least two steps (four for the last rule)."""
    bm = min(128, max(16, triton.next_power_of_2(m)))
    n, k = spec.out_features, spec.in_features
    m_tiles = math.ceil(m / bm)

    def split_to(bn: int, bk: int, target: float, within: bool, min_steps: int) -> int:
        tiles, steps, split = math.ceil(n / bn) * m_tiles, k // bk, 1
        while steps // (split * 2) >= min_steps and (
            tiles * split * 2 <= target * split_k.NUM_SMS_GUESS if within else tiles * split < target * split_k.NUM_SMS_GUESS
        ):
            split *= 2
        return split

    if spec.bits == 4 and bm <= 32:
        if k > 8192:
            bk = fit_block_k(64, spec)
            return GemmConfig(64, bm, bk, split_to(64, bk, 8, True, 2), 4, 4)
        bk = fit_block_k(128, spec)
        if n >= 16384:
            return GemmConfig(64, bm, bk, split_to(64, bk, 4, False, 2), 4, 3)
        split = split_to(128, bk, 3, True, 2)
        warps = 8 if math.ceil(n / 128) * m_tiles * split <= 2 * split_k.NUM_SMS_GUESS else 4
        return GemmConfig(128, bm, bk, split, warps, 3)
    if spec.bits == 4 and bm == 64:
        bk = fit_block_k(64, spec)
        return GemmConfig(64, bm, bk, split_to(64, bk, 4, True, 2), 4, 4)
    bk = fit_block_k(128, spec)
    return GemmConfig(64, bm, bk, split_to(64, bk, 4 if bm <= 32 else 2, False, 4), 4, 3)


def gemv_config(spec: IntSpec, m: int = 1) -> GemvConfig:
    """`_gemv_kernel`'s launch, by rule from the H200 sweep (bench_int_gpu.py). One token: one
    row per step and four per program; 8 warps and 8 rows where a row holds more than 256 tile
    groups of 8-bit codes (each thread's share of x halves, as in the GGUF GEMV). Several: 4-bit
    blocks of 2 rows on 8 warps; 8-bit blocks of 4 rows on 4 warps, of 2 past 256 tile groups
    (where 4 rows spill registers)."""
    long_8bit = spec.bits == 8 and spec.in_features // spec.tile_values > 256
    if m > 1:
        if spec.bits == 4:
            return GemvConfig(2, 8, 2)
        return GemvConfig(2, 4, 2) if long_8bit else GemvConfig(4, 4, 4)
    return GemvConfig(1, 8, 8) if long_8bit else GemvConfig()


# ---------------------------------------------------------------------------- launches



def _zeros_plane(planes: dict[str, torch.Tensor]) -> torch.Tensor:
    return planes.get("zeros", planes["scales"])


def _asm(x: torch.Tensor) -> bool:
    """Inline PTX (packed 16-bit math, dp4a, fences) on the GPU; plain operations in the
    interpreter (TRITON_INTERPRET=1, CPU tensors)."""
    return x.is_cuda


def gemm(
    x: torch.Tensor, planes: dict[str, torch.Tensor], spec: IntSpec, cfg: GemmConfig | None = None
) -> torch.Tensor:
    """x [M, K] (contiguous) -> [M, N] in x's dtype with `_gemm_kernel` (any M; `cfg` overrides
    `gemm_config`). Act-order: x gathered by one launch first (measured: gathering inside the
    kernel, a load per x element beside the weights', was 1.5-4 x slower at 16-32 tokens)."""
    m, k = x.shape
    n = spec.out_features
    cfg = cfg or gemm_config(spec, m)
    if spec.has_perm:
        x = x.index_select(1, planes["perm"])
    bk = fit_block_k(cfg.block_k, spec)
    tiles = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    cut = split_k.slices(k // bk, cfg.split_k, tiles[0] * tiles[1], m, n, x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    w = planes["qweight"]
    one_group = bk <= spec.group_size
    by_bytes = spec.bits == 4 and cfg.bytes_unpack
    if by_bytes:
        w = w.view(torch.uint8)
    _gemm_kernel[(tiles[0], cut.count, tiles[1])](
        x, out, cut.partials, cut.counters, w, planes["scales"], _zeros_plane(planes), m, n, k,
        x.stride(0), out.stride(0), w.stride(0), spec.group_shift, cut.per,
        BITS=spec.bits, HAS_Z=spec.has_zeros, BM=cfg.block_m, BN=cfg.block_n, BK=bk,
        ONE_GROUP=one_group, SPLIT=cut.split, ASM=_asm(x), PACKED=cfg.packed_math, BYTES=by_bytes,
        SCALE_AFTER=by_bytes and one_group and cfg.scale_after, TT=spec.row_tile,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x),
    )  # fmt: skip
    return out


def quantize_x(x: torch.Tensor, planes: dict[str, torch.Tensor], spec: IntSpec) -> x_int8.Int8X:
    """x [M, K] -> the int8 parts of all its tokens as one vector in the GEMV's layout (token m's
    tile groups after token m - 1's): attached by x's producer (one token), else one launch
    (act-order: gathered through perm in the same launch)."""
    layout = int8_layout(spec)
    flat = x.reshape(-1)
    if not spec.has_perm:
        return (x_int8.attached(x, layout) if x.shape[0] == 1 else None) or x_int8.quantize(flat, layout)
    parts = x_int8.empty(flat, layout)
    n_groups = parts.scales.shape[1]
    _permute_quantize_kernel[(triton.cdiv(n_groups, x_int8.QUANTIZE_GROUPS),)](
        flat, planes["perm"], parts.words, parts.scales, spec.in_features, n_groups, LO=spec.bits,
        TB=x_int8.QUANTIZE_GROUPS, num_warps=1, **pdl.options(x),
    )  # fmt: skip
    return parts


def gemv(
    x: torch.Tensor, planes: dict[str, torch.Tensor], spec: IntSpec, cfg: GemvConfig | None = None,
    xq: x_int8.Int8X | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> [M, N] in x's dtype with `_gemv_kernel` (`xq`: x's parts, else `quantize_x`);
    several tokens take one step of cfg.block_n rows per program."""
    m = x.shape[0]
    cfg = cfg or gemv_config(spec, m)
    xq = xq or quantize_x(x, planes, spec)
    n, k = spec.out_features, spec.in_features
    rpp = cfg.rows_per_program if m == 1 else cfg.block_n
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    w = planes["qweight"]
    _gemv_kernel[(triton.cdiv(n, rpp),)](
        xq.words, xq.scales, out, w, planes["scales"], _zeros_plane(planes), m, n, k, w.stride(0), out.stride(0),
        spec.group_shift,
        BITS=spec.bits, HAS_Z=spec.has_zeros, BN=cfg.block_n, T=triton.next_power_of_2(k // spec.tile_values), RPP=rpp,
        MULTI=m > 1, ASM=_asm(x), TT=spec.row_tile, num_warps=cfg.num_warps, **pdl.options(x),
    )  # fmt: skip
    return out


def dequantize_into(planes: dict[str, torch.Tensor], spec: IntSpec, row0: int, row_end: int, dst: torch.Tensor,
                    block_n: int = 32, block_k: int = 128) -> None:  # fmt: skip
    """Rows [row0, row_end) of the weights, K in the kernel's order (perm not undone), into dst
    [row_end - row0, K] (its dtype: fp16 / bf16 on the GPU, float32 in the interpreter)."""
    bk = fit_block_k(block_k, spec)
    w = planes["qweight"]
    grid = (triton.cdiv(row_end - row0, block_n), spec.in_features // bk)
    _dequant_kernel[grid](
        dst, w, planes["scales"], _zeros_plane(planes), row0, row_end, spec.out_features, w.stride(0),
        spec.group_shift, dst.stride(0), BITS=spec.bits, HAS_Z=spec.has_zeros, BN=block_n, BK=bk,
        ONE_GROUP=bk <= spec.group_size, ASM=dst.is_cuda, TT=spec.row_tile, num_warps=4,
    )  # fmt: skip


def dequant_matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], spec: IntSpec) -> torch.Tensor:
    """x [M, K] -> [M, N]: the weights dequantized into the shared scratch buffer (in row chunks
    where it is smaller), then cuBLAS; x gathered by perm first."""
    m, k = x.shape
    n = spec.out_features
    if spec.has_perm:
        x = x.index_select(1, planes["perm"])
    buf = triton_gguf.scratch(x.device, x.dtype, n * k)
    chunk = max(1, buf.numel() // k)
    if n <= chunk:
        w = buf[: n * k].view(n, k)
        dequantize_into(planes, spec, 0, n, w)
        return F.linear(x, w)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        w = buf[: (b - a) * k].view(b - a, k)
        dequantize_into(planes, spec, a, b, w)
        out[:, a:b] = F.linear(x, w)
    return out


def reserve(spec: IntSpec, device: torch.device) -> None:
    """At load (before CUDA-graph capture): the zeroed plane the int8 GEMM's split launches add
    their partials into, for its largest token count."""
    split_k.reserve_zeros(device, I8_MAX_TOKENS[spec.bits] * spec.out_features)


def matmul(x: torch.Tensor, planes: dict[str, torch.Tensor], spec: IntSpec) -> torch.Tensor:
    """x [M, K] bf16 / fp16 (contiguous) -> [M, N] in x's dtype: the integer-dot GEMV up to
    GEMV_MAX_TOKENS, the fused kernel up to FUSED_MAX_TOKENS, dequantize + cuBLAS above (module
    docstring)."""
    m = x.shape[0]
    if m <= GEMV_MAX_TOKENS:
        return gemv(x, planes, spec)
    if m <= I8_MAX_TOKENS[spec.bits] and triton_int_i8.supports(spec):
        return triton_int_i8.matmul(x, planes, spec)
    if m <= FUSED_MAX_TOKENS[spec.bits]:
        return gemm(x, planes, spec)
    return dequant_matmul(x, planes, spec)
