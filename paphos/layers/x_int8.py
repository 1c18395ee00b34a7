"""x as two int8 parts per tile group: the input of the quantized formats' integer-dot GEMVs
(paphos/quant/gguf/triton_gemv.py, paphos/quant/kernels/triton_int.py). It lives with the layers
because the layers produce it; a format opts in through its method's `int8_input_layout`, so
layers and models never import a quantization format.

Data flow at batch 1 on CUDA: the kernel that produces a linear layer's input (residual add +
RMSNorm, SiLU x mul: paphos/layers/fused.py; the split-KV attention merge) writes x and, in the
same kernel, these parts in the layout the layer's GEMV reads (x_int8_outputs.py wires producer
to consumer after loading; the parts travel attached to x: `attach` / `attached`); where no
producer wrote them (the head's rows, a second code layout in one layer, an attention output
with prefill rows), `quantize` does, one small launch.
Either way x is quantized once per step and layout, not once per GEMV program.

The format: per tile group of the weight's code layout (`Int8Layout`: LO-bit codes, TW words
per group; 32 values for 4-bit codes, 16 for Q8_0), x = dx * (q1 + q2 / 254), dx = max|x| / 127,
q1 = round(x / dx), q2 = round(254 * the rest) (round half to even): about 15 bits of x, so GEMV
results stay within 1e-4 of the exact product (one int8 alone, as llama.cpp's MMVQ, measured
3e-3 to 9e-3). The int8s are packed in the codes' byte order (`_pack_byte`), so the GEMV multiplies
whole words with `dp4a` and never rearranges x.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from paphos.layers import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the integer-dot GEMV is not used either
    triton = None


class Int8Layout(NamedTuple):
    """A weight format's code layout as its GEMV reads x: LO-bit codes, TW words per tile group."""

    lo: int
    tile_words: int

    @property
    def tile_values(self) -> int:
        return self.tile_words * 32 // self.lo


class Int8X(NamedTuple):
    """x quantized for one layout: words [4, K / TV, TW] int32 (q1 a, q1 b, q2 a, q2 b) and
    [2, K / TV] float32 (dx, sum of the represented x)."""

    layout: Int8Layout
    words: torch.Tensor
    scales: torch.Tensor


