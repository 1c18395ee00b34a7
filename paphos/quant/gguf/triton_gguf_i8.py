"""GGUF's int8 tensor-core GEMM for batched decode (2 to I8_MAX_TOKENS tokens a step) on the
repacked planes (planes.py) of Q4_K and Q5_K (the bulk of Q4_K_M and Q5_K_M files) and Q8_0; the
other types keep triton_gguf's fused kernel (why: the end of this docstring).

Data flow: `triton_gguf.matmul` calls `matmul_into(out, quantize_x(x, type), seg)` for each
segment of a supported type (`supports`); two launches per linear (x quantized once per layout:
Q4_K and Q5_K share the code order), one where x's producer wrote the parts (`x_layout`,
paphos/layers/fused.py):
  1. paphos/layers/x_int8_blocks.py: x -> two int8 parts per value, x = dx (q1 + q2 / 254)
     with one dx per token and block of XB = 256 values, in the order the kernel multiplies the
     plane's codes (`stream_order`).
  2. `_q4_k_kernel`: out^T = W x^T, BN weight rows x BM tokens a program (both x parts side by
     side: N = 2 BM columns), one super-block (256 values, 128 bytes a row) a step; split-K
     through split_k.store_tile as the integer family's kernels. A Q4_K value is d sc q - dmin mn
     with a 6-bit scale sc and min mn per 32 values: the bytes' low nibbles (AND) and high
     nibbles (shift, AND) are two K=128 operands as they lie in registers, and sc = 8 s_hi +
     s_lo (3 bits each) makes int8 operands of them, s_hi q and s_lo q (at most 105: one 32-bit
     multiplication makes four), so that int8 dots (wgmma s8, the operands in registers,
     chained without a wait) give the step exactly in int32: 8 (s_hi q . x) + (s_lo q . x) and
     mn . x (mn at every position of its sub-block); then one float32 step, (d D - dmin Dmin)
     dx / 254, the parts summed at the end. Q5_K (FIVE) is Q4_K with a fifth bit per code:
     sc (q + 16 b) = sc q + 16 (sc b), and sc b (at most 63) is one more int8 operand pair
     (`_fifth_bits`: the bits spread to bytes by one multiplication, times sc by another).
  3. `_q8_0_kernel` (Q8_0: an int8 code and an fp16 scale per 32 values): the codes are the int8
     operand as stored, so they go from the software pipeline's shared-memory stage to the tensor
     cores untouched (wgmma with both operands by descriptor); x in the integer family's 8-bit
     blocks of 128 (triton_int_i8.x_layout(8): its order is the Q8_0 plane's tile order, so x's
     producers write it as they do for W8 layers). A block is four K=32 dots, one per scale group,
     all issued before the first result is read; each group's two x parts are joined in int32,
     times its scale (a row's four as one int64) in float32, the sum times dx.
So the only roundings are x's quantization (about 15 bits) and float32 sums; K must be a
multiple of 256 (Q8_0: 128).

Q8_0, H100, us (`i8` and `batched`; x's launch included): at 16 tokens q|k|v 22.3 (the fused
kernel 23.7, cuBLAS bf16 20.6), o 17.0 (17.0, 15.8), gate|up 68.0 (84.0, 79.3), down 41.1 (44.5,
43.8), the head 257.4 (326.2, 360.7); at 32 tokens the layer's four 201.4 against the fused
kernel's 243.6 (bf16 160.0) and the head 345.2 against 482.4. An earlier Q8_0 kernel of the same
plan (below) lost: its codes went through registers into an operand layout (and the scales
through a barrier each), where these reach the tensor cores as loaded. The engine on a Q8_0 file,
with `i8_config`'s rule: batch 16 2411 -> 2836 tok/s (1.13x bf16's 2504), batch 32 3449 -> 4279
(benchmarks/README.md, "GGUF Q8_0 on the int8 tensor cores").

Q4_K's 16-token tiles can run by stream-K (`_q4_k_stream_kernel`, split_k.py; `i8_config(...,
stream=True)`, and the `i8` sweep's candidates): 2 programs per SM (two of the kernel's 221-244
registers a thread fill a multiprocessor) take equal runs of the tiles' super-blocks laid end to end, so gate|up's 448 tiles no longer leave a
second, partial wave and q|k's 80 fill the GPU; H100, 16 tokens: q|k 19.2 -> 17.5 us, gate|up
55.9 -> 50.5, down 32.7 -> 29.1, the four with o (kept split: 3.9 super-blocks a program lost,
14.6 -> 16.2) 122.4 -> 111.7 us (benchmarks/README.md, "Stream-K for the int8 tensor-core GEMMs").
That was on row-major planes; on the planes in tiles of 4 rows (planes.py) the split launch
measured ahead again (a throwaway copy of the kernel, H100, 16 tokens: q|k 14.6, o 10.8, gate|up
38.6, down 22.0 us against 15.3 / 12.7 / 47.8 / 26.0 for the rule of the time on the tiled
planes; the engine's Q4_K_M batch 16 3033 -> 3182 tok/s), so the rule no longer streams.

Measured (benchmarks/bench_gguf_gpu.py `i8`, 16 tokens, Llama-3-8B shapes, CUDA-graph replays,
weights from memory, x's launch included), on an H100, us: Q4_K q|k 18.7 (the fused kernel 37.4,
cuBLAS bf16 16.9), o 14.0 (31.0, 16.6), gate|up 54.7 (178.4, 83.4), down 31.4 (87.7, 45.0): a
Q4_K_M layer's Q4_K linears in 118.8 against 334.6 fused and 161.9 bf16 (1.36x bf16), 22-42 % of
copy bandwidth, issue-bound; Q5_K gate|up 75.8 (188.7 fused). The engine on a Q4_K_M file
decodes 16 sequences at 1.02-1.05x its bf16 speed (2540 against 2412 tok/s; 2529 against 2483).
In 32-token tiles (`i8_config`): the four at 32 tokens 158.8 (fused 341.9, bf16 155.7; two
16-token tiles would take ~237), at 64 tokens in two tiles 279.9 (fused 366.2, bf16 159.6);
the engine at batch 32 went 3726 -> 4195 tok/s (bf16 4946). With the sub-block scales and
minima loaded as one int64 a row (`_sub_block_bytes`; 222 -> 168 registers), another H100: the
four at 32 tokens 158.6 -> 137.3 and Q5_K's gate|up 75.4 -> 66.9 at 16, but the four at 16
118.6 -> 124.5 (gate|up 54.1 -> 61.4), so Q4_K's 16-token tiles keep the byte tile
(`SCALE_WORDS`); the engine at batch 32 / 64 0.88x -> 0.92x / 0.63x -> 0.67x its bf16 (4578 /
6385 tok/s; benchmarks/README.md, "GGUF's batched path on an H100"). Before the scales went
to the asm as int32 registers and the minimum was spread by one multiplication (Triton packs
four int8 copies with byte permutes): 129.6 a layer (the static count of benchmarks/int8_sass.py:
8.6 instructions a weight byte, now 7.5; Q5_K 11.2, now 9.4). Earlier versions: the nibbles
joined into K-ordered codes first (byte permutes for every operand register): 145.9 against
bf16's 118.9 on an H200; one K=32 dot per sub-block with its scale applied to the int32 result
before the next (a wait on every dot): 250.5 against 170.2 on an H100.

Measured and dropped (same run): int8 kernels for the types whose scale covers 16 or 32 values
(Q8_0 before `_q8_0_kernel`, Q4_0 .. Q5_1, IQ4_NL: a K=32 dot per group, joined and scaled in
float32 per group; Q6_K, IQ4_XS: a dot per chunk with the signed scales applied in int32) lost to the fused
kernel at every launch swept (mma.sync 16-64 rows, wgmma 64-128): Q8_0 layer 176.9 against
169.5, Q6_K down 113.2 against 79.8 and its head 882 against 585, Q4_0 gate|up 109.8 against
106.1, though their static counts were 2.3-2.5x below the fused kernel's. What the count misses:
per group a float epilogue and a barrier for the scale's layout, and the mma.sync operand
assembled in a blocked layout and moved through shared memory (Triton hoists no packed asm to
the dot operand layout).
"""

