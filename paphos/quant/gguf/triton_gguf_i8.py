"""GGUF's int8 tensor-core GEMMs for batched decode (2 to I8_MAX_TOKENS tokens a step) on the
repacked planes (planes.py) of Q4_K, Q5_K and Q6_K (the bytes of Q4_K_M and Q5_K_M files: Q6_K
holds attn_v and ffn_down of half the layers and the head), Q8_0, the legacy 4- and 5-bit types
(Q4_0: Gemma's QAT files), IQ4_NL and IQ4_XS; Q3_K and Q2_K keep triton_gguf's fused kernel.

Data flow: `triton_gguf.matmul` calls `matmul_into(out, quantize_x(x, type), seg)` for each
segment of a supported type (`supports`); two launches per linear (x quantized once per type):
  1. paphos/quant/kernels/x_blocks.py: x -> two int8 parts per value, x = dx (q1 + q2 / 254)
     with one dx per token and block of XB = 256 values, in the order the type's kernel
     multiplies the plane's codes (`stream_order`).
  2. A kernel computing out^T = W x^T, BN weight rows x BM tokens a program (both x parts side by
     side: N = 2 BM columns), 256 values a step; split-K through split_k.store_tile as the
     integer family's kernels.
     - `_q4_k_kernel`: one super-block (128 bytes a row) a step. A Q4_K value is d sc q - dmin mn
       with a 6-bit scale sc and min mn per 32 values: the bytes' low nibbles (AND) and high
       nibbles (shift, AND) are two K=128 operands as they lie in registers, and sc = 8 s_hi +
       s_lo (3 bits each) makes int8 operands of them, s_hi q and s_lo q (at most 105: one 32-bit
       multiplication makes four), so that int8 dots (wgmma s8, the operands in registers,
       chained without a wait) give the step exactly in int32: 8 (s_hi q . x) + (s_lo q . x) and
       mn . x (mn at every position of its sub-block); then one float32 step, (d D - dmin Dmin)
       dx / 254, the parts summed at the end. Q5_K (FIVE) is Q4_K with a fifth bit per code:
       sc (q + 16 b) = sc q + 16 (sc b), and sc b (at most 63) is one more int8 operand pair
       (`_fifth_bits`: the bits spread to bytes by one multiplication, times sc by another).
     - `_group_kernel`: eight 32-value groups a step, each with an fp16 scale. Q8_0: the stored
       bytes are the int8 operand as they are (no unpacking); Q4_0 (code - 8), Q4_1 (code),
       Q5_0 (code5 - 16), Q5_1 (code5): the group's 16 low-plane bytes, their low nibbles then
       their high nibbles (and the fifth bits), make it (`_linear_nibbles`: two instructions a
       register); IQ4_NL (the IQ4 levels): its 4 words (`_iq4_values`). Per group one K=32 dot, its two
       parts joined in int32 (254 D1 + D2, in registers), times the scale in float32, plus Q4_1's
       and Q5_1's minimum times x's sum over the group (x_blocks writes sums per 32 for them);
       per step times dx / 254.
     - `_chunk_kernel`, Q6_K: eight chunks of two 16-value sub-blocks a step. A Q6_K value is
       d sc (q - 32), q 6 bits, sc a signed 8-bit scale per 16 values. The chunk's signed codes
       v = q - 32 are one K=32 operand (`_q6_k_codes`: the low-plane nibbles joined with their
       2 high bits, four codes a register), a second copy zeroes the first sub-block, and two
       dots give sc_a (v . x) + (sc_b - sc_a) (v_b . x) exactly in int32 over the super-block (an
       int8 MMA's K is at least 32: a sub-block alone is half of it); then d dx / 254 in float32.
     - `_chunk_kernel`, IQ4_XS (IQ4): eight 32-value sub-blocks a step. A value is d sc L[q],
       L the 16 non-uniform levels (IQ4_KVALUES, at most 127 in size), sc a signed 6-bit scale:
       a low-plane word's 8 codes are two registers of levels (`_iq4_values`: the codes are the
       selector of byte permutes over the level tables), one dot a sub-block, sc D in int32.
So the only roundings are x's quantization (about 15 bits) and float32 sums; K must be a
multiple of 256.

Measured (benchmarks/bench_gguf_gpu.py `i8`, 16 tokens, the Q4_K linears of a Llama-3-8B Q4_K_M
layer, CUDA-graph replays, weights from memory, x's launch included), on an H100: q|k 20.0 us
(the fused kernel 37.2, cuBLAS bf16 16.9), o 14.8 (30.9, 15.8), gate|up 60.0 (178.0, 83.8),
down 34.8 (87.9, 45.1): 129.6 us a layer against 333.9 fused and 161.7 bf16 (1.25x bf16),
20-38 % of copy bandwidth, issue-bound (that version: 8.6 instructions a byte, 618 a step; the
scales since handed to the asm as int32 registers and the minimum spread by a multiplication,
where Triton packed four int8 copies with byte permutes: 7.5, 538 a step; Q5_K 11.2 -> 9.4;
not yet timed). Earlier versions: the nibbles joined into K-ordered
codes first (byte permutes for every operand register): 145.9 us against bf16's 118.9 on an
H200; one K=32 dot per sub-block with its scale applied to the int32 result before the next (a
wait on every dot): 250.5 against 170.2 on an H100.

None of the types but Q4_K is measured on a GPU yet (no device was lent when they were written). Their launches come from the static count of benchmarks/int8_sass.py (sm_90
SASS of the K loop, thread-instructions per weight byte), which tracks the measured kernels: bytes per second times
instructions per byte came to 9.8 and 9.7 TB/s x instr/B on an H100 for Q4_K's int8 kernel (8.6
a byte, 1.14 TB/s on gate|up) and the fused kernel on Q8_0 (7.2 a byte, a layer in 170 us: 1.36
TB/s), 14.8 for the fused kernel on Q6_K's down projection (24.7 a byte, 80 us: 0.6 TB/s).
Q8_0: 2.87 on 2 warps with mma.sync (no waits), 3.75 and a wait per group with wgmma on 4 warps,
7.2 fused (so about 2.5x the fused kernel's speed, up to the copy bandwidth); Q6_K: 9.8 on 2
warps with mma.sync, 11.1 and a wait per dot with wgmma, 24.7 fused (1.6-2.5x); Q5_K: 11.2 on
Q4_K's launch (wgmma) then 9.4, 36.6 fused (about 3x); IQ4_XS: 10.0 with mma.sync, 11.7 with wgmma, 21.0
fused (about 2x); with mma.sync, Q4_0 8.2 against 18.9, Q4_1 8.5 against 17.4, Q5_0 9.6
against 22.1, Q5_1 9.9 against 20.5 (9.5, 10.0, 10.9, 11.1 with IQ4_NL's word layout and a byte
permute a register), IQ4_NL 10.7 against 16.3. The rule takes
mma.sync where each small dot would wait under wgmma; the first GPU run must confirm it
(`--sections i8` sweeps both MMA kinds). An earlier Q8_0 trial on the first Q4_K version's path
(a wgmma and its wait per group) ran a layer in 178 us against the fused kernel's 170.
"""