if triton is not None:

    @triton.jit
    def _pack_byte(packed, byte, p, LO: tl.constexpr):
        """Places the int8 of code position p in the word(s) the codes' bytes line up with: 4-bit
        codes p = 2j and 2j + 1 of a word are byte j of the word masked (first) and of the word
        shifted by 4 (second); 8-bit code p is byte p of the first."""
        if LO == 8:
            return packed | (byte << (8 * p))
        else:
            return packed | (byte << (8 * (p // 2)))

    @triton.jit
    def rounded_parts(v):
        """v = x / dx (|v| <= 127) -> (f1, f2): round(v) and round(254 * (v - round(v))), each as
        1.5 * 2**23 plus the integer (ties to even), so the float's low byte is the int8 part in
        two's complement; minus 1.5 * 2**23 they are the parts as floats."""
        f1 = v + 12582912.0
        f2 = (v - (f1 - 12582912.0)) * 254.0 + 12582912.0
        return f1, f2

    @triton.jit
    def _quantize_x(x_ptr, t, t_ok, LO: tl.constexpr, TW: tl.constexpr):
        """x per tile group t (32 values for 4-bit codes, 16 for Q8_0) as two int8 parts: x =
        dx * (q1 + q2 / 254), dx = max|x| / 127, q1 = round(x / dx), q2 = round(254 * the rest)
        (round half to even), so about 15 bits of x survive (one int8 alone would leave errors
        near 1e-2 of a result). Packed in the codes' order (`_pack_byte`) -> (q1 words a, b,
        q2 words a, b [T, TW] int32, dx [T], sum of the represented x [T])."""
        PER: tl.constexpr = 32 // LO
        w = tl.arange(0, TW)
        xk = (t * (TW * PER))[:, None] + w[None, :]  # [T, TW]: value index of each word's code 0
        xm = t_ok[:, None]
        amax = tl.zeros(xk.shape, dtype=tl.float32)
        for p in tl.static_range(PER):
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + xk + p * TW, mask=xm, other=0).to(tl.float32)))
        amax_t = tl.max(amax, axis=1)
        inv = tl.where(amax_t > 0, 127.0 / amax_t, 0.0)[:, None]
        zero = tl.zeros(xk.shape, dtype=tl.int32)
        q1a, q1b, q2a, q2b = zero, zero, zero, zero
        sum1 = tl.zeros(xk.shape, dtype=tl.float32)
        sum2 = tl.zeros(xk.shape, dtype=tl.float32)
        for p in tl.static_range(PER):
            v = tl.load(x_ptr + xk + p * TW, mask=xm, other=0).to(tl.float32) * inv
            f1, f2 = rounded_parts(v)
            sum1 += f1 - 12582912.0
            sum2 += f2 - 12582912.0
            b1 = f1.to(tl.int32, bitcast=True) & 0xFF
            b2 = f2.to(tl.int32, bitcast=True) & 0xFF
            if LO == 8 or p % 2 == 0:
                q1a = _pack_byte(q1a, b1, p, LO)
                q2a = _pack_byte(q2a, b2, p, LO)
            else:
                q1b = _pack_byte(q1b, b1, p, LO)
                q2b = _pack_byte(q2b, b2, p, LO)
        dx = amax_t * (1.0 / 127.0)
        xsum = (tl.sum(sum1, axis=1) + tl.sum(sum2, axis=1) * (1.0 / 254.0)) * dx
        return q1a, q1b, q2a, q2b, dx, xsum

    @triton.jit
    def store_groups(x_ptr, q_ptr, f_ptr, t, t_ok, n_groups, LO: tl.constexpr, TW: tl.constexpr):
        """Tile groups t of x (`_quantize_x`) -> int8 part words q_ptr [4, n_groups, TW] (q1 a, q1 b,
        q2 a, q2 b; the b words only for 4-bit codes) and f_ptr [2, n_groups] (dx, sum of the
        represented x). Shared by `quantize`'s launch and the kernels that produce x (fused.py)."""
        q1a, q1b, q2a, q2b, dx, xsum = _quantize_x(x_ptr, t, t_ok, LO, TW)
        store_parts(q_ptr, f_ptr, t, t_ok, n_groups, q1a, q1b, q2a, q2b, dx, xsum, LO, TW)

    @triton.jit
    def store_parts(q_ptr, f_ptr, t, t_ok, n_groups, q1a, q1b, q2a, q2b, dx, xsum, LO: tl.constexpr,
                    TW: tl.constexpr):  # fmt: skip
        """Quantized tile groups t (`_quantize_x`'s outputs, or a kernel's own arithmetic of it) ->
        the [4, n_groups, TW] words and [2, n_groups] floats that `load_groups` reads."""
        at = t[:, None] * TW + tl.arange(0, TW)[None, :]
        m = t_ok[:, None]
        plane = n_groups * TW
        tl.store(q_ptr + at, q1a, mask=m)
        tl.store(q_ptr + 2 * plane + at, q2a, mask=m)
        if LO != 8:
            tl.store(q_ptr + plane + at, q1b, mask=m)
            tl.store(q_ptr + 3 * plane + at, q2b, mask=m)
        tl.store(f_ptr + t, dx, mask=t_ok)
        tl.store(f_ptr + n_groups + t, xsum, mask=t_ok)

    @triton.jit
    def _quantize_x_kernel(
        x_ptr, q_ptr, f_ptr, n_groups, LO: tl.constexpr, TW: tl.constexpr, TB: tl.constexpr, PDL: tl.constexpr
    ):
        """TB tile groups of x per program (`store_groups`)."""
        pdl.release(PDL)
        pdl.wait(PDL)
        t = tl.program_id(0) * TB + tl.arange(0, TB)
        store_groups(x_ptr, q_ptr, f_ptr, t, t < n_groups, n_groups, LO, TW)

    @triton.jit
    def load_groups(q_ptr, f_ptr, t, t_ok, n_groups, LO: tl.constexpr, TW: tl.constexpr):
        """`store_groups`' output for tile groups t, in `_quantize_x`'s layout (one 16-byte
        load per part and tile group); zeros past K, as `_quantize_x` gives there."""
        at = t[:, None] * TW + tl.arange(0, TW)[None, :]
        m = t_ok[:, None]
        plane = n_groups * TW
        q1a = tl.load(q_ptr + at, mask=m, other=0)
        q2a = tl.load(q_ptr + 2 * plane + at, mask=m, other=0)
        q1b, q2b = q1a, q2a  # 8-bit codes use the a words alone
        if LO != 8:
            q1b = tl.load(q_ptr + plane + at, mask=m, other=0)
            q2b = tl.load(q_ptr + 3 * plane + at, mask=m, other=0)
        dx = tl.load(f_ptr + t, mask=t_ok, other=0.0)
        xsum = tl.load(f_ptr + n_groups + t, mask=t_ok, other=0.0)
        return q1a, q1b, q2a, q2b, dx, xsum


