"""The batch-1 decode GEMV of GGUF weights on CUDA: y = W x for one token, W in the repacked planes
of planes.py (tile order; no other layout, no extra memory).

Data flow: `triton_gguf.gemv_matmul` sends M == 1 here for every format `supports` accepts (IQ4
and Q3_K, and M > 1, take triton_gguf's `_fused_kernel`) -> `gemv` -> one launch per segment, no
split-K (no atomics, no zeroed fp32 output, no cast kernel after), written in the activation
dtype. Two kernels:

`_gemv_int8_kernel` (`integer_dots`: Q4_0, Q4_1, Q4_K, Q6_K, Q8_0; the default). At batch 1 a
4-bit weight brings 8 codes per 4 bytes, so instructions per code decide whether the GEMV streams
at memory speed (an H200 SM issues 128 lanes of instructions per clock). Here codes are never
converted to floats: x comes as two int8 parts per tile group, packed in the codes' byte order
(paphos/layers/x_int8.py: about 15 bits of x, results within 1e-4 of the exact product), written
once per step and code layout by the kernel that produced x or by one small launch; each program
loads it for the whole of K (T tile groups in registers, one per thread or a few) and streams RPP
rows past it, BN at a time: per word of 8 nibbles two masks and four `dp4a` (4 byte products
each); Q6_K's 2 high bits (read as the 16-bit half of its high word that belongs to each low
word, so both planes load in one register layout) join their nibbles by a bit spread per word.
Scales, mins and offsets apply once per tile group, in float32. Launched with programmatic
dependent launch (paphos/layers/pdl.py): a program issues its first weight loads before waiting
for the kernels that write x.

`_gemv_kernel` (the other linear formats: Q2_K, Q5_*): float codes without int->float
conversions (a quarter-rate pipe): a code masked in place at bit LO*p of a word and OR-ed into the
mantissa of 2^23 is the float 2^23 + code * 2^(LO*p) exactly; subtracting (2^23 + OFF * 2^(LO*p))
gives (code - OFF) * 2^(LO*p) exactly, and the x it multiplies is pre-scaled by 2^-(LO*p); codes at
bits >= 16 come from the word shifted by 16. Per code one LOP3, one FADD, one FFMA; the x chunk is
loaded and scaled once per program and K chunk, shared by the BN rows a thread holds. Its result
is the float32 product of the exact dequantized weights with x (tests: 1e-5 of the reference).

Both: a tile is [BN rows, tile groups, words of a group], a thread loads a group's words as one
16-byte vector, and for a code position p the words of a group hold consecutive values (tile
order), so x for p is one vector in the same layout: no layout conversions in the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from paphos.layers import pdl, x_int8
from paphos.quant.gguf.planes import Format, tile_values

if TYPE_CHECKING:
    from paphos.quant.gguf.triton_gguf import Segment

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels.int_layout import plane_offset
except ImportError:  # CPU-only installs: triton_gguf is not used either
    triton = None


def supports(fmt: Format) -> bool:
    """Formats of linear levels with at most one high-bit word per scale group (all but the IQ4
    look-up tables and Q3_K, whose 16-value groups own half a word of high bits)."""
    return not fmt.lut and fmt.sg * fmt.hi in (0, 32)


if triton is not None:

    @triton.jit
    def _tile_dots(
        lo_ptr, hi_ptr, x_ptr, r3, t, m3, stride_lo, stride_hi, hi_tile_stride,
        LO: tl.constexpr, HI: tl.constexpr, BIAS: tl.constexpr, TW: tl.constexpr, MINK: tl.constexpr,
        TT: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        """Per row and tile group t of the chunk: (sum over the group's values of (code - BIAS) * x,
        sum of x) -> ([BN, T], [T]), codes = lo | hi << LO. Every tensor is [BN, T, TW] (the low
        words: one thread owns a group's TW words, one vector load) or a slice of it: for code
        position p the TW words hold consecutive values (tile order), so x for p is one vector too
        and lands in the same layout; no layout conversions."""
        PER: tl.constexpr = 32 // LO  # codes per low word
        PH: tl.constexpr = PER // 2  # codes per 16-bit half word
        MASK: tl.constexpr = (1 << LO) - 1
        TV: tl.constexpr = TW * PER  # values per tile group
        w = tl.arange(0, TW)
        at = (t * TW)[None, :, None] + w[None, None, :]
        lo = tl.load(lo_ptr + plane_offset(r3, at, stride_lo, TT, TILE * LO // 32), mask=m3, other=0)
        if LO == 8:
            lo = lo ^ -2139062144  # 0x80808080: signed bytes -> code + 128 (BIAS is 128)
        lo16 = lo >> 16
        if HI > 0:
            # one high word per tile group, codes in the low words' order: word w's at w * PER * HI.
            # (The stride is a runtime 1: a known-contiguous index along the tile groups would be
            # vectorised there, in a layout other than the low words'.)
            at_hi = (t * hi_tile_stride)[None, :, None]
            hi = tl.load(hi_ptr + plane_offset(r3, at_hi, stride_hi, TT, TILE * HI // 32), mask=m3, other=0)
            hi = hi >> (w * (PER * HI))[None, None, :]
        xk = (t * TV)[:, None] + w[None, :]  # [T, TW]: value index of each word's code 0
        dot = tl.zeros(lo.shape, dtype=tl.float32)
        xsum = tl.zeros(xk.shape, dtype=tl.float32)
        for p in tl.static_range(PER):
            at = LO * (p % PH)
            if p < PH:
                src = lo
            else:
                src = lo16
            v = ((src & (MASK << at)) | 0x4B000000).to(tl.float32, bitcast=True) - (
                8388608.0 + BIAS * (1 << at)
            )
            xp = tl.load(x_ptr + xk + p * TW).to(tl.float32)
            dot += v * (xp * (1.0 / (1 << at)))[None]
            if HI > 0:
                vh = ((hi & (((1 << HI) - 1) << (HI * p))) | 0x4B000000).to(
                    tl.float32, bitcast=True
                ) - 8388608.0
                dot += vh * (xp * ((1 << LO) / (1 << (HI * p))))[None]
            if MINK > 0:
                xsum += xp
        return tl.sum(dot, axis=2), tl.sum(xsum, axis=1)

    @triton.jit
    def _dp4a(a, b, c, ASM: tl.constexpr):
        """c + the dot product of the four signed bytes of a and b (int32 tensors): one `dp4a` on
        the GPU; spelled out byte by byte where inline PTX cannot run (the interpreter)."""
        if ASM:
            return tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            acc = c
            for j in tl.static_range(4):
                acc += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
            return acc

    @triton.jit
    def _code_bytes(lo, hi, LO: tl.constexpr, HI: tl.constexpr):
        """Low words [BN, T, TW] (and Q6_K's 16 high bits of each, int16) -> the codes as bytes in
        the order x_int8's `_pack_byte` packs x: (a, b) int32 words. 4-bit codes p = 2j and 2j + 1 of a word
        are byte j of a and b; the 2 high bits of code p (bits 2 p of the word's high bits) go to
        bits 4-5 of the same byte; 8-bit codes are their word (a)."""
        if LO == 8:
            return lo, lo
        a = lo & 0x0F0F0F0F
        b = (lo >> 4) & 0x0F0F0F0F
        if HI == 2:
            h = hi.to(tl.int32) & 0xFFFF  # bit pairs of codes 0..7
            h = (h | (h << 8)) & 0x00FF00FF
            h = (h | (h << 4)) & 0x0F0F0F0F  # codes 2j, 2j + 1's pairs: low nibble of byte j
            a |= (h << 4) & 0x30303030
            b |= (h << 2) & 0x30303030
        return a, b

    @triton.jit
    def _int8_dot(ca, cb, xa, xb, LO: tl.constexpr, ASM: tl.constexpr):
        """Code bytes [BN, T, TW] (`_code_bytes`) times one packed int8 part of x [T, TW] -> per
        row and tile group the integer sum of code * x [BN, T] (4 codes per `dp4a`)."""
        d = _dp4a(ca, tl.broadcast_to(xa[None, :, :], ca.shape), tl.zeros(ca.shape, dtype=tl.int32), ASM)
        if LO != 8:
            d = _dp4a(cb, tl.broadcast_to(xb[None, :, :], cb.shape), d, ASM)
        return tl.sum(d, axis=2)

    @triton.jit
    def scale_loads(
        sc_ptr, sd_ptr, mn_ptr, smin_ptr, r, g, m2, stride_g, stride_s,
        SG: tl.constexpr, SCALE: tl.constexpr, MINK: tl.constexpr, SCMIN_NIB: tl.constexpr, TT: tl.constexpr,
        TILE: tl.constexpr,
    ):  # fmt: skip
        """The raw scale-group planes of rows r [BN, 1] and groups g [G] (what `scale_decode`
        reads): loaded apart from the decoding so a GEMV can issue them ahead of use."""
        at_g = plane_offset(r, g[None, :], stride_g, TT, TILE // SG)
        sc = tl.load(sc_ptr + at_g, mask=m2, other=0)
        sd = sc
        if SCALE != 0:  # a K-quant: one super-scale (and super-min) a tile
            sd = tl.load(sd_ptr + plane_offset(r, (g // (256 // SG))[None, :], stride_s, TT, 1), mask=m2,
                         other=0)  # fmt: skip
        mn = sc
        if MINK == 1 or (MINK == 2 and not SCMIN_NIB):
            mn = tl.load(mn_ptr + at_g, mask=m2, other=0)
        smin = sc
        if MINK == 2:
            smin = tl.load(smin_ptr + plane_offset(r, (g // (256 // SG))[None, :], stride_s, TT, 1), mask=m2,
                           other=0)  # fmt: skip
        return sc, sd, mn, smin

    @triton.jit
    def scale_decode(
        sc, sd, mn, smin, SCALE: tl.constexpr, MINK: tl.constexpr, SCMIN_NIB: tl.constexpr,
    ):  # fmt: skip
        """`scale_loads`' planes -> (scale, min) [BN, G] float32: a value of the group is
        scale * (code - OFF) + min (min 0 without MINK)."""
        if SCMIN_NIB:
            sc_int = sc.to(tl.int32) & 15
        else:
            sc_int = sc
        if SCALE == 0:
            s = sc_int.to(tl.float32)
        else:
            s = sd.to(tl.float32) * sc_int.to(tl.float32)
        m = tl.zeros(s.shape, dtype=tl.float32)
        if MINK == 1:
            m = mn.to(tl.float32)
        elif MINK == 2:
            if SCMIN_NIB:
                mq = (sc.to(tl.int32) >> 4).to(tl.float32)
            else:
                mq = mn.to(tl.float32)
            m = -(smin.to(tl.float32) * mq)
        return s, m

    @triton.jit
    def group_scale_min(
        sc_ptr, sd_ptr, mn_ptr, smin_ptr, r, g, m2, stride_g, stride_s,
        SG: tl.constexpr, SCALE: tl.constexpr, MINK: tl.constexpr, SCMIN_NIB: tl.constexpr, TT: tl.constexpr,
        TILE: tl.constexpr,
    ):  # fmt: skip
        """Rows r [BN, 1] and scale groups g [G] -> (scale, min) [BN, G] float32 (`scale_decode`).
        Shared with triton_gguf's tiles."""
        sc, sd, mn, smin = scale_loads(sc_ptr, sd_ptr, mn_ptr, smin_ptr, r, g, m2, stride_g, stride_s, SG, SCALE,
                                       MINK, SCMIN_NIB, TT, TILE)  # fmt: skip
        return scale_decode(sc, sd, mn, smin, SCALE, MINK, SCMIN_NIB)

    @triton.jit
    def _scaled(dot, xsum, s, m, MINK: tl.constexpr):
        """Per row and tile group: the group's scale times the dot product, plus its min times
        the sum of x -> [BN, T]."""
        if MINK > 0:
            return s * dot + m * xsum[None, :]
        return s * dot

    @triton.jit
    def _gemv_kernel(
        x_ptr, out_ptr, lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, N, K, stride_lo, stride_hi,
        stride_g, stride_s, hi_tile_stride,
        LO: tl.constexpr, HI: tl.constexpr, OFF: tl.constexpr, SG: tl.constexpr, SCALE: tl.constexpr,
        MINK: tl.constexpr, SCMIN_NIB: tl.constexpr, TW: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr,
        EVEN_K: tl.constexpr, PDL: tl.constexpr, TT: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        """Float codes: one program per BN rows, K in chunks of KC values."""
        pdl.release(PDL)
        pdl.wait(PDL)
        TV: tl.constexpr = TW * 32 // LO  # values per tile group
        T: tl.constexpr = KC // TV  # tile groups per K chunk
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        row_ok = rows < N
        r = rows.to(tl.int64)[:, None]
        rm = row_ok[:, None]
        tr = tl.arange(0, T)
        acc = tl.zeros((BN, T), dtype=tl.float32)
        for k0 in range(0, K, KC):
            t = k0 // TV + tr
            if EVEN_K:
                m2 = rm
            else:
                t_ok = t < K // TV
                t = tl.where(t_ok, t, 0)  # past K: read tile 0, its scales load as 0
                m2 = rm & t_ok[None, :]
            dot, xsum = _tile_dots(
                lo_ptr, hi_ptr, x_ptr, r[:, :, None], t, m2[:, :, None], stride_lo, stride_hi, hi_tile_stride,
                LO, HI, OFF, TW, MINK, TT, TILE,
            )  # fmt: skip
            s, m = group_scale_min(sc_ptr, sd_ptr, mn_ptr, smin_ptr, r, t * TV // SG, m2, stride_g, stride_s, SG,
                                   SCALE, MINK, SCMIN_NIB, TT, TILE)  # fmt: skip
            acc += _scaled(dot, xsum, s, m, MINK)
        y = tl.sum(acc, axis=1)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _int8_block_loads(
        lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, rows, N, t, t_ok, g, stride_lo, stride_hi, stride_g,
        stride_s,
        LO: tl.constexpr, HI: tl.constexpr, SG: tl.constexpr, SCALE: tl.constexpr, MINK: tl.constexpr,
        TW: tl.constexpr, TT: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        """Every plane a block of rows reads: low words [BN, T, TW], Q6_K's high bits of each low
        word [BN, T, TW] (the 16-bit halves of its high word per tile group: `gemv` passes that
        plane as int16, so both load in one layout) and the scale planes [BN, T]."""
        r = rows.to(tl.int64)[:, None]
        m2 = (rows < N)[:, None] & t_ok[None, :]
        m3 = m2[:, :, None]
        at = (t * TW)[None, :, None] + tl.arange(0, TW)[None, None, :]
        lo = tl.load(lo_ptr + plane_offset(r[:, :, None], at, stride_lo, TT, TILE * LO // 32), mask=m3, other=0)
        hi = lo
        if HI > 0:  # int16: the high bits of a low word
            hi = tl.load(hi_ptr + plane_offset(r[:, :, None], at, stride_hi, TT, TILE * LO // 32), mask=m3, other=0)
        sc, sd, mn, smin = scale_loads(sc_ptr, sd_ptr, mn_ptr, smin_ptr, r, g, m2, stride_g, stride_s, SG, SCALE,
                                       MINK, False, TT, TILE)  # fmt: skip
        return lo, hi, sc, sd, mn, smin

    @triton.jit
    def _int8_block_out(
        lo, hi, sc, sd, mn, smin, q1a, q1b, q2a, q2b, dx, dr, xsum, rows, N, out_ptr,
        LO: tl.constexpr, HI: tl.constexpr, OFF: tl.constexpr, SCALE: tl.constexpr, MINK: tl.constexpr,
        ASM: tl.constexpr,
    ):  # fmt: skip
        """A block of rows' outputs from its planes (`_int8_block_loads`) and the quantized x."""
        ca, cb = _code_bytes(lo, hi, LO, HI)
        dot = (_int8_dot(ca, cb, q1a, q1b, LO, ASM).to(tl.float32) * dx[None, :]
               + _int8_dot(ca, cb, q2a, q2b, LO, ASM).to(tl.float32) * dr[None, :])  # fmt: skip
        if OFF > 0:
            dot -= OFF * xsum[None, :]
        s, m = scale_decode(sc, sd, mn, smin, SCALE, MINK, False)
        term = _scaled(dot, xsum, s, m, MINK)
        tl.store(out_ptr + rows, tl.sum(term, axis=1).to(out_ptr.dtype.element_ty), mask=rows < N)

    @triton.jit
    def _gemv_int8_kernel(
        q_ptr, f_ptr, out_ptr, lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, N, K, stride_lo, stride_hi, stride_g,
        stride_s,
        LO: tl.constexpr, HI: tl.constexpr, OFF: tl.constexpr, SG: tl.constexpr, SCALE: tl.constexpr,
        MINK: tl.constexpr, TW: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, RPP: tl.constexpr,
        ASM: tl.constexpr, PDL: tl.constexpr, TT: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        """Integer dot products (`integer_dots` formats): one program per RPP rows and the whole
        of K (T tile groups, a power of two >= K / TV); x comes quantized (x_int8.py, once per step
        and code layout), then BN rows at a time stream past it. Software-pipelined:
        every load of the next row block is issued before this block's row sums (whose cross-warp
        reduction is a barrier the compiler does not move loads across), and the first block's
        before x's, so a program keeps a block's reads in flight while it computes."""
        pdl.release(PDL)
        TV: tl.constexpr = TW * 32 // LO
        t = tl.arange(0, T)
        t_ok = t < K // TV
        g = t * TV // SG
        rows = tl.program_id(0) * RPP + tl.arange(0, BN)
        lo, hi, sc, sd, mn, smin = _int8_block_loads(
            lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, rows, N, t, t_ok, g, stride_lo, stride_hi, stride_g,
            stride_s, LO, HI, SG, SCALE, MINK, TW, TT, TILE,
        )  # fmt: skip
        pdl.wait(PDL)  # x comes from the kernels before; the weights' first loads are in flight
        q1a, q1b, q2a, q2b, dx, xsum = x_int8.load_groups(q_ptr, f_ptr, t, t_ok, K // TV, LO, TW)
        dr = dx * (1.0 / 254.0)
        for rb in tl.static_range(0, RPP, BN):
            if rb + BN < RPP:
                lo_n, hi_n, sc_n, sd_n, mn_n, smin_n = _int8_block_loads(
                    lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, rows + BN, N, t, t_ok, g, stride_lo,
                    stride_hi, stride_g, stride_s, LO, HI, SG, SCALE, MINK, TW, TT, TILE,
                )  # fmt: skip
            _int8_block_out(lo, hi, sc, sd, mn, smin, q1a, q1b, q2a, q2b, dx, dr, xsum, rows, N, out_ptr, LO, HI,
                            OFF, SCALE, MINK, ASM)  # fmt: skip
            if rb + BN < RPP:
                lo, hi, sc, sd, mn, smin = lo_n, hi_n, sc_n, sd_n, mn_n, smin_n
                rows += BN

DEFAULT_BLOCK_N = 4
DEFAULT_WARPS = 4


def integer_dots(fmt: Format) -> bool:
    """Formats the integer-dot variant serves: 4- and 8-bit codes without a high-bit plane (Q4_0,
    Q4_1, Q4_K, Q8_0) and 4 + 2-bit codes in 16-value groups (Q6_K)."""
    return not fmt.lut and (
        (fmt.lo in (4, 8) and fmt.hi == 0) or (fmt.lo == 4 and fmt.hi == 2 and fmt.sg == 16)
    )


def int8_layout(fmt: Format) -> x_int8.Int8Layout:
    """The layout in which the integer-dot GEMV of `fmt` reads x."""
    return x_int8.Int8Layout(fmt.lo, fmt.tile_words)


def uses_integer_dots(fmt: Format, int8_x: bool | None = None) -> bool:
    """Whether `gemv` runs the integer-dot kernel for this format (`int8_x` None: where it can)."""
    return integer_dots(fmt) if int8_x is None else int8_x and integer_dots(fmt)


def gemv(
    x: torch.Tensor, seg: Segment, out: torch.Tensor, block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = DEFAULT_WARPS, chunk: int | None = None, int8_x: bool | None = None,
    rows_per_program: int | None = None, x_quantized: x_int8.Int8X | None = None,
) -> None:  # fmt: skip
    """out [seg.rows] (x's dtype) = the segment's weight times x [K].

    Float codes (`int8_x` False): the K chunk defaults to one tile group per thread (32 *
    num_warps tile groups): fewer leave warps splitting rows (x no longer shared in registers),
    more raise register use. Integer dots (`int8_x`, the default where `integer_dots` allows): x
    quantized by `x_int8.quantize` (`x_quantized`, or here), `rows_per_program` rows (default 4 *
    block_n) per program."""
    fmt = seg.fmt
    k = seg.k
    planes = seg.planes
    lo = planes["lo"].view(torch.int32) if fmt.lo == 8 else planes["lo"]
    sd, mn, smin = planes.get("sd", lo), planes.get("mn", lo), planes.get("smin", lo)
    if uses_integer_dots(fmt, int8_x):
        rpp = rows_per_program or 4 * block_n
        xq = x_quantized or x_int8.quantize(x, int8_layout(fmt))
        # the high bits of each low word (32 / LO codes x HI bits: 16 for Q6_K) as one element
        hi = planes["hi"].view(torch.int16) if fmt.hi else lo
        _gemv_int8_kernel[(triton.cdiv(seg.rows, rpp),)](
            xq.words, xq.scales, out, lo, hi, planes["sc"], sd, mn, smin, seg.rows, k, k * fmt.lo // 32, k * fmt.hi // 16,
            k // fmt.sg, k // 256,
            LO=fmt.lo, HI=fmt.hi, OFF=fmt.off, SG=fmt.sg, SCALE=fmt.scale, MINK=fmt.mink, TW=fmt.tile_words,
            BN=block_n, T=1 << (k // fmt.tile_values - 1).bit_length(), RPP=rpp, ASM=x.is_cuda, TT=seg.row_tile,
            TILE=tile_values(seg.type_name),
            num_warps=num_warps, **pdl.options(x),
        )  # fmt: skip
        return
    tv = fmt.tile_values
    kc = chunk or 32 * num_warps * tv
    kc = max(tv, min(kc, 1 << (k - 1).bit_length()))
    _gemv_kernel[(triton.cdiv(seg.rows, block_n),)](
        x, out, lo, planes.get("hi", lo), planes["sc"], sd, mn, smin, seg.rows, k, k * fmt.lo // 32,
        k * fmt.hi // 32, k // fmt.sg, k // 256, 1,
        LO=fmt.lo, HI=fmt.hi, OFF=fmt.off + (128 if fmt.lo == 8 else 0), SG=fmt.sg, SCALE=fmt.scale,
        MINK=fmt.mink, SCMIN_NIB=fmt.scmin_nib, TW=fmt.tile_words, BN=block_n, KC=kc, EVEN_K=k % kc == 0,
        TT=seg.row_tile, TILE=tile_values(seg.type_name), num_warps=num_warps, **pdl.options(x),
    )  # fmt: skip