from __future__ import annotations

import math

import torch

from paphos.layers import pdl
from paphos.quant.kernels import x_blocks
from paphos.quant.kernels.triton_int_i8 import I8Config

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels import split_k
    from paphos.quant.kernels.triton_int_i8 import nibbles_i8
except ImportError:  # CPU-only installs: the torch reference (planes.reference_matmul) serves
    triton = None

# IQ4_KVALUES as four int32 words of four int8 levels (level i: byte i % 4 of word i // 4), the
# tables of `_iq4_values`' byte permutes
IQ4_TABLES = (0xBFAD9881, 0xF6EADDCF, 0x26190D01, 0x71594535)
XB = 256  # K values per x block: one dx per token and block, the kernel's K step
# Up to this many tokens a step the int8 path runs (above: the fused kernel, then cuBLAS), in
# tiles of 16 tokens (with 32 a tile ptxas spills). 17-32 tokens, two tiles, were not measured:
# at most twice the 16-token time (H100: 259 us for a layer's Q4_K linears), below the fused
# kernel's 340 us at 32 tokens; at 64, four tiles' 518 us would not be.
I8_MAX_TOKENS = 32

TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")
_GROUP_TYPES = {"Q8_0": 0, "Q4_0": 1, "IQ4_NL": 2, "Q4_1": 3, "Q5_0": 4, "Q5_1": 5}  # `_group_kernel`'s NIB


def supports(type_name: str, k: int) -> bool:
    return type_name in TYPES and k % XB == 0


