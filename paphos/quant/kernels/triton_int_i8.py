"""The integer-weight family's int8 tensor-core GEMM (int_layout.py planes: GPTQ, AWQ,
compressed-tensors), for batched decode between the batch-1 GEMV and the bf16 fused kernel:
3 to 32 tokens a step with 4-bit codes, 3 to 64 with 8-bit (triton_int.I8_MAX_TOKENS).

Data flow: `triton_int.matmul` calls `matmul(x, planes, spec)` when `supports(spec)`; it runs
two launches per linear, or one where x's producer wrote the parts (paphos/layers/fused.py,
`x_layout`: the norm, SiLU x mul and decode attention merge, paphos/layers/x_int8_outputs.py;
not a mixed step's attention output, nor with act-order):
  1. `quantize_x`: x [M, K] (act-order: x[:, perm], gathered here) -> two int8 parts per token
     and block of XB = 128 K values, x = dx * (q1 + q2 / 254), dx = max|x| / 127 (the GEMV's
     numerics, paphos/layers/x_int8.py: about 15 bits of x), stored in the order the weight
     plane's bytes hold their codes (`block_order`), with dx and the block's integer sum
     sum(254 * q1 + q2).
  2. `_gemm_kernel`: out^T = W x^T on the int8 tensor cores (wgmma s8 on Hopper), the weights as
     the large operand. A weight byte holds two 4-bit codes: masking the low nibbles of four
     bytes at once gives four int8 codes, shifting first the four high ones (3 instructions per 8
     codes, where the bf16 fused kernel in triton_int.py spends about 4 per code); 8-bit codes
     are stored as signed bytes q - 128 already. Per block: D1 = codes . q1, D2 = codes . q2
     (int32, exact), then 254 * D1 + D2 - zero * sum (still exact in int32; zero in the stored
     codes' terms: 8 or the checkpoint's zero point for 4 bits, zero - 128 for 8 bits), one
     float32 conversion, times the group scale and dx / 254. So the only roundings are x's
     quantization and the float32 accumulation over blocks.
Blocks of 128 lie inside one scale group: groups of 128 or more (power of two) or per-channel,
K a multiple of 128 (`supports`); other layers keep the bf16 fused kernel.

The parts are joined per token in int32 (a thread holds both columns of a token) before the zero
point and the float step, which then run on BM columns instead of 2 BM: 286 instructions in the
K loop at the 16-token rule (128 rows, 4 warps) instead of 338, 4.33 a weight byte instead of
5.12 (benchmarks/int8_sass.py's count on this kernel). Measured after it (H100, 16 tokens,
bench_int_gpu.py): a Llama-3-8B layer's four linears 85.8 us, 1.93x cuBLAS bf16, gate|up 35.3 us
at 57 % of copy bandwidth; with the parts written by x's producers (no quantizing launch: `i8_fed`)
82.7 us against 86.7 in the same run, 1.98x; with the planes in tiles of 4 rows (each K step
reads 32 runs of 256 contiguous bytes, int_layout.plane_offset) 84.1 -> 75.6 us, gate|up at 69 %.
Timings: benchmarks/README.md, "The int8 tensor-core path", "o_proj's input written by the
attention merge" and "Integer planes in tiles of 4 rows".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from paphos.layers import pdl, x_int8_blocks
from paphos.layers.x_int8_blocks import BlockLayout
from paphos.quant.kernels import int_layout, x_blocks
from paphos.quant.kernels.int_layout import TILE_WORDS, IntSpec

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels import split_k
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None

XB = 128  # K values per x block: one dx per token and block, and the kernel's K step


def supports(spec: IntSpec) -> bool:
    """Every 128-value block of K lies in one scale group (module docstring)."""
    return spec.invalid() is None and spec.in_features % XB == 0 and spec.group_size % XB == 0


def block_order(bits: int) -> torch.Tensor:
    """[XB] int64: position j of a quantized x block holds value block_order[j] of the block, the
    order in which the kernel multiplies the plane's codes. 4-bit: the low nibbles of the block's
    64 bytes, then their high nibbles; 8-bit: the 128 bytes. Byte 4w + b of a tile group (4
    words) holds codes 2b and 2b + 1 of word w (4-bit), or code b (8-bit); code p of word w is
    value p * 4 + w of the tile group (int_layout.py)."""
    j = torch.arange(XB)
    if bits == 4:
        byte, high = j % 64, j // 64
        tile, w, b = byte // 16, byte % 16 // TILE_WORDS, byte % TILE_WORDS
        return tile * 32 + (2 * b + high) * TILE_WORDS + w
    tile, w, p = j // 16, j % 16 // TILE_WORDS, j % TILE_WORDS
    return tile * 16 + p * TILE_WORDS + w


def reference_quantize_x(
    x: torch.Tensor, bits: int, perm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `quantize_x`: x [M, K] -> (parts int8 [2, M, K], dx float32 [M, K / XB],
    sums int32 [M, K / XB])."""
    return x_int8_blocks.reference_quantize(x, block_order(bits), XB, XB, perm)