QUANTIZE_GROUPS = 32  # tile groups per program of `_quantize_x_kernel` (one per lane of one warp)


def empty(x: torch.Tensor, layout: Int8Layout) -> Int8X:
    """Uninitialised parts for x [K] (or [1, K]) in `layout`."""
    n_groups = x.shape[-1] // layout.tile_values
    return Int8X(
        layout,
        torch.empty(4, n_groups, layout.tile_words, dtype=torch.int32, device=x.device),
        torch.empty(2, n_groups, dtype=torch.float32, device=x.device),
    )


def quantize(x: torch.Tensor, layout: Int8Layout) -> Int8X:
    """x [K] (or [1, K]) -> its parts in `layout`: one launch, shared by every weight of that
    layout multiplying this x (`triton_gguf.gemv_matmul`). Quantizing once per call instead of
    once per program (each covers the whole of K) took that work out of the streaming kernels: on
    the H200 the Q4_K down projection went from 17.5 to 15.9 us and the Q6_K head from 170.5 to
    141.5, this launch included (benchmarks/README.md)."""
    parts = empty(x, layout)
    n_groups = parts.scales.shape[1]
    _quantize_x_kernel[(triton.cdiv(n_groups, QUANTIZE_GROUPS),)](
        x, parts.words, parts.scales, n_groups, LO=layout.lo, TW=layout.tile_words, TB=QUANTIZE_GROUPS,
        num_warps=1, **pdl.options(x),
    )  # fmt: skip
    return parts


_ATTR = "paphos_int8_x"


def attach(x: torch.Tensor, layout: object, parts: object) -> torch.Tensor:
    """Marks x (a freshly written activation, never modified afterwards) as carrying `parts`, its
    int8 parts in `layout` (an Int8Layout, or x_int8_blocks.BlockLayout for the int8 tensor-core GEMMs)."""
    setattr(x, _ATTR, (layout, parts))
    return x


def reshape(x: torch.Tensor, *shape: int) -> torch.Tensor:
    """x.reshape(*shape), carrying the parts attached to x where it is a view of the same memory
    in the same order (x contiguous), so they still describe it: the attention output [T, heads,
    head_dim] as the o projection's [T, K]."""
    reshaped = x.reshape(*shape)
    if (got := getattr(x, _ATTR, None)) is not None and x.is_contiguous():
        setattr(reshaped, _ATTR, got)
    return reshaped


def attached(x: torch.Tensor, layout: object) -> Any:
    """The parts a producer attached to this very tensor object in `layout`, if any (a view or
    a copy of x carries none)."""
    got = getattr(x, _ATTR, None)
    return got[1] if got is not None and got[0] == layout else None
