"""Q6_K weights decoded for the GGUF fused kernel's tensor-core tiles (triton_gguf.py's
`_fused_kernel` at 2-64 tokens, bf16 or fp16 x): `decode` turns a [BN, BK] tile of the repacked
planes (planes.py: the low nibbles, the two high bits and the int8 scales per 16 values, the fp16
super-scale per 256) into 16-bit weights by inline PTX on pairs of values (`_q6_k_asm`), each
weight rounded once from code x scale, where `_dequant_tile` takes every code and scale through
float32 (sm_90 SASS at 16 tokens: 8.6 instructions a weight in the K loop against 19.7-20.4).
Off the GPU (the Triton interpreter) the same arithmetic runs as float32 steps, bit for bit
(tests/quant/test_gguf_triton.py runs the PTX by tests/quant/ptx_sim.py against them).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels.int_layout import plane_offset
except ImportError:  # CPU-only installs: triton_gguf is not used either
    triton = None

# The decoded tile as [BK, BN] (`decode`) for triton before 3.9: triton 3.6 stores the
# [BN, BK] tile to shared memory value by value (a layout that keeps rows contiguous there), the
# transposed one in 16-byte vectors, and 3.9 the other way round (sm_90 SASS at 16 tokens, 32 rows:
# 8.6 against 10.5 instructions a weight on 3.6, 8.6 against 10.6 the other way on 3.9; on an
# H100 with 3.6, v at 16 tokens 10.1 against 12.5 us), and 3.6 cannot lower the [BN, BK] tile of
# 64 tokens at all.
TRANSPOSED = triton is not None and tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9)

if triton is not None:

    def _q6_k_asm(float16: bool) -> str:
        """PTX for `decode`: one 16-value group's two low-plane words ($16, $17), its high word
        ($18) and its scale as two 16-bit parts ($19 + $20) -> its 16 weights in value order ($0 ..
        $15, 16-bit). Value 2p + w is code p of low word w (bits 4p) with high bits 16w + 2p of the
        high word (planes.py's tile order), so one byte permute puts the nibbles of values 2p and
        2p + 1 in the two halves of a register; the high bits are shifted in beside them and the
        exponent of BASE OR-ed in (128 in bf16, 1024 in fp16, whose seven / ten mantissa bits hold
        a code exactly), one fma per pair subtracts BASE + 32 (exact), and two more form
        code x hi + (code x lo), rounded once: the correctly rounded code x scale but where it
        lies within 2^-16 of a rounding boundary."""
        base, one, neg, fma = (
            ("0x64006400", "0x3C003C00", "0xE420E420", "fma.rn.f16x2") if float16
            else ("0x43004300", "0x3F803F80", "0xC320C320", "fma.rn.bf16x2")
        )  # fmt: skip
        lines = [
            "{ .reg .b32 x, h, c, t, hi, lo, z, one, neg;",
            "mov.b32 hi, {$19, $19};",
            "mov.b32 lo, {$20, $20};",
            "mov.b32 z, 0x80008000;",
            f"mov.b32 one, {one};",
            f"mov.b32 neg, {neg};",
        ]
        for p in range(8):
            if p % 2 == 0:
                lines.append(f"prmt.b32 x, $16, $17, 0x0{p // 2 + 4:x}0{p // 2:x};")
            else:
                lines.append("shr.u32 x, x, 4;")
            shift = 4 - 2 * p
            lines.append(f"shl.b32 h, $18, {shift};" if shift >= 0 else f"shr.u32 h, $18, {-shift};")
            lines.append(f"lop3.b32 h, h, 0x00300030, {base}, 0xEA;")  # (h & mask) | base
            lines.append("lop3.b32 c, x, 0x000F000F, h, 0xEA;")  # (x & mask) | h
            lines.append(f"{fma} c, c, one, neg;")
            lines.append(f"{fma} t, c, lo, z;")
            lines.append(f"{fma} t, c, hi, t;")
            lines.append(f"mov.b32 {{${2 * p}, ${2 * p + 1}}}, t;")
        return " ".join(lines) + " }"

    _ASM_Q6_K_BF16 = tl.constexpr(_q6_k_asm(False))
    _ASM_Q6_K_F16 = tl.constexpr(_q6_k_asm(True))
    _Q6_K_CONSTRAINTS = tl.constexpr("=h," * 16 + "r,r,r,h,h")

    @triton.jit
    def _interleave(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
        """16 tensors [A, B] -> [A, B, 16], value j at j: nested joins whose last one separates even
        from odd values (a reshape's last axis is its fastest)."""
        e = tl.join(tl.join(tl.join(v0, v8), tl.join(v4, v12)), tl.join(tl.join(v2, v10), tl.join(v6, v14)))
        o = tl.join(tl.join(tl.join(v1, v9), tl.join(v5, v13)), tl.join(tl.join(v3, v11), tl.join(v7, v15)))
        t = tl.join(e, o)
        return tl.reshape(t, (t.shape[0], t.shape[1], 16))

    @triton.jit
    def _rounded(v, DTYPE: tl.constexpr):
        """float32 v rounded to the nearest (ties to even) DTYPE value, as float32; for bf16 by integer
        steps, since the Triton interpreter's conversion to bf16 truncates."""
        if DTYPE == tl.bfloat16:
            b = v.to(tl.int32, bitcast=True)
            return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        else:
            return v.to(DTYPE).to(tl.float32)

    @triton.jit
    def decode(
        lo_ptr, hi_ptr, sc_ptr, sd_ptr, rows, row_mask, k0, K,
        BN: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr, TRANSPOSED: tl.constexpr,
        TT: tl.constexpr,
    ):  # fmt: skip
        """Q6_K weights [BN, BK] of rows `rows`, values k0 .. k0 + BK, in DTYPE (bf16 / fp16), decoded
        in pairs by 16-bit arithmetic (`_q6_k_asm`) where `_dequant_tile` takes every code and
        scale to float32 and back. The scale (int8 scale x fp16 super-scale, exact in float32) is
        split into DTYPE parts hi + lo so that each weight is rounded once from code x (hi + lo).
        With TRANSPOSED the groups are decoded as [groups, rows] and the tile built as [BK, BN]
        (`TRANSPOSED`)."""
        G: tl.constexpr = BK // 16
        if TRANSPOSED:
            r = rows.to(tl.int64)[None, :]
            m2 = row_mask[None, :]
            g = k0 // 16 + tl.arange(0, G)[:, None]
        else:
            r = rows.to(tl.int64)[:, None]
            m2 = row_mask[:, None]
            g = k0 // 16 + tl.arange(0, G)[None, :]
        # planes tiled by TT rows (planes.py): 32 low words, 16 high words, 16 scales a row and 256 values
        w0 = tl.load(lo_ptr + plane_offset(r, 2 * g, K // 8, TT, 32), mask=m2, other=0)
        w1 = tl.load(lo_ptr + plane_offset(r, 2 * g + 1, K // 8, TT, 32), mask=m2, other=0)
        hw = tl.load(hi_ptr + plane_offset(r, g, K // 16, TT, 16), mask=m2, other=0)
        sc = tl.load(sc_ptr + plane_offset(r, g, K // 16, TT, 16), mask=m2, other=0).to(tl.float32)
        sd = tl.load(sd_ptr + plane_offset(r, g // 16, K // 256, TT, 1), mask=m2, other=0).to(tl.float32)
        s = sc * sd  # exact: 8 x 11 bits
        hi = _rounded(s, DTYPE)
        lo = _rounded(s - hi, DTYPE)
        if ASM:
            if DTYPE == tl.float16:
                v = tl.inline_asm_elementwise(_ASM_Q6_K_F16, _Q6_K_CONSTRAINTS, [w0, w1, hw, hi.to(DTYPE), lo.to(DTYPE)],
                                              dtype=(tl.float16,) * 16, is_pure=True, pack=1)  # fmt: skip
            else:
                v = tl.inline_asm_elementwise(_ASM_Q6_K_BF16, _Q6_K_CONSTRAINTS, [w0, w1, hw, hi.to(DTYPE), lo.to(DTYPE)],
                                              dtype=(tl.bfloat16,) * 16, is_pure=True, pack=1)  # fmt: skip
            t = _interleave(*v)
        else:  # the asm's steps in float32, each exact but its two roundings to DTYPE
            j = tl.arange(0, 16)[None, None, :]
            low = tl.where(j % 2 == 0, w0[:, :, None], w1[:, :, None])
            q = ((low >> (4 * (j // 2))) & 15) | (((hw[:, :, None] >> (16 * (j % 2) + 2 * (j // 2))) & 3) << 4)
            c = (q - 32).to(tl.float32)
            part = _rounded(c * lo[:, :, None], DTYPE)
            t = _rounded(c * hi[:, :, None] + part, DTYPE).to(DTYPE)
        if TRANSPOSED:
            return tl.trans(tl.reshape(tl.permute(t, (0, 2, 1)), (BK, BN)))
        return tl.reshape(t, (BN, BK))