def x_layout(bits: int, min_tokens: int = 1, max_tokens: int = 0) -> BlockLayout:
    """How `_gemm_kernel` reads x for `bits`-bit codes; the token range (not part of the layout's
    identity) is where the caller runs the kernel, so x's producer writes the parts then."""
    return BlockLayout(f"int{bits}", partial(block_order, bits), XB, XB, min_tokens, max_tokens)


# ---------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def nibbles_i8(b, ASM: tl.constexpr):
        """Bytes b (uint8) -> (low nibbles, high nibbles) as int8 codes 0..15; on the GPU four
        bytes a register: AND for the low ones, shift and AND for the high ones."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ and.b32 $0, $2, 0x0F0F0F0F; shr.u32 $1, $2, 4; and.b32 $1, $1, 0x0F0F0F0F; }",
                "=r,=r,r", [b], dtype=(tl.int8, tl.int8), is_pure=True, pack=4,
            )  # fmt: skip
        else:
            return (b & 0xF).to(tl.int8), (b >> 4).to(tl.int8)

    @triton.jit
    def _block_scalars(
        s_ptr, z_ptr, dx_ptr, sum_ptr, it, rows, row_ok, ms, m_ok, N, n_blocks, group_shift,
        BITS: tl.constexpr, HAS_Z: tl.constexpr,
    ):  # fmt: skip
        """Block it's row scales (float32) and zero points in the stored codes' terms (int32; 8 for
        symmetric 4-bit, 0 for symmetric 8-bit), and per token dx / 254 and the integer sum."""
        at = ((it * 128) >> group_shift).to(tl.int64) * N + rows
        scale = tl.load(s_ptr + at, mask=row_ok, other=0).to(tl.float32)
        stored: tl.constexpr = 0 if BITS == 4 else 128  # the stored code is q - stored
        if HAS_Z:
            zero = tl.load(z_ptr + at, mask=row_ok, other=0).to(tl.int32) - stored
        else:
            zero = tl.full(rows.shape, (1 << (BITS - 1)) - stored, tl.int32)
        xg = ms * n_blocks + it
        dx = tl.load(dx_ptr + xg, mask=m_ok, other=0.0) * (1.0 / 254.0)
        xsum = tl.load(sum_ptr + xg, mask=m_ok, other=0)
        return scale, zero, dx, xsum

    @triton.jit
    def _gemm_kernel(
        q_ptr, dx_ptr, sum_ptr, out_ptr, part_ptr, count_ptr, w_ptr, s_ptr, z_ptr, M, N, K, stride_w,
        stride_om, group_shift, iters_per_split,
        BITS: tl.constexpr, HAS_Z: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr,
        ATOMIC: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr, TT: tl.constexpr,
    ):  # fmt: skip
        """out [M, N] = x W^T for BN rows and BM tokens per program, blocks it0 .. it1 of K per
        program along grid axis 1 (SPLIT: several slices, the last program of a tile to finish
        sums the float32 partials, which ATOMIC adds into one zeroed plane: split_k.py). w_ptr:
        the qweight plane as bytes (uint8 for 4-bit codes, int8 for 8-bit), stride_w bytes per
        row; x's parts from `quantize_x`."""
        pdl.release(PDL)
        pdl.wait(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        n_blocks = K // 128
        rows, row_ok, ms, m_ok, first, tok, tok_ok, it0, it1 = x_blocks.program_tile(
            pid_n, pid_m, pid_k, N, M, n_blocks, iters_per_split, BN, BM
        )
        NB: tl.constexpr = 128 * BITS // 8  # bytes of a row per block
        # block it of these rows starts it * TT * NB bytes after block 0 (int_layout.plane_offset)
        w_rows = w_ptr + int_layout.plane_offset(rows.to(tl.int64)[:, None], tl.arange(0, NB)[None, :], stride_w, TT, NB)
        x_cols = x_blocks.part_pointers(q_ptr, first, tok, M, K, NB)  # [NB, 2 BM]
        x_ok = tok_ok[None, :]
        weight = tl.where(first, 254, 1)  # 254 * (codes . q1) + codes . q2
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        # the block's scales, zeros, dx and sums are loaded a block ahead (not dot operands: the
        # software pipeline does not issue them early)
        scale, zero, dx, xsum = _block_scalars(s_ptr, z_ptr, dx_ptr, sum_ptr, it0, rows, row_ok, ms, m_ok, N,
                                               n_blocks, group_shift, BITS, HAS_Z)  # fmt: skip
        for it in range(it0, it1):
            k0 = it * 128
            scale_n, zero_n, dx_n, xsum_n = _block_scalars(
                s_ptr, z_ptr, dx_ptr, sum_ptr, tl.minimum(it + 1, it1 - 1), rows, row_ok, ms, m_ok, N, n_blocks,
                group_shift, BITS, HAS_Z,
            )  # fmt: skip
            wb = tl.load(w_rows + it * (TT * NB), mask=row_ok[:, None], other=0)
            if BITS == 4:
                lo, hi = nibbles_i8(wb, ASM)
                d = tl.dot(lo, tl.load(x_cols + k0, mask=x_ok, other=0), out_dtype=tl.int32)
                d = tl.dot(hi, tl.load(x_cols + k0 + 64, mask=x_ok, other=0), d, out_dtype=tl.int32)
            else:
                d = tl.dot(wb, tl.load(x_cols + k0, mask=x_ok, other=0), out_dtype=tl.int32)
            # the parts joined in int32 first (in registers: a thread holds both columns of a
            # token), so the zero point and the float step run once per token, not per part
            d = x_blocks.sum_parts(d * weight[None, :], BN, BM) - zero[:, None] * xsum[None, :]
            acc += d.to(tl.float32) * scale[:, None] * dx[None, :]
            scale, zero, dx, xsum = scale_n, zero_n, dx_n, xsum_n
        split_k.store_tile(acc, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M,
                           N, stride_om, pid_m * tl.num_programs(0) + pid_n, pid_k, tl.num_programs(1), SPLIT,
                           ASM, ATOMIC)  # fmt: skip


# ---------------------------------------------------------------------------- launches


@dataclass(frozen=True)
class I8Config:
    """`_gemm_kernel`'s launch (and triton_gguf_i8's): weight rows and tokens per program, K slices,
    warps, stages; for triton_gguf_i8 `stream_per_sm` > 0 runs its tiles by stream-K over that
    many programs per multiprocessor of the device instead of the K slices (split_k.py; here
    measured slower: benchmarks/README.md, "Stream-K for the int8 tensor-core GEMMs")."""

    block_n: int = 64
    block_m: int = 16
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    stream_per_sm: int = 0


def i8_config(spec: IntSpec, m: int, programs_per_sm: int = 2, block_n: int | None = None) -> I8Config:
    """The launch at M tokens, by the rule the H100 sweeps' winners on the Llama-3-8B shapes follow
    (benchmarks/bench_int_gpu.py): M rounded up to a power of two (16 to 64) tokens per program,
    128 rows up to 32 tokens and 64 above, 4 warps, 3 stages; K split while the grid stays within
    `programs_per_sm` programs per multiprocessor (2: q|k|v 4 slices, o and down 8) and each
    slice keeps two blocks or more. (8 warps at 64 tokens ran 2-4x slower; 4 stages 3-15 % slower
    on every shape at 16 and 32 tokens, and tokens as the dot's M on mma.sync no faster:
    benchmarks/README.md, "Three stages".)"""
    bm = min(64, max(16, triton.next_power_of_2(m)))
    block_n = block_n or (128 if bm <= 32 else 64)
    tiles = math.ceil(spec.out_features / block_n) * math.ceil(m / bm)
    blocks, split = spec.in_features // XB, 1
    while blocks // (split * 2) >= 2 and tiles * split * 2 <= programs_per_sm * split_k.NUM_SMS_GUESS:
        split *= 2
    return I8Config(block_n, bm, split)


def quantize_x(
    x: torch.Tensor, bits: int, perm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride on K) -> `reference_quantize_x`'s (parts, dx, sums): attached by x's
    producer, else one launch."""
    return x_int8_blocks.quantize(x, x_layout(bits), perm)


def matmul(
    x: torch.Tensor, planes: dict[str, torch.Tensor], spec: IntSpec, cfg: I8Config | None = None
) -> torch.Tensor:
    """x [M, K] bf16 / fp16 (unit stride on K) -> [M, N] in x's dtype: `quantize_x`, then
    `_gemm_kernel` (`cfg` overrides `i8_config`). CUDA, or CPU tensors under TRITON_INTERPRET=1."""
    m, k = x.shape
    n = spec.out_features
    cfg = cfg or i8_config(spec, m)
    parts, dx, sums = quantize_x(x, spec.bits, planes.get("perm"))
    tiles = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    cut = split_k.slices(k // XB, cfg.split_k, tiles[0] * tiles[1], m, n, x.device, atomic=True)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    w = planes["qweight"].view(torch.uint8 if spec.bits == 4 else torch.int8)
    scales = planes["scales"]
    _gemm_kernel[(tiles[0], cut.count, tiles[1])](
        parts, dx, sums, out, cut.partials, cut.counters, w, scales, planes.get("zeros", scales), m, n, k,
        w.stride(0), out.stride(0), spec.group_shift, cut.per,
        BITS=spec.bits, HAS_Z=spec.has_zeros, BN=cfg.block_n, BM=cfg.block_m, SPLIT=cut.split, ATOMIC=cut.atomic,
        ASM=x.is_cuda, TT=spec.row_tile, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x),
    )  # fmt: skip
    return out