from __future__ import annotations

import math

import torch

from paphos.layers import pdl, x_int8_blocks
from paphos.layers.x_int8_blocks import BlockLayout
from paphos.quant.kernels import triton_int_i8, x_blocks
from paphos.quant.kernels.triton_int_i8 import I8Config

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels import split_k
    from paphos.quant.kernels.int_layout import tile_row
    from paphos.quant.kernels.triton_int_i8 import nibbles_i8
except ImportError:  # CPU-only installs: the torch reference (planes.reference_matmul) serves
    triton = None

XB = 256  # K values per x block of Q4_K / Q5_K: one dx per token and block, the kernel's K step
Q8_0_XB = 128  # Q8_0's x blocks: the integer family's 8-bit layout (`x_layout`), the kernel's K step
# Up to this many tokens a step the int8 path runs per type (above: the fused kernel, then
# cuBLAS): Q4_K in tiles of 32 tokens from 17 on (`i8_config`; a Q4_K_M layer's Q4_K linears at
# 64 tokens 279.9 us against the fused kernel's 366.2, H100), Q5_K in tiles of 16 (32 a tile
# spills there; at 64 tokens 232.2 against the fused kernel's 226.9 on gate|up).
I8_MAX_TOKENS = {"Q4_K": 64, "Q5_K": 32, "Q8_0": 32}