def stream_order(type_name: str) -> torch.Tensor:
    """[XB] int64: position j of a quantized x block holds value stream_order(type_name)[j] of the
    block, the order of the codes in the type's kernel operands. Q4_K and Q5_K (the same low
    plane): the low nibbles of the super-block's 128 bytes, then their high nibbles; byte i is
    byte 4w + b of sub-block i // 16's tile group (T = 4 words; code p of word w is value p * 4 + w,
    planes.py): codes 2b (low) and 2b + 1 (high) of word w. Q8_0: the 256 bytes as stored, byte
    4w + p of a 16-value tile group holding value p * 4 + w. Q6_K: per 16-value sub-block (two
    words of the low plane, T = 2), the low nibbles of its 8 bytes, then their high nibbles
    (`_q6_k_codes`). IQ4_XS, IQ4_NL: per 32-value group (a tile group, T = 4) its words' 8 codes
    in turn (`_iq4_values`). Q4_0, Q4_1, Q5_0, Q5_1: per 32-value group, the low nibbles of its
    16 bytes, then their high nibbles, byte b being byte b % 4 of word b // 4 (codes 2 (b % 4)
    and + 1), as Q4_K's sub-blocks (`_linear_nibbles`)."""
    j = torch.arange(XB)
    if type_name == "Q8_0":
        return j // 16 * 16 + j % 4 * 4 + j % 16 // 4
    if type_name == "Q6_K":
        sub, word, byte, high = j // 16, j % 8 // 4, j % 4, j % 16 // 8
        return sub * 16 + (2 * byte + high) * 2 + word
    if type_name in ("IQ4_XS", "IQ4_NL"):
        return j // 32 * 32 + j % 8 * 4 + j % 32 // 8
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # 16 bytes a group, their low nibbles first
        high, t = j % 32 // 16, j % 16
        return j // 32 * 32 + (2 * (t % 4) + high) * 4 + t // 4
    high, byte = j // 128, j % 128  # 128 bytes a super-block, 16 a sub-block
    t = byte % 16
    return byte // 16 * 32 + (2 * (t % 4) + high) * 4 + t // 4


# ---------------------------------------------------------------------------- Triton kernel