def block_values(type_name: str) -> int:
    """K values per x block (and kernel step) of the type's int8 GEMM."""
    return Q8_0_XB if type_name == "Q8_0" else XB


def supports(type_name: str, k: int) -> bool:
    return type_name in I8_MAX_TOKENS and k % block_values(type_name) == 0


def stream_order() -> torch.Tensor:
    """[XB] int64: position j of a quantized x block holds value stream_order()[j] of the block,
    the order of the codes in the kernel's operands (Q4_K and Q5_K share the low plane):
    the low nibbles of the super-block's 128 bytes, then their high nibbles; byte i is byte 4w + b
    of sub-block i // 16's tile group (T = 4 words; code p of word w is value p * 4 + w,
    planes.py): codes 2b (low) and 2b + 1 (high) of word w."""
    j = torch.arange(XB)
    high, byte = j // 128, j % 128
    t = byte % 16
    return byte // 16 * 32 + (2 * (t % 4) + high) * 4 + t // 4


# ---------------------------------------------------------------------------- Triton kernel

if triton is not None:
    # The inline PTX of the operand assembly below (module constants so that tests/quant/ptx_sim.py
    # can run each on chosen registers)
    _ASM_SCALE_HALVES = tl.constexpr(
        "{ .reg .b32 h, l; shr.b32 h, $3, 3; and.b32 l, $3, 7; mul.lo.u32 $0, $2, h; mul.lo.u32 $1, $2, l; }"
    )  # fmt: skip
    _ASM_SPLAT = tl.constexpr("mul.lo.u32 $0, $1, 0x01010101;")
    _ASM_FIFTH_BITS = tl.constexpr(
        "{ .reg .b32 t, u; and.b32 t, $2, 0x55; mul.lo.u32 t, t, 0x41041; "
        "and.b32 t, t, 0x01010101; mul.lo.u32 $0, t, $6; shr.b32 u, $2, 1; and.b32 u, u, 0x55; "
        "mul.lo.u32 u, u, 0x41041; and.b32 u, u, 0x01010101; mul.lo.u32 $1, u, $6; }"
    )  # fmt: skip
    @triton.jit
    def _scale_halves(codes, sc, ASM: tl.constexpr):
        """Codes (int8, 0..15) and their sub-block's 6-bit scale sc (int32, per code) -> (code x
        (sc >> 3), code x (sc & 7)) as int8 (at most 105). GPU: four codes a register and one
        32-bit multiplication for their four products (none carries into the next byte), by the
        first code's scale half: the four codes an asm instance packs must share their scale,
        which holds for the operand of the dot (four consecutive K values of one row, inside one
        sub-block's run of 16 bytes in a nibble plane), the layout Triton gives this op (tests/quant/test_gguf_i8.py checks
        it in the sm_90 compile; the load-time self-check in triton_gguf.py checks the results).
        sc is int32 so that the asm takes the first code's register as it is (four int32 operands
        an instance, $3 .. $6): as int8 Triton would pack four copies with byte permutes."""
        if ASM:
            return tl.inline_asm_elementwise(_ASM_SCALE_HALVES, "=r,=r,r,r,r,r,r", [codes, sc],
                                             dtype=(tl.int8, tl.int8), is_pure=True, pack=4)  # fmt: skip
        else:
            c = codes.to(tl.int32)
            return (c * (sc >> 3)).to(tl.int8), (c * (sc & 7)).to(tl.int8)

    @triton.jit
    def _as_int8(v, ASM: tl.constexpr):
        """int32 values in -128..127 -> int8, equal in runs of four operand positions (a sub-block's
        minimum at its codes). GPU: one multiplication spreads a run's value to the four bytes of
        its register, where Triton would pack four int8s with byte permutes."""
        if ASM:
            return tl.inline_asm_elementwise(_ASM_SPLAT, "=r,r,r,r,r", [v], dtype=tl.int8, is_pure=True, pack=4)
        else:
            return v.to(tl.int8)

    @triton.jit
    def _fifth_bits(bits, scale, ASM: tl.constexpr):
        """Q5_K: for the codes of a low-plane byte (its low nibble: code 2b of its word, high
        nibble: 2b + 1), their sub-block's scale where their fifth bit is set, else 0, as int8 (at
        most 63): (low nibbles', high nibbles'). bits: the word's byte of the fifth-bit plane (bit
        p: code p), scale: the sub-block's 6-bit scale, both int32 per code byte (the asm takes
        an instance's first registers, $2 and $6, as `_scale_halves` does). GPU: four bytes a
        register (b = 0..3 of one word, the operand layout as `_scale_halves`): bits 2b (or 2b + 1)
        spread to byte b by one multiplication (x 0x41041 on bits 0, 2, 4, 6 lands them on bits 0,
        8, 16, 24, nothing else there), then one more by the scale."""
        if ASM:
            return tl.inline_asm_elementwise(_ASM_FIFTH_BITS, "=r,=r,r,r,r,r,r,r,r,r", [bits, scale],
                                             dtype=(tl.int8, tl.int8), is_pure=True, pack=4)  # fmt: skip
        else:
            b = 2 * (tl.arange(0, bits.shape[1]) % 4)[None, :]
            s = scale.to(tl.int32)
            lo = tl.where(((bits.to(tl.int32) >> b) & 1) != 0, s, 0)
            hi = tl.where(((bits.to(tl.int32) >> (b + 1)) & 1) != 0, s, 0)
            return lo.to(tl.int8), hi.to(tl.int8)

    @triton.jit
    def _per_byte(t, BN: tl.constexpr, S: tl.constexpr, R: tl.constexpr):
        """[BN, S] -> [BN, S * R], each value repeated over its run of R."""
        return tl.reshape(tl.broadcast_to(t[:, :, None], (BN, S, R)), (BN, S * R))

    @triton.jit
    def _sub_block_bytes(ptr, at, row_ok):
        """[BN, 8]: the eight bytes of the int64 at ptr + at (one load a row, `at` [BN]). Loaded as
        [BN] (fewer values than threads), the load is issued in the layout its user needs, where a
        [BN, 8] byte load went through shared memory into the operand layout (32 byte-wide shared
        loads a step)."""
        w = tl.load(ptr + at, mask=row_ok, other=0)
        b0 = (w & 0xFF).to(tl.int32)
        b1 = ((w >> 8) & 0xFF).to(tl.int32)
        b2 = ((w >> 16) & 0xFF).to(tl.int32)
        b3 = ((w >> 24) & 0xFF).to(tl.int32)
        b4 = ((w >> 32) & 0xFF).to(tl.int32)
        b5 = ((w >> 40) & 0xFF).to(tl.int32)
        b6 = ((w >> 48) & 0xFF).to(tl.int32)
        b7 = ((w >> 56) & 0xFF).to(tl.int32)
        q0 = tl.join(tl.join(b0, b4), tl.join(b2, b6))
        q1 = tl.join(tl.join(b1, b5), tl.join(b3, b7))
        return tl.reshape(tl.join(q0, q1), (w.shape[0], 8))

    @triton.jit
    def _q4_k_tile(
        q_ptr, dx_ptr, w_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, M, N, K, pid_n, pid_m, it0, it1,
        FIVE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, ASM: tl.constexpr, SCALE_WORDS: tl.constexpr,
        TT: tl.constexpr,
    ):  # fmt: skip
        """float32 out^T [BN rows, BM tokens] of tile (pid_n, pid_m) over super-blocks it0 .. it1
        (module docstring), and the tile's rows, row_ok, ms, m_ok. w_ptr: the low code plane as
        bytes; with FIVE (Q5_K) hi_ptr: the fifth-bit plane as bytes (unread otherwise); sc_ptr,
        mn_ptr: the 6-bit scales and minima, eight bytes a row and super-block, read as one int64 with
        SCALE_WORDS (`_sub_block_bytes`; where it measured faster on an H100: Q4_K in 32-token
        tiles, a Q4_K_M layer's four 158.6 -> 137.3 us, and Q5_K, gate|up 75.4 -> 66.9 at 16
        tokens) and as a [BN, 8] byte tile otherwise (Q4_K at 16 tokens, where the int64 reads
        measured 118.6 -> 124.5: fewer registers let three programs share a multiprocessor,
        and gate|up's 448 lost)."""
        n_blocks = K // 256
        rows, row_ok, ms, m_ok, first, tok, tok_ok, _, _ = x_blocks.program_tile(
            pid_n, pid_m, 0, N, M, n_blocks, n_blocks, BN, BM
        )
        x_cols = x_blocks.part_pointers(q_ptr, first, tok, M, K, 128)
        x_ok = tok_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        # planes tiled by TT rows (planes.py): super-block it of a row lies it * TT blocks after block 0
        w_rows = w_ptr + tile_row(r64, K // 2, TT, 128) + tl.arange(0, 128)[None, :]
        hi_rows = hi_ptr + tile_row(r64, K // 8, TT, 32) + tl.arange(0, 32)[None, :]  # byte j: word j's bits
        s_words = tile_row(rows.to(tl.int64), n_blocks, TT, 1)  # sc / mn as one int64, sd, smin: one a block
        s_bytes = tile_row(r64, K // 32, TT, 8) + tl.arange(0, 8)[None, :]
        part_w = tl.where(first, 1.0, 1.0 / 254.0)  # 254 * (codes . q1) + codes . q2, over 254
        acc = tl.zeros((BN, 2 * BM), dtype=tl.float32)
        for it in range(it0, it1):
            if SCALE_WORDS:
                sc = _sub_block_bytes(sc_ptr, s_words + it * TT, row_ok)
                mn = _sub_block_bytes(mn_ptr, s_words + it * TT, row_ok)
            else:
                sc = tl.load(sc_ptr.to(tl.pointer_type(tl.uint8)) + s_bytes + it * (TT * 8), mask=row_ok[:, None],
                             other=0)  # fmt: skip
                mn = tl.load(mn_ptr.to(tl.pointer_type(tl.uint8)) + s_bytes + it * (TT * 8), mask=row_ok[:, None],
                             other=0)  # fmt: skip
            wb = tl.load(w_rows + it * (TT * 128), mask=row_ok[:, None], other=0)
            x_lo = tl.load(x_cols + it * 256, mask=x_ok, other=0)  # x at the low nibbles' values
            x_hi = tl.load(x_cols + it * 256 + 128, mask=x_ok, other=0)
            dd = tl.load(sd_ptr + s_words + it * TT, mask=row_ok, other=0).to(tl.float32)
            dm = tl.load(smin_ptr + s_words + it * TT, mask=row_ok, other=0).to(tl.float32)
            dx = tl.load(dx_ptr + tok * n_blocks + it, mask=tok_ok, other=0.0) * part_w
            lo, hi = nibbles_i8(wb, ASM)  # [BN, 128]: byte i's codes, sub-block i // 16
            sc_k = _per_byte(sc.to(tl.int32), BN, 8, 16)
            # sc * code = 8 ((sc >> 3) code) + (sc & 7) code, each product an int8; the minimum's dots take
            # mn at every code position of its sub-block
            lo_h, lo_l = _scale_halves(lo, sc_k, ASM)
            hi_h, hi_l = _scale_halves(hi, sc_k, ASM)
            d_hi = tl.dot(hi_h, x_hi, tl.dot(lo_h, x_lo, out_dtype=tl.int32), out_dtype=tl.int32)
            d_lo = tl.dot(hi_l, x_hi, tl.dot(lo_l, x_lo, out_dtype=tl.int32), out_dtype=tl.int32)
            mn_b = _as_int8(_per_byte(mn.to(tl.int32), BN, 8, 16), ASM)
            d_mn = tl.dot(mn_b, x_hi, tl.dot(mn_b, x_lo, out_dtype=tl.int32), out_dtype=tl.int32)
            d_sc = 8 * d_hi + d_lo
            if FIVE:  # sc (code + 16 bit) = sc code + 16 (sc bit): sc where the fifth bit is set
                bits = _per_byte(tl.load(hi_rows + it * (TT * 32), mask=row_ok[:, None], other=0).to(tl.int32), BN,
                                 32, 4)  # fmt: skip
                lo_5, hi_5 = _fifth_bits(bits, sc_k, ASM)
                d_sc += 16 * tl.dot(hi_5, x_hi, tl.dot(lo_5, x_lo, out_dtype=tl.int32), out_dtype=tl.int32)
            acc += (d_sc.to(tl.float32) * dd[:, None] - d_mn.to(tl.float32) * dm[:, None]) * dx[None, :]
        return x_blocks.sum_parts(acc, BN, BM), rows, row_ok, ms, m_ok

    @triton.jit
    def _q4_k_kernel(
        q_ptr, dx_ptr, out_ptr, part_ptr, count_ptr, w_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr,
        M, N, K, stride_om, iters_per_split,
        FIVE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
        PDL: tl.constexpr, TT: tl.constexpr, SCALE_WORDS: tl.constexpr = False,
    ):  # fmt: skip
        """out [M, N] = x W^T for BN rows and BM tokens per program, super-blocks it0 .. it1 of K
        per program along grid axis 2 (`_q4_k_tile`)."""
        pdl.release(PDL)
        pdl.wait(PDL)
        it0 = tl.program_id(2) * iters_per_split
        it1 = tl.minimum(it0 + iters_per_split, K // 256)
        acc, rows, row_ok, ms, m_ok = _q4_k_tile(
            q_ptr, dx_ptr, w_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, M, N, K, tl.program_id(1), tl.program_id(0),
            it0, it1, FIVE, BN, BM, ASM, SCALE_WORDS, TT,
        )  # fmt: skip
        split_k.store_tile(acc, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om,
                           tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tl.program_id(2),
                           tl.num_programs(2), SPLIT, ASM)  # fmt: skip

    @triton.jit
    def _q4_k_stream_kernel(
        q_ptr, dx_ptr, out_ptr, part_ptr, count_ptr, w_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr,
        M, N, K, stride_om,
        FIVE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
        TT: tl.constexpr, SCALE_WORDS: tl.constexpr = False,
    ):  # fmt: skip
        """`_q4_k_kernel`'s product by stream-K (split_k.py): tile t = pid_n * tiles_m + pid_m (a
        weight tile's token tiles one after another, the later ones reading it from L2) holds
        super-blocks t * n_blocks .. of the run laid end to end."""
        pdl.release(PDL)
        pdl.wait(PDL)
        n_blocks = K // 256
        tiles_m = tl.cdiv(M, BM)
        total = tl.cdiv(N, BN) * tiles_m * n_blocks
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        at = program * total // programs
        end = (program + 1) * total // programs
        while at < end:
            tile = at // n_blocks
            it0 = at - tile * n_blocks
            it1 = tl.minimum(n_blocks, it0 + end - at)
            acc, rows, row_ok, ms, m_ok = _q4_k_tile(
                q_ptr, dx_ptr, w_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, M, N, K, tile // tiles_m,
                tile % tiles_m, it0, it1, FIVE, BN, BM, ASM, SCALE_WORDS, TT,
            )  # fmt: skip
            slice_id, sharing = split_k.stream_contributors(tile, n_blocks, program, programs, total)
            split_k.store_tile(acc, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om, tile,
                               slice_id, sharing, True, ASM)  # fmt: skip
            at += it1 - it0

    @triton.jit
    def _fp16_at(words, G: tl.constexpr):
        """fp16 number G of each int64 (bits 16 G ..) as float32."""
        return ((words >> (16 * G)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _group_dot(w_rows, x_cols, kw, k, w_ok, x_ok):
        """One Q8_0 scale group's K=32 int8 dot at K offset k (kw in the tiled plane), codes and x's
        parts as loaded: [BN, 2 BM] int32."""
        return tl.dot(tl.load(w_rows + kw, mask=w_ok, other=0), tl.load(x_cols + k, mask=x_ok, other=0),
                      out_dtype=tl.int32)  # fmt: skip

    @triton.jit
    def _group_scaled(d, weight, s, G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
        """Group G's dot with its two x parts joined in int32 first (a thread holds both columns of a
        token, so the float step runs once per token; |254 d| < 2^27), times its fp16 scale (number G
        of the row's int64 s): [BN, BM] float32."""
        return x_blocks.sum_parts(d * weight[None, :], BN, BM).to(tl.float32) * _fp16_at(s, G)[:, None]

    @triton.jit
    def _q8_0_tile(
        q_ptr, dx_ptr, w_ptr, sc_ptr, M, N, K, pid_n, pid_m, it0, it1, BN: tl.constexpr, BM: tl.constexpr,
        TT: tl.constexpr,
    ):  # fmt: skip
        """float32 out^T [BN rows, BM tokens] of tile (pid_n, pid_m) over x blocks it0 .. it1 (128
        values each) of a Q8_0 plane: the codes are int8 operands as stored (no unpacking, straight
        from the pipeline's shared-memory stage to the tensor cores), one K=32 dot per scale group;
        the four dots of a block go out before the first result is read, then each group's int32
        dot meets its fp16 scale (the four of a row's block read as one int64) and the block's dx in
        float32. x's parts are the integer family's 8-bit blocks (`x_layout`: the plane's tile order)."""
        n_blocks = K // 128
        rows, row_ok, ms, m_ok, first, tok, tok_ok, _, _ = x_blocks.program_tile(
            pid_n, pid_m, 0, N, M, n_blocks, n_blocks, BN, BM
        )
        x_cols = x_blocks.part_pointers(q_ptr, first, tok, M, K, 32)
        x_ok = tok_ok[None, :]
        r64 = rows.to(tl.int64)
        # planes tiled by TT rows (planes.py): 128 codes and one int64 of scales a row and tile, so
        # block it of a row lies it * TT tiles after block 0
        w_rows = w_ptr + tile_row(r64[:, None], K, TT, 128) + tl.arange(0, 32)[None, :]
        s_words = tile_row(r64, n_blocks, TT, 1)  # a row's four group scales of a block: one int64
        weight = tl.where(first, 254, 1)  # 254 * (codes . q1) + codes . q2
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        w_ok = row_ok[:, None]
        for it in range(it0, it1):
            k0 = it * 128
            kw = it * (TT * 128)
            # the four groups' dots go out before the first result is read
            d0 = _group_dot(w_rows, x_cols, kw, k0, w_ok, x_ok)
            d1 = _group_dot(w_rows, x_cols, kw + 32, k0 + 32, w_ok, x_ok)
            d2 = _group_dot(w_rows, x_cols, kw + 64, k0 + 64, w_ok, x_ok)
            d3 = _group_dot(w_rows, x_cols, kw + 96, k0 + 96, w_ok, x_ok)
            s = tl.load(sc_ptr + s_words + it * TT, mask=row_ok, other=0)
            dx = tl.load(dx_ptr + ms * n_blocks + it, mask=m_ok, other=0.0) * (1.0 / 254.0)
            block = (_group_scaled(d0, weight, s, 0, BN, BM) + _group_scaled(d1, weight, s, 1, BN, BM)
                     + _group_scaled(d2, weight, s, 2, BN, BM) + _group_scaled(d3, weight, s, 3, BN, BM))
            acc += block * dx[None, :]
        return acc, rows, row_ok, ms, m_ok

    @triton.jit
    def _q8_0_kernel(
        q_ptr, dx_ptr, out_ptr, part_ptr, count_ptr, w_ptr, sc_ptr, M, N, K, stride_om, iters_per_split,
        BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
        TT: tl.constexpr,
    ):  # fmt: skip
        """out [M, N] = x W^T of a Q8_0 plane for BN rows and BM tokens per program, x blocks it0 ..
        it1 of K per program along grid axis 2 (`_q8_0_tile`)."""
        pdl.release(PDL)
        pdl.wait(PDL)
        it0 = tl.program_id(2) * iters_per_split
        it1 = tl.minimum(it0 + iters_per_split, K // 128)
        acc, rows, row_ok, ms, m_ok = _q8_0_tile(
            q_ptr, dx_ptr, w_ptr, sc_ptr, M, N, K, tl.program_id(1), tl.program_id(0), it0, it1, BN, BM, TT
        )
        split_k.store_tile(acc, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om,
                           tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tl.program_id(2),
                           tl.num_programs(2), SPLIT, ASM)  # fmt: skip

# ---------------------------------------------------------------------------- launches


# stream-K launches of Q4_K's 16-token tiles (`i8_config`): two programs of 221-244 registers fill a
# multiprocessor's register file, and a shorter run than four super-blocks a program lost to the split
STREAM_PER_SM = 2
STREAM_MIN_RUN = 4
# (type, N, K, tokens per program) -> a launch measured better than `i8_config`'s, filled by
# benchmarks/bench_gguf_gpu.py's `i8` sweep (the engine sections after it use them)
TUNED_CONFIGS: dict[tuple[str, int, int, int], I8Config] = {}


def i8_config(type_name: str, rows: int, k: int, m: int, programs_per_sm: int = 2, stream: bool = False) -> I8Config:
    """The launch at M tokens: 16 per program, Q4_K 32 above 16 tokens (each weight decoded once
    for twice the tokens: 158.8 us for a Q4_K_M layer's Q4_K linears at 32 tokens, H100; Q5_K
    spills at 32), the token tiles side by side in the grid so the next reads the weights from L2;
    64 rows, 3 stages, 4 warps (wgmma: the H100 and H200 sweeps' winners; 32 rows on 2 warps with
    mma.sync came 1.0-1.4x slower, 16 rows on 1 warp level on gate|up and 1.05-1.4x slower
    elsewhere). K split while the grid stays within `programs_per_sm` programs per multiprocessor
    and each slice keeps two super-blocks (q|k 2 slices, o and down 4). With `stream`, Q4_K's
    16-token tiles by stream-K over STREAM_PER_SM programs per multiprocessor where each program's
    run is STREAM_MIN_RUN super-blocks or more (the rule on row-major planes, H100, 16 tokens: q|k
    19.2 -> 17.5 us, gate|up 55.9 -> 50.5, down 32.7 -> 29.1; on the tiled planes the split
    launch is ahead: the module docstring). Q8_0 by the H100 sweep's winners: 16-token
    tiles of layers with fewer 64-row tiles than multiprocessors (a Llama-3-8B q|k|v, o and down)
    on 2 warps (mma.sync) in 4 K slices (22.3 / 17.0 / 41.1 us against the rule above's 26.4 /
    18.7 / 45.8), the wider ones (gate|up, the head) unsplit on 4 stages (71.5 -> 68.0, 314.6 ->
    257.4); its 32-token tiles by the split rule (the sweep's best, gate|up in 128-row tiles at 89.2
    against 103.6 us, spills a 128 x 32 tile's four int32 dot results). A per-shape entry of
    TUNED_CONFIGS wins."""
    bm = 32 if type_name in ("Q4_K", "Q8_0") and m > 16 else 16
    tuned = TUNED_CONFIGS.get((type_name, rows, k, bm))
    if tuned is not None:
        return tuned
    block_n = 64
    if type_name == "Q8_0":
        row_tiles = math.ceil(rows / block_n)
        if bm == 16:
            if row_tiles >= split_k.NUM_SMS_GUESS:
                return I8Config(block_n, bm, 1, 4, 4)
            return I8Config(block_n, bm, max(1, min(4, k // Q8_0_XB // 2)), 2, 3)
    tiles = math.ceil(rows / block_n) * math.ceil(m / bm)
    blocks, split = k // block_values(type_name), 1
    programs = STREAM_PER_SM * split_k.NUM_SMS_GUESS
    if stream and type_name == "Q4_K" and bm == 16 and tiles * blocks >= STREAM_MIN_RUN * programs:
        return I8Config(block_n, bm, stream_per_sm=STREAM_PER_SM)
    while blocks // (split * 2) >= 2 and tiles * split * 2 <= programs_per_sm * split_k.NUM_SMS_GUESS:
        split *= 2
    return I8Config(block_n, bm, split)


def scale_words(type_name: str, cfg: I8Config) -> bool:
    """Whether `_q4_k_kernel` reads the sub-block scales and minima as one int64 a row
    (`SCALE_WORDS`): where that measured faster on an H100, Q5_K and 32-token tiles; and by
    stream-K, whose loop over tiles would spill the byte tile's registers."""
    return type_name == "Q5_K" or cfg.block_m > 16 or cfg.stream_per_sm > 0


def x_layout(type_name: str = "Q4_K", max_tokens: int = 0) -> BlockLayout:
    """How the type's kernel reads x (its parts and dx; Q4_K's minimum has a dot of its own, not
    x's sums; `max_tokens` as in triton_int_i8.x_layout): Q4_K and Q5_K `stream_order` blocks of
    XB, Q8_0 the integer family's 8-bit blocks of 128, whose order is the Q8_0 plane's code order
    (planes.py's tile order, 16-value tile groups of 4 words, as int_layout.py's 8-bit planes), so
    x's producers already write it for W8 layers."""
    if type_name == "Q8_0":
        return triton_int_i8.x_layout(8, 2, max_tokens)
    return BlockLayout("Q4_K", stream_order, XB, XB, 2, max_tokens)


def quantize_x(x: torch.Tensor, type_name: str = "Q4_K") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> its (parts, dx, sums) in the type's `x_layout`: attached by x's producer, else one
    launch."""
    return x_int8_blocks.quantize(x, x_layout(type_name))


def matmul_into(
    out: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seg: object,
    cfg: I8Config | None = None,
) -> None:  # fmt: skip
    """out [M, seg.rows] (a column slice of the linear's output, unit stride on rows) = x W^T of
    one segment of a supported type (triton_gguf.Segment), from `quantize_x`; `cfg` overrides
    `i8_config`."""
    parts, dx, _ = xq
    m, k = out.shape[0], seg.k
    n = seg.rows
    cfg = cfg or i8_config(seg.type_name, n, k, m)
    tiles = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    p = seg.planes
    if seg.type_name == "Q8_0":
        cut = split_k.slices(k // Q8_0_XB, cfg.split_k, tiles[0] * tiles[1], m, n, out.device)
        _q8_0_kernel[(*tiles, cut.count)](
            parts, dx, out, cut.partials, cut.counters, p["lo"], p["sc"].view(torch.int64), m, n, k, out.stride(0),
            cut.per, BN=cfg.block_n, BM=cfg.block_m, SPLIT=cut.split, ASM=out.is_cuda, TT=seg.row_tile,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(out),
        )  # fmt: skip
        return
    lo = p["lo"].view(torch.uint8)
    # sc / mn: a row's eight 6-bit values of a super-block as one int64 (`_sub_block_bytes`)
    planes = (lo, p["hi"].view(torch.uint8) if "hi" in p else lo, p["sc"].view(torch.int64), p["sd"],
              p["mn"].view(torch.int64), p["smin"])  # fmt: skip
    common = dict(FIVE=seg.type_name == "Q5_K", BN=cfg.block_n, BM=cfg.block_m, ASM=out.is_cuda,
                  SCALE_WORDS=scale_words(seg.type_name, cfg), TT=seg.row_tile, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, **pdl.options(out))  # fmt: skip
    if cfg.stream_per_sm:
        programs = cfg.stream_per_sm * split_k.num_sms(out.device)
        run = split_k.stream(tiles[0] * tiles[1], k // XB, programs, m, n, out.device)
        _q4_k_stream_kernel[(run.programs,)](
            parts, dx, out, run.partials, run.counters, *planes, m, n, k, out.stride(0), **common
        )  # fmt: skip
        return
    cut = split_k.slices(k // XB, cfg.split_k, tiles[0] * tiles[1], m, n, out.device)
    _q4_k_kernel[(*tiles, cut.count)](
        parts, dx, out, cut.partials, cut.counters, *planes, m, n, k, out.stride(0), cut.per, SPLIT=cut.split,
        **common,
    )  # fmt: skip