if triton is not None:
    # The inline PTX of the code assembly below (module constants so that tests/quant/ptx_sim.py can
    # run each on chosen registers). `_linear_nibbles`' for the linear 4- and 5-bit types: four
    # bytes' low or high nibbles ($1 the bytes, $2 the nibble shift 0 / 4), the fifth bits of a
    # 5-bit type ($6: the fifth-bit plane's byte of the bytes' word, bit p code p, the bytes'
    # codes 2b + nibble) spread by one multiplication (x 0x41041 on bits 0, 2, 4, 6 lands them on
    # bits 0, 8, 16, 24, nothing else there), the offset taken off with no carry between bytes
    # ((q + 0x80 - off) ^ 0x80)
    _NIBBLES = "{ .reg .b32 t, n, h; shr.b32 n, $1, $2; and.b32 n, n, 0x0F0F0F0F; "
    _FIFTH = ("shr.b32 t, $2, 2; shr.b32 h, $6, t; and.b32 h, h, 0x55; mul.lo.u32 h, h, 0x41041; "
              "and.b32 h, h, 0x01010101; shl.b32 h, h, 4; or.b32 n, n, h; ")

    def _offset(off: int) -> str:
        return f"add.u32 n, n, {(0x80 - off) * 0x01010101:#010x}; xor.b32 n, n, 0x80808080; "

    _ASM_Q4_0 = tl.constexpr(_NIBBLES + _offset(8) + "mov.b32 $0, n; }")
    _ASM_Q4_1 = tl.constexpr(_NIBBLES + "mov.b32 $0, n; }")
    _ASM_Q5_0 = tl.constexpr(_NIBBLES + _FIFTH + _offset(16) + "mov.b32 $0, n; }")
    _ASM_Q5_1 = tl.constexpr(_NIBBLES + _FIFTH + "mov.b32 $0, n; }")
    _ASM_SCALE_HALVES = tl.constexpr(
        "{ .reg .b32 h, l; shr.b32 h, $3, 3; and.b32 l, $3, 7; mul.lo.u32 $0, $2, h; mul.lo.u32 $1, $2, l; }"
    )  # fmt: skip
    _ASM_SPLAT = tl.constexpr("mul.lo.u32 $0, $1, 0x01010101;")
    _ASM_FIFTH_BITS = tl.constexpr(
        "{ .reg .b32 t, u; and.b32 t, $2, 0x55; mul.lo.u32 t, t, 0x41041; "
        "and.b32 t, t, 0x01010101; mul.lo.u32 $0, t, $6; shr.b32 u, $2, 1; and.b32 u, u, 0x55; "
        "mul.lo.u32 u, u, 0x41041; and.b32 u, u, 0x01010101; mul.lo.u32 $1, u, $6; }"
    )  # fmt: skip
    _ASM_Q6_K = tl.constexpr(
        "{ .reg .b32 n, h, t; and.b32 t, $4, 0xFF; shr.b32 n, $2, t; and.b32 n, n, 0x0F0F0F0F; "
        "and.b32 t, $5, 0xFF; shr.b32 h, $3, t; prmt.b32 h, h, 0, 0x1100; shl.b32 t, h, 4; "
        "and.b32 t, t, 0x00300030; and.b32 h, h, 0x30003000; or.b32 h, h, t; or.b32 n, n, h; "
        "add.u32 n, n, 0x60606060; xor.b32 $0, n, 0x80808080; and.b32 $1, $0, $6; }"
    )  # fmt: skip
    _ASM_IQ4 = tl.constexpr(
        "{ .reg .b32 w, i, a, b, y, m; and.b32 i, $2, 0xFF; shr.b32 w, $1, i; and.b32 i, w, 0x7777; "
        "prmt.b32 a, 0xBFAD9881, 0xF6EADDCF, i; prmt.b32 b, 0x26190D01, 0x71594535, i; shl.b32 y, w, 4; "
        "prmt.b32 m, w, y, 0x9D8C; and.b32 b, b, m; not.b32 m, m; and.b32 a, a, m; or.b32 $0, a, b; }"
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
    def _run_words(b):
        """Bytes [R, C] (uint8) -> int32 [R, C]: at every position, the word its run of four
        (positions 4j .. 4j + 3, little-endian) forms; what the asm sees as one register (the
        interpreter paths' stand-in)."""
        runs = tl.reshape(b.to(tl.int32), (b.shape[0], b.shape[1] // 4, 4)) << (8 * tl.arange(0, 4))[None, None, :]
        return tl.reshape(tl.broadcast_to(tl.sum(runs, axis=2)[:, :, None], runs.shape), b.shape)

    @triton.jit
    def _linear_nibbles(b, nib_shift, fifth, NIB: tl.constexpr, ASM: tl.constexpr):
        """A group's 4- or 5-bit codes -> their values as int8, by NIB (`_GROUP_TYPES`): 1 Q4_0 code
        - 8, 3 Q4_1 code, 4 Q5_0 code5 - 16, 5 Q5_1 code5 (code5: the code and its fifth bit). Per
        operand position k (0..31): b, byte k % 16 of the group's 16 low-plane bytes (uint8);
        nib_shift (int32), 0 for positions 0-15 (the bytes' low nibbles), 4 for 16-31 (their high
        nibbles): the layout of a GGUF block, which the mma operand takes as it is (a register:
        four positions of a row in a run of four); fifth (int32, 5-bit types), the fifth-bit
        plane's byte of the word holding byte k % 16 (bit p: the word's code p; byte k % 4 of the
        word holds codes 2 (k % 4) and + 1). GPU: four positions a register, as `_ASM_Q4_0` ..
        `_ASM_Q5_1` say; the int32 operands' first register of an instance is read."""
        if ASM:
            if NIB == 1:
                body: tl.constexpr = _ASM_Q4_0
            elif NIB == 3:
                body: tl.constexpr = _ASM_Q4_1
            elif NIB == 4:
                body: tl.constexpr = _ASM_Q5_0
            else:
                body: tl.constexpr = _ASM_Q5_1
            return tl.inline_asm_elementwise(body, "=r,r,r,r,r,r,r,r,r,r", [b, nib_shift, fifth], dtype=tl.int8,
                                             is_pure=True, pack=4)  # fmt: skip
        else:
            code = (b.to(tl.int32) >> nib_shift) & 15
            if NIB >= 4:
                p = 2 * (tl.arange(0, b.shape[1]) % 4)[None, :] + nib_shift // 4  # the code's index in its word
                code = code | (((fifth >> p) & 1) << 4)
            off: tl.constexpr = 8 if NIB == 1 else (16 if NIB == 4 else 0)
            return (code - off).to(tl.int8)

    @triton.jit
    def _iq4_values(words, code_shift, ASM: tl.constexpr):
        """IQ4_NL's and IQ4_XS's 4-bit codes -> their levels (IQ4_KVALUES) as int8. Per operand
        position: words, byte k % 4 of the low-plane word holding its code (a word's 8 codes, code p
        at bits 4p); code_shift, 0 for codes 0-3 of the word, 16 for codes 4-7. GPU: four positions
        a register (the word itself), the four codes the selector of two byte permutes over the
        level tables and a third turning each code's bit 3 into a byte mask choosing between them."""
        if ASM:
            return tl.inline_asm_elementwise(_ASM_IQ4, "=r,r,r", [words, code_shift], dtype=tl.int8, is_pure=True,
                                             pack=4)  # fmt: skip
        else:
            shift = code_shift.to(tl.int32) // 4 + (tl.arange(0, words.shape[1]) % 4)[None, :]  # the code's index
            code = (_run_words(words) >> (4 * shift)) & 15
            # the asm's tables (IQ4_TABLES): four levels a word, byte code % 4 of word code // 4
            table = tl.where(code < 8, tl.where(code < 4, -1079142271, -152379953),
                             tl.where(code < 12, 639175937, 1901675829))  # fmt: skip
            return ((((table >> (8 * (code % 4))) & 0xFF) ^ 0x80) - 0x80).to(tl.int8)

    @triton.jit
    def _q6_k_codes(lo, hi, nib_shift, hi_shift, second, ASM: tl.constexpr):
        """Q6_K codes as signed int8 v = q - 32 at a chunk's operand positions, and v on the second
        sub-block's positions only (zero on the first). Per position (all uint8 / int8, so that
        they share the dot operand's layout): lo, the low-plane byte holding its low 4 bits at
        `nib_shift` (0 or 4); hi, byte k % 4 of its sub-block's high-plane word, which holds its
        2 bits at `hi_shift` + 4 (k % 4); second, -1 on the second sub-block. GPU: four positions a
        register (k % 4 = 0..3, the operand's layout as `_scale_halves`): they share the shifts,
        and their register of `hi` is the whole word: its 4 nibbles spread into bytes (PRMT), the
        2 bits joined above the low nibbles, 32 taken off with no carry between bytes ((q + 0x60)
        ^ 0x80)."""
        if ASM:
            return tl.inline_asm_elementwise(_ASM_Q6_K, "=r,=r,r,r,r,r,r", [lo, hi, nib_shift, hi_shift, second],
                                             dtype=(tl.int8, tl.int8), is_pure=True, pack=4)  # fmt: skip
        else:
            at = hi_shift.to(tl.int32) + 4 * (tl.arange(0, lo.shape[1]) % 4)[None, :]
            nib = (lo.to(tl.int32) >> nib_shift.to(tl.int32)) & 15
            v = (nib | (((_run_words(hi) >> at) & 3) << 4)) - 32
            return v.to(tl.int8), tl.where(second != 0, v, 0).to(tl.int8)

    @triton.jit
    def _per_byte(t, BN: tl.constexpr, S: tl.constexpr, R: tl.constexpr):
        """[BN, S] -> [BN, S * R], each value repeated over its run of R."""
        return tl.reshape(tl.broadcast_to(t[:, :, None], (BN, S, R)), (BN, S * R))

    @triton.jit
    def _program(q_ptr, M, N, K, iters_per_split, BN: tl.constexpr, BM: tl.constexpr, KB: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
        """Every kernel's start: the wait for the kernel before, then x_blocks.program_tile of this
        program (grid: token tiles, row tiles, K slices) and the pointers to the first KB positions
        of its x operand's columns."""
        pdl.release(PDL)
        pdl.wait(PDL)
        rows, row_ok, ms, m_ok, first, tok, tok_ok, it0, it1 = x_blocks.program_tile(
            tl.program_id(1), tl.program_id(0), tl.program_id(2), N, M, K // 256, iters_per_split, BN, BM
        )
        return rows, row_ok, ms, m_ok, first, tok, tok_ok, it0, it1, x_blocks.part_pointers(q_ptr, first, tok, M, K, KB)

    @triton.jit
    def _store(out_t, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om, SPLIT: tl.constexpr,
               ASM: tl.constexpr):  # fmt: skip
        """Every kernel's end: its out^T tile [rows, tokens] through split_k.store_tile."""
        split_k.store_tile(out_t, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om,
                           tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tl.program_id(2),
                           tl.num_programs(2), SPLIT, ASM)  # fmt: skip

    @triton.jit
    def _row_scalar(ptr, rows, row_ok, per_row, at):
        return tl.load(ptr + rows.to(tl.int64) * per_row + at, mask=row_ok, other=0)

    @triton.jit
    def _q4_k_kernel(
        q_ptr, dx_ptr, out_ptr, part_ptr, count_ptr, w_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr,
        M, N, K, stride_om, iters_per_split,
        FIVE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """out [M, N] = x W^T for BN rows and BM tokens per program, super-blocks it0 .. it1 of K
        per program along grid axis 2 (module docstring). w_ptr: the low code plane as bytes; with
        FIVE (Q5_K) hi_ptr: the fifth-bit plane as bytes (unread otherwise)."""
        rows, row_ok, ms, m_ok, first, tok, tok_ok, it0, it1, x_cols = _program(q_ptr, M, N, K, iters_per_split, BN,
                                                                                BM, 128, PDL)  # fmt: skip
        n_blocks = K // 256
        x_ok = tok_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        w_rows = w_ptr + r64 * (K // 2) + tl.arange(0, 128)[None, :]
        hi_rows = hi_ptr + r64 * (K // 8) + tl.arange(0, 32)[None, :]  # byte j: low-plane word j's bits
        s_rows = r64 * (K // 32) + tl.arange(0, 8)[None, :]
        part_w = tl.where(first, 1.0, 1.0 / 254.0)  # 254 * (codes . q1) + codes . q2, over 254
        acc = tl.zeros((BN, 2 * BM), dtype=tl.float32)
        for it in range(it0, it1):
            sc = tl.load(sc_ptr + s_rows + it * 8, mask=row_ok[:, None], other=0)
            mn = tl.load(mn_ptr + s_rows + it * 8, mask=row_ok[:, None], other=0)
            wb = tl.load(w_rows + it * 128, mask=row_ok[:, None], other=0)
            x_lo = tl.load(x_cols + it * 256, mask=x_ok, other=0)  # x at the low nibbles' values
            x_hi = tl.load(x_cols + it * 256 + 128, mask=x_ok, other=0)
            dd = _row_scalar(sd_ptr, rows, row_ok, n_blocks, it).to(tl.float32)
            dm = _row_scalar(smin_ptr, rows, row_ok, n_blocks, it).to(tl.float32)
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
                bits = _per_byte(tl.load(hi_rows + it * 32, mask=row_ok[:, None], other=0).to(tl.int32), BN, 32, 4)
                lo_5, hi_5 = _fifth_bits(bits, sc_k, ASM)
                d_sc += 16 * tl.dot(hi_5, x_hi, tl.dot(lo_5, x_lo, out_dtype=tl.int32), out_dtype=tl.int32)
            acc += (d_sc.to(tl.float32) * dd[:, None] - d_mn.to(tl.float32) * dm[:, None]) * dx[None, :]
        _store(x_blocks.sum_parts(acc, BN, BM), out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om,
               SPLIT, ASM)  # fmt: skip

    @triton.jit
    def _group_kernel(
        q_ptr, dx_ptr, sum_ptr, out_ptr, part_ptr, count_ptr, w_ptr, hi_ptr, d_ptr, m_ptr, M, N, K, stride_om,
        iters_per_split,
        NIB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """`_q4_k_kernel`'s tiling for the types with an fp16 scale d per 32-value group (module
        docstring): per group one K=32 int8 dot, its two parts joined in int32, times d in float32,
        plus the group's fp16 minimum m times x's sum over the group (Q4_1, Q5_1); per x block of
        256 values the sum times dx. NIB 0 (Q8_0): the stored int8 bytes are the operand, w_ptr the
        code plane; else the group's 16 low-plane bytes (at w_ptr) and, for Q5_0 / Q5_1, its
        fifth-bit bytes (at hi_ptr) give its 32 values (`_linear_nibbles`; IQ4_NL: `_iq4_values`
        on its 4 words). d_ptr: the scales,
        m_ptr: the minimums, sum_ptr: x's sums per 32 values (read for Q4_1 and Q5_1 only)."""
        rows, row_ok, ms, m_ok, first, tok, tok_ok, it0, it1, x_cols = _program(q_ptr, M, N, K, iters_per_split, BN,
                                                                                BM, 32, PDL)  # fmt: skip
        n_blocks = K // 256
        x_ok = tok_ok[None, :]
        r64 = rows.to(tl.int64)
        k = tl.arange(0, 32)
        FIVE: tl.constexpr = NIB >= 4
        MIN: tl.constexpr = NIB == 3 or NIB == 5
        if NIB == 0:
            w_rows = w_ptr + r64[:, None] * K + k[None, :]
        elif NIB == 2:  # word k // 8, its codes 4 (k % 8 // 4) .. + 3: the word again for the second four
            w_rows = w_ptr + r64[:, None] * (K // 2) + (k // 8 * 4 + k % 4)[None, :]
            code_shift = tl.broadcast_to((16 * (k % 8 // 4)).to(tl.int8)[None, :], (BN, 32))
        else:  # byte k % 16: its low nibble, then again for its high nibble
            w_rows = w_ptr + r64[:, None] * (K // 2) + (k % 16)[None, :]
            nib_shift = tl.broadcast_to((4 * (k // 16))[None, :], (BN, 32))
            hi_rows = hi_ptr + r64[:, None] * (K // 8) + tl.arange(0, 4)[None, :]  # byte w: word w's bits
        d_rows = d_ptr + r64 * (K // 32)
        part_w = tl.where(first, 254, 1)  # 254 * (codes . q1) + codes . q2: x / dx * 254
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for it in range(it0, it1):
            dx = tl.load(dx_ptr + ms * n_blocks + it, mask=m_ok, other=0.0) * (1.0 / 254.0)
            step = tl.zeros((BN, BM), dtype=tl.float32)
            for c in tl.static_range(8):
                g = it * 8 + c
                d = tl.load(d_rows + g, mask=row_ok, other=0).to(tl.float32)
                if NIB == 0:
                    wv = tl.load(w_rows + g * 32, mask=row_ok[:, None], other=0)
                elif NIB == 2:
                    wv = _iq4_values(tl.load(w_rows + g * 16, mask=row_ok[:, None], other=0), code_shift, ASM)
                else:
                    wb = tl.load(w_rows + g * 16, mask=row_ok[:, None], other=0)
                    if FIVE:
                        # position k: word k % 16 // 4's byte
                        fifth = _per_byte(tl.load(hi_rows + g * 4, mask=row_ok[:, None], other=0).to(tl.int32), BN, 4, 4)
                        fifth = tl.reshape(tl.broadcast_to(fifth[:, None, :], (BN, 2, 16)), (BN, 32))
                    else:
                        fifth = nib_shift  # (unread)
                    wv = _linear_nibbles(wb, nib_shift, fifth, NIB, ASM)
                xb = tl.load(x_cols + g * 32, mask=x_ok, other=0)
                dot = x_blocks.sum_parts(tl.dot(wv, xb, out_dtype=tl.int32) * part_w[None, :], BN, BM)
                step += dot.to(tl.float32) * d[:, None]
                if MIN:  # + m sum(x): the sums are 254 sum(x) / dx, as the joined dot
                    mn = tl.load(m_ptr + r64 * (K // 32) + g, mask=row_ok, other=0).to(tl.float32)
                    xs = tl.load(sum_ptr + ms * (K // 32) + g, mask=m_ok, other=0).to(tl.float32)
                    step += mn[:, None] * xs[None, :]
            acc += step * dx[None, :]
        _store(acc, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om, SPLIT, ASM)


if triton is not None:

    @triton.jit
    def _chunk_kernel(
        q_ptr, dx_ptr, out_ptr, part_ptr, count_ptr, lo_ptr, hi_ptr, sc_ptr, sd_ptr, M, N, K, stride_om,
        iters_per_split,
        IQ4: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """`_q4_k_kernel`'s tiling for the types with signed 8-bit scales per 16 or 32 values and an
        fp16 d per super-block (module docstring), a K=32 chunk at a time, the scales applied to
        the chunk's int32 dots and summed exactly over the super-block, then times d dx in
        float32. Q6_K: two 16-value sub-blocks a chunk (16 low-plane bytes, 2 high-plane words a
        row), the signed codes as one operand and again with the first sub-block zeroed, sc_a D +
        (sc_b - sc_a) D_b. IQ4_XS (IQ4): one 32-value sub-block a chunk (4 low-plane words), the
        codes' levels as the operand, sc D. lo_ptr, hi_ptr: the planes as bytes (hi unread for
        IQ4_XS)."""
        rows, row_ok, ms, m_ok, first, tok, tok_ok, it0, it1, x_cols = _program(q_ptr, M, N, K, iters_per_split, BN,
                                                                                BM, 32, PDL)  # fmt: skip
        n_blocks = K // 256
        x_ok = tok_ok[None, :]
        r64 = rows.to(tl.int64)
        k = tl.arange(0, 32)  # a chunk's operand positions
        if IQ4:  # word k // 8, its codes 4 (k % 8 // 4) .. + 3: the word again for the second four
            lo_rows = lo_ptr + r64[:, None] * (K // 2) + (k // 8 * 4 + k % 4)[None, :]
            code_shift = tl.broadcast_to((16 * (k % 8 // 4)).to(tl.int8)[None, :], (BN, 32))
            sc_rows = sc_ptr + r64 * (K // 32)
        else:  # Q6_K: sub-block k // 16, high nibble k // 8 % 2
            second, high, word = k // 16, k // 8 % 2, k % 8 // 4
            lo_rows = lo_ptr + r64[:, None] * (K // 2) + (second * 8 + k % 8)[None, :]
            hi_rows = hi_ptr + r64[:, None] * (K // 4) + (second * 4 + k % 4)[None, :]
            nib_shift = tl.broadcast_to((4 * high).to(tl.int8)[None, :], (BN, 32))
            hi_shift = tl.broadcast_to((16 * word + 2 * high).to(tl.int8)[None, :], (BN, 32))
            second_mask = tl.broadcast_to((-second).to(tl.int8)[None, :], (BN, 32))
            sc_rows = sc_ptr + r64 * (K // 16)
        part_w = tl.where(first, 1.0, 1.0 / 254.0)
        acc = tl.zeros((BN, 2 * BM), dtype=tl.float32)
        for it in range(it0, it1):
            dd = _row_scalar(sd_ptr, rows, row_ok, n_blocks, it).to(tl.float32)
            dx = tl.load(dx_ptr + tok * n_blocks + it, mask=tok_ok, other=0.0) * part_w
            step = tl.zeros((BN, 2 * BM), dtype=tl.int32)
            for c in tl.static_range(8):
                lo = tl.load(lo_rows + it * 128 + c * 16, mask=row_ok[:, None], other=0)
                xb = tl.load(x_cols + it * 256 + c * 32, mask=x_ok, other=0)
                if IQ4:
                    sc = tl.load(sc_rows + it * 8 + c, mask=row_ok, other=0).to(tl.int32)
                    step += sc[:, None] * tl.dot(_iq4_values(lo, code_shift, ASM), xb, out_dtype=tl.int32)
                else:
                    hw = tl.load(hi_rows + it * 64 + c * 8, mask=row_ok[:, None], other=0)
                    sc_a = tl.load(sc_rows + it * 16 + 2 * c, mask=row_ok, other=0).to(tl.int32)
                    sc_b = tl.load(sc_rows + it * 16 + 2 * c + 1, mask=row_ok, other=0).to(tl.int32)
                    v, v_b = _q6_k_codes(lo, hw, nib_shift, hi_shift, second_mask, ASM)
                    step += sc_a[:, None] * tl.dot(v, xb, out_dtype=tl.int32)
                    step += (sc_b - sc_a)[:, None] * tl.dot(v_b, xb, out_dtype=tl.int32)
            acc += step.to(tl.float32) * dd[:, None] * dx[None, :]
        _store(x_blocks.sum_parts(acc, BN, BM), out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om,
               SPLIT, ASM)  # fmt: skip


# ---------------------------------------------------------------------------- launches


# (type, N, K, tokens per program) -> a launch measured better than `i8_config`'s, filled by
# benchmarks/bench_gguf_gpu.py's `i8` sweep (the engine sections after it use them)
TUNED_CONFIGS: dict[tuple[str, int, int, int], I8Config] = {}


def i8_config(type_name: str, rows: int, k: int, m: int, programs_per_sm: int = 2) -> I8Config:
    """The launch at M tokens (16 per program, the token tiles of a row tile side by side in the
    grid so the second reads the weights from L2): 64 rows, 3 stages, K split while the grid stays
    within `programs_per_sm` programs per multiprocessor and each slice keeps two super-blocks
    (q|k 2 slices, o and down 4). Q4_K on 4 warps (wgmma, the rule the H200 sweep's winners
    follow; 32 rows with 2 warps, mma.sync, came 1.2-1.4x slower and spill under triton 3.6);
    Q5_K as Q4_K; the others on 2 warps (mma.sync: no wait after each small dot, the
    fewest instructions a byte in the module docstring's count; not yet measured on a GPU). A
    per-shape entry of TUNED_CONFIGS wins."""
    bm = 16
    tuned = TUNED_CONFIGS.get((type_name, rows, k, bm))
    if tuned is not None:
        return tuned
    block_n = 64
    tiles = math.ceil(rows / block_n) * math.ceil(m / bm)
    blocks, split = k // XB, 1
    while blocks // (split * 2) >= 2 and tiles * split * 2 <= programs_per_sm * split_k.NUM_SMS_GUESS:
        split *= 2
    return I8Config(block_n, bm, split, num_warps=4 if type_name in ("Q4_K", "Q5_K") else 2, num_stages=3)


def quantize_x(x: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> the (parts, dx, sums) of x_blocks in `type_name`'s stream order; the kernels
    read the parts and dx, and Q4_1's and Q5_1's the sums per 32 values (their minimum's term;
    the K-quants' minimum has a dot of its own)."""
    order = x_blocks.device_order(type_name, x.device, lambda: stream_order(type_name))
    return x_blocks.quantize(x, order, XB, 32 if type_name in ("Q4_1", "Q5_1") else XB)


def matmul_into(
    out: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seg: object,
    cfg: I8Config | None = None,
) -> None:  # fmt: skip
    """out [M, seg.rows] (a column slice of the linear's output, unit stride on rows) = x W^T of
    one segment of a supported type (triton_gguf.Segment), from `quantize_x` in that type's
    order; `cfg` overrides `i8_config`."""
    parts, dx, sums = xq
    m, k = out.shape[0], seg.k
    n = seg.rows
    cfg = cfg or i8_config(seg.type_name, n, k, m)
    tiles = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    cut = split_k.slices(k // XB, cfg.split_k, tiles[0] * tiles[1], m, n, out.device)
    p = seg.planes
    extra: dict[str, bool | int] = {}
    xq_args = (parts, dx)
    if seg.type_name in _GROUP_TYPES:
        lo = p["lo"] if seg.type_name == "Q8_0" else p["lo"].view(torch.uint8)
        hi = p["hi"].view(torch.uint8) if "hi" in p else lo
        kernel, planes = _group_kernel, (lo, hi, p["sc"], p.get("mn", p["sc"]))
        extra["NIB"] = _GROUP_TYPES[seg.type_name]
        xq_args = (parts, dx, sums)
    elif seg.type_name in ("Q6_K", "IQ4_XS"):
        lo = p["lo"].view(torch.uint8)
        kernel, planes = _chunk_kernel, (lo, p["hi"].view(torch.uint8) if "hi" in p else lo, p["sc"], p["sd"])
        extra["IQ4"] = seg.type_name == "IQ4_XS"
    else:
        lo = p["lo"].view(torch.uint8)
        kernel, planes = _q4_k_kernel, (lo, p["hi"].view(torch.uint8) if "hi" in p else lo, p["sc"], p["sd"], p["mn"],
                                        p["smin"])  # fmt: skip
        extra["FIVE"] = seg.type_name == "Q5_K"
    kernel[(*tiles, cut.count)](
        *xq_args, out, cut.partials, cut.counters, *planes, m, n, k, out.stride(0), cut.per,
        BN=cfg.block_n, BM=cfg.block_m, SPLIT=cut.split, ASM=out.is_cuda, **extra,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(out),
    )  # fmt: skip
