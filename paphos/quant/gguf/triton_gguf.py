"""Triton kernels for GGUF weights on CUDA: a GEMV for one token (triton_gemv.py), fused dequant x
matmul for a few tokens per step, and dequantize-to-scratch + cuBLAS for long prefill chunks.

Data flow: `select_kernel` (kernels.py) picks `TritonGGUFKernel` for a CUDA layer in bf16/fp16
whose shards all have a format in `FORMATS` -> `prepare` repacks each run of same-type shards (a
"segment": q|k of Q4_K and v of Q6_K are two) from the raw blocks into planes (below) and frees the
raw blocks -> `apply(x)` -> `matmul`:
  - M == 1 (batch-1 decode, the head of one sampled row): `gemv_matmul`, triton_gemv's kernel for
    every linear format (the fused kernel below for IQ4 and Q3_K segments).
  - M <= triton_gguf_i8.I8_MAX_TOKENS[type] (Q4_K 64, Q5_K and Q8_0 32): those segments through
    triton_gguf_i8's int8 tensor-core kernels (`i8_matmul`: x quantized once per layout they
    read; the others, and a type whose int8 kernel failed its load-time check, through the fused
    kernel).
  - M <= FUSED_MAX_TOKENS rows: `_fused_kernel`, one launch per segment; each program owns BLOCK_N
    output rows and a slice of K (split-K), reads its packed planes once and accumulates in fp32;
    M == 1 multiplies and sums on the CUDA cores, 1 < M uses `tl.dot` on the dequantized bf16 tile
    (M padded to BLOCK_M >= 16 tokens, tensor cores). Split-K programs `atomic_add` into an fp32
    output that is cast at the end. Q6_K (the Q4_K_M files' v, half their down projections and
    their head) decodes its tiles by q6_k_tile.py (inline PTX on pairs of 16-bit values, each
    weight rounded once), the other types by `_dequant_tile` (float32).
  - embedding lookups (`embed`, a token embedding or a head tied to one): `_gather_kernel`
    dequantizes the rows of the given ids only, bit-exact (`gather_rows`).
  - M > FUSED_MAX_TOKENS: `_dequant_kernel` writes the weight (in row chunks of at most
    SCRATCH_ELEMS values) into one scratch buffer shared by all layers, then `F.linear` (cuBLAS).
    Why not a fused tensor-core GEMM here: at hundreds of tokens the GEMM is compute-bound, the
    dequantization (read 0.5-1 B + write 2 B per value, ~0.1 ms for a 4096 x 14336 weight) is a few
    percent of it, and cuBLAS is a better GEMM than a Triton one carrying dequantization in its
    inner loop; the crossover is measured by benchmarks/bench_gguf_gpu.py (`crossover`).

The planes (layout, repacking, the torch reference) are in planes.py.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paphos.layers import x_int8, x_int8_blocks
from paphos.layers.x_int8_blocks import BlockLayout
from paphos.quant.gguf import q6_k_tile, triton_gemv, triton_gguf_i8
from paphos.quant.gguf.dequant import IQ4_KVALUES
from paphos.quant.gguf.launch import (
    GEMV_CONFIGS,
    GemvConfig,
    KernelConfig,
    config_for,
    default_gemv_config,
    fit_block_k,
)
from paphos.quant.gguf.planes import (
    FORMATS,
    PLANES,
    Format,
    repack,
    row_tile,
    tile_rows,
    tile_values,
    type_size,
)

if TYPE_CHECKING:
    from paphos.quant.gguf.base import GGUFShard

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels.int_layout import plane_offset
except ImportError:  # CPU-only installs: the other kernels of kernels.py serve
    triton = None

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _expand(t, BN: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
        """[BN, BK / G] -> [BN, BK], each value repeated over its group of G."""
        return tl.reshape(tl.broadcast_to(t[:, :, None], (BN, BK // G, G)), (BN, BK))

    @triton.jit
    def _unpack(words, BN: tl.constexpr, BK: tl.constexpr, WIDTH: tl.constexpr):
        """int32 words [BN, BK * WIDTH / 32] -> codes [BN, BK] (code i of a word at bits WIDTH*i)."""
        PER: tl.constexpr = 32 // WIDTH
        shifts = tl.arange(0, PER) * WIDTH
        v = (words[:, :, None] >> shifts[None, None, :]) & ((1 << WIDTH) - 1)
        return tl.reshape(v, (BN, BK))

    @triton.jit
    def _dequant_tile(
        lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, lut_ptr, rows, row_mask, k0, K,
        LO: tl.constexpr, HI: tl.constexpr, OFF: tl.constexpr, SG: tl.constexpr, SCALE: tl.constexpr,
        MINK: tl.constexpr, LUT: tl.constexpr, SCMIN_NIB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        TT: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        """fp32 weights [BN, BK] of rows `rows`, values k0 .. k0 + BK (planes in tiles of TT rows x
        TILE values)."""
        r = rows.to(tl.int64)[:, None]
        m2 = row_mask[:, None]
        # codes in stored order (contiguous loads), then back to value order (`_tile_order`)
        kk = k0 + tl.arange(0, BK)
        if LO == 8:
            q = tl.load(lo_ptr + plane_offset(r, kk[None, :], K, TT, TILE), mask=m2, other=0).to(tl.int32)
        else:
            wi = k0 * LO // 32 + tl.arange(0, BK * LO // 32)
            lo = tl.load(lo_ptr + plane_offset(r, wi[None, :], K * LO // 32, TT, TILE * LO // 32), mask=m2, other=0)
            q = _unpack(lo, BN, BK, LO)
        if HI > 0:
            hi_i = k0 * HI // 32 + tl.arange(0, BK * HI // 32)
            hw = tl.load(hi_ptr + plane_offset(r, hi_i[None, :], K * HI // 32, TT, TILE * HI // 32), mask=m2, other=0)
            q = q | (_unpack(hw, BN, BK, HI) << LO)
        TW: tl.constexpr = 1 if SG * LO < 32 else (4 if SG * LO >= 128 else SG * LO // 32)
        if TW > 1:
            PER: tl.constexpr = 32 // LO
            q = tl.reshape(tl.permute(tl.reshape(q, (BN, BK // (TW * PER), TW, PER)), (0, 1, 3, 2)), (BN, BK))
        if LUT:
            v = tl.load(lut_ptr + q)
        else:
            v = (q - OFF).to(tl.float32)
        NG: tl.constexpr = BK // SG
        gi = k0 // SG + tl.arange(0, NG)
        s, m = triton_gemv.group_scale_min(
            sc_ptr, sd_ptr, mn_ptr, smin_ptr, r, gi, m2, K // SG, K // 256, SG, SCALE, MINK, SCMIN_NIB, TT, TILE
        )
        w = v * _expand(s, BN, SG, BK)
        if MINK > 0:
            w = w + _expand(m, BN, SG, BK)
        return w

    @triton.jit
    def _fused_kernel(
        x_ptr, out_ptr, lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, lut_ptr,
        M, N, K, stride_xm, stride_om, iters_per_split,
        LO: tl.constexpr, HI: tl.constexpr, OFF: tl.constexpr, SG: tl.constexpr, SCALE: tl.constexpr,
        MINK: tl.constexpr, LUT: tl.constexpr, SCMIN_NIB: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr, DOT_F32: tl.constexpr,
        Q6_K_TILE: tl.constexpr, ASM: tl.constexpr, Q6_K_TRANSPOSED: tl.constexpr, TT: tl.constexpr,
        TILE: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rows = pid_n * BN + tl.arange(0, BN)
        row_mask = rows < N
        n_iters = K // BK
        it0 = pid_k * iters_per_split
        it1 = tl.minimum(it0 + iters_per_split, n_iters)
        kr = tl.arange(0, BK)
        if BM == 1:
            acc2 = tl.zeros((BN, BK), dtype=tl.float32)
            x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
            for it in range(it0, it1):
                k0 = it * BK
                w = _dequant_tile(
                    lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, lut_ptr, rows, row_mask, k0, K,
                    LO, HI, OFF, SG, SCALE, MINK, LUT, SCMIN_NIB, BN, BK, TT, TILE,
                )  # fmt: skip
                x = tl.load(x_row + k0 + kr).to(tl.float32)
                acc2 += w * x[None, :]
            acc = tl.sum(acc2, axis=1)
            o = out_ptr + pid_m.to(tl.int64) * stride_om + rows
            if ATOMIC:
                tl.atomic_add(o, acc, mask=row_mask, sem="relaxed")
            else:
                tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=row_mask)
        else:
            ms = pid_m * BM + tl.arange(0, BM)
            m_mask = ms < M
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
            for it in range(it0, it1):
                k0 = it * BK
                x = tl.load(x_rows + (k0 + kr)[None, :], mask=m_mask[:, None], other=0.0)
                if Q6_K_TILE:
                    w = q6_k_tile.decode(lo_ptr, hi_ptr, sc_ptr, sd_ptr, rows, row_mask, k0, K, BN, BK, x.dtype, ASM,
                                         Q6_K_TRANSPOSED, TT)  # fmt: skip
                else:
                    w = _dequant_tile(
                        lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, lut_ptr, rows, row_mask, k0, K,
                        LO, HI, OFF, SG, SCALE, MINK, LUT, SCMIN_NIB, BN, BK, TT, TILE,
                    )  # fmt: skip
                if DOT_F32:
                    acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
                else:
                    acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
            o = out_ptr + ms.to(tl.int64)[:, None] * stride_om + rows[None, :]
            mask = m_mask[:, None] & row_mask[None, :]
            if ATOMIC:
                tl.atomic_add(o, acc, mask=mask, sem="relaxed")
            else:
                tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(
        out_ptr, lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, lut_ptr, row0, row_end, K, stride_o,
        LO: tl.constexpr, HI: tl.constexpr, OFF: tl.constexpr, SG: tl.constexpr, SCALE: tl.constexpr,
        MINK: tl.constexpr, LUT: tl.constexpr, SCMIN_NIB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        TT: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        rows = row0 + tl.program_id(0) * BN + tl.arange(0, BN)
        row_mask = rows < row_end
        k0 = tl.program_id(1) * BK
        w = _dequant_tile(
            lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, lut_ptr, rows, row_mask, k0, K,
            LO, HI, OFF, SG, SCALE, MINK, LUT, SCMIN_NIB, BN, BK, TT, TILE,
        )  # fmt: skip
        o = out_ptr + (rows - row0).to(tl.int64)[:, None] * stride_o + (k0 + tl.arange(0, BK))[None, :]
        tl.store(o, w.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])

    @triton.jit
    def _gather_kernel(
        out_ptr, ids_ptr, lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, lut_ptr, T, K, stride_o,
        LO: tl.constexpr, HI: tl.constexpr, OFF: tl.constexpr, SG: tl.constexpr, SCALE: tl.constexpr,
        MINK: tl.constexpr, LUT: tl.constexpr, SCMIN_NIB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        TT: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        """out[t] = row ids[t] of the segment, dequantized (the embedding lookup)."""
        t = tl.program_id(0) * BN + tl.arange(0, BN)
        t_mask = t < T
        rows = tl.load(ids_ptr + t, mask=t_mask, other=0)
        k0 = tl.program_id(1) * BK
        w = _dequant_tile(
            lo_ptr, hi_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr, lut_ptr, rows, t_mask, k0, K,
            LO, HI, OFF, SG, SCALE, MINK, LUT, SCMIN_NIB, BN, BK, TT, TILE,
        )  # fmt: skip
        o = out_ptr + t.to(tl.int64)[:, None] * stride_o + (k0 + tl.arange(0, BK))[None, :]
        tl.store(o, w.to(out_ptr.dtype.element_ty), mask=t_mask[:, None])


# Up to this many tokens per step the fused kernel runs; above, dequantize + cuBLAS.
FUSED_MAX_TOKENS = 64
# Largest number of values dequantized into the shared scratch buffer at once.
SCRATCH_ELEMS = 128 << 20


_DUMMY: dict[torch.device, torch.Tensor] = {}
_LUT: dict[torch.device, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    if device not in _DUMMY:
        _DUMMY[device] = torch.zeros(16, dtype=torch.int32, device=device)
    return _DUMMY[device]


def _lut(device: torch.device) -> torch.Tensor:
    if device not in _LUT:
        _LUT[device] = torch.tensor(IQ4_KVALUES, dtype=torch.float32, device=device)
    return _LUT[device]


@dataclasses.dataclass
class Segment:
    """Consecutive shards of one type: output rows [row_start, row_start + rows), repacked."""

    type_name: str
    row_start: int
    rows: int
    k: int
    planes: dict[str, torch.Tensor]

    @property
    def fmt(self) -> Format:
        return FORMATS[self.type_name]

    @property
    def row_tile(self) -> int:
        """Rows per tile of the planes (planes.py): the kernels' TT."""
        return row_tile(self.type_name, self.rows, self.k)

    def pointers(self) -> list[torch.Tensor]:
        dev = self.planes["lo"].device
        ptrs = [self.planes.get(p, _dummy(dev)) for p in PLANES]
        return [*ptrs, _lut(dev)]

    def constexprs(self) -> dict[str, object]:
        f = self.fmt
        return {
            "LO": f.lo, "HI": f.hi, "OFF": f.off, "SG": f.sg, "SCALE": f.scale, "MINK": f.mink,
            "LUT": f.lut, "SCMIN_NIB": f.scmin_nib, "TT": self.row_tile, "TILE": tile_values(self.type_name),
        }  # fmt: skip

    def n_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes.values())

    def alone(self) -> Segment:
        """This segment as a layer of its own (output rows from 0), for a kernel that writes only
        its rows into an output of their size."""
        return dataclasses.replace(self, row_start=0)


def make_segments(weight: torch.Tensor, shards: tuple[GGUFShard, ...], k: int) -> list[Segment]:
    """Repack the raw blocks of `shards` (in the flat uint8 `weight`) into one Segment per run of
    same-type shards."""
    from paphos.quant.gguf.base import raw_shard

    segments: list[Segment] = []
    i = 0
    while i < len(shards):
        j = i
        while j + 1 < len(shards) and shards[j + 1].type_name == shards[i].type_name:
            j += 1
        run = shards[i : j + 1]
        parts = [repack(raw_shard(weight, s), s.type_name, tile=False) for s in run]
        rows = sum(s.rows for s in run)
        planes = tile_rows({name: torch.cat([p[name] for p in parts]) for name in parts[0]}, run[0].type_name, rows, k)
        segments.append(Segment(run[0].type_name, run[0].row_start, rows, k, planes))
        i = j + 1
    return segments


def matmul(x: torch.Tensor, segments: list[Segment], n_total: int) -> torch.Tensor:
    """x [M, K] (contiguous) -> [M, n_total] in x's dtype: the GEMV at one token, the int8
    tensor-core kernel up to I8_MAX_TOKENS[type] for the types it takes, the fused kernel up to
    FUSED_MAX_TOKENS tokens, dequantize + cuBLAS above."""
    m = x.shape[0]
    if m == 1:
        return gemv_matmul(x, segments, n_total)
    if any(_int8_path(s, m) for s in segments):
        return i8_matmul(x, segments, n_total)
    if m <= FUSED_MAX_TOKENS:
        return fused_matmul(x, segments, n_total)
    return dequant_matmul(x, segments, n_total)


def gemv_config(seg: Segment) -> GemvConfig:
    return GEMV_CONFIGS.get((seg.type_name, seg.rows, seg.k)) or default_gemv_config(seg.type_name, seg.rows, seg.k)


def gemv_matmul(x: torch.Tensor, segments: list[Segment], n_total: int) -> torch.Tensor:
    """x [1, K] -> [1, n_total]: triton_gemv for every segment of a format it supports, the fused
    kernel for the others (IQ4 look-up tables, Q3_K). x's int8 parts come from its producer where
    it attached them (x_int8.attached), else one launch per code layout quantizes them here."""
    out = torch.empty(1, n_total, dtype=x.dtype, device=x.device)
    quantized: dict[x_int8.Int8Layout, x_int8.Int8X] = {}
    for seg in segments:
        dst = out[0, seg.row_start : seg.row_start + seg.rows]
        if triton_gemv.supports(seg.fmt):
            cfg = gemv_config(seg)
            xq = None
            layout = _gemv_int8_layout(seg)
            if layout is not None:
                if layout not in quantized:
                    quantized[layout] = x_int8.attached(x, layout) or x_int8.quantize(x, layout)
                xq = quantized[layout]
            triton_gemv.gemv(
                x[0], seg, dst, cfg.block_n, cfg.num_warps, cfg.chunk, cfg.int8_x, cfg.rows_per_program, xq
            )
        else:
            fused_matmul(x, [seg.alone()], seg.rows, into=out[:, seg.row_start : seg.row_start + seg.rows])
    return out


def _gemv_int8_layout(seg: Segment) -> x_int8.Int8Layout | None:
    """The layout in which the segment's batch-1 GEMV reads x as int8 parts (None: float x)."""
    if triton_gemv.supports(seg.fmt) and triton_gemv.uses_integer_dots(seg.fmt, gemv_config(seg).int8_x):
        return triton_gemv.int8_layout(seg.fmt)
    return None


def int8_input_layout(segments: list[Segment]) -> x_int8.Int8Layout | None:
    """The code layout in which the batch-1 GEMV of these segments reads most of its weight bytes
    through integer dots (the layout worth having x's producer write), or None."""
    int8 = [s for s in segments if _gemv_int8_layout(s) is not None]
    return _gemv_int8_layout(max(int8, key=lambda s: s.n_bytes())) if int8 else None


def int8_block_layout(segments: list[Segment]) -> BlockLayout | None:
    """The layout in which the int8 tensor-core kernel reads x at the token counts it runs at for
    the most weight bytes of these segments (the layout worth having x's producer write; a
    segment of another layout quantizes x itself), or None."""
    int8 = [s for s in segments if _int8_path(s, 2)]
    if not int8:
        return None
    layout = triton_gguf_i8.x_layout(max(int8, key=lambda s: s.n_bytes()).type_name)
    limits = [triton_gguf_i8.I8_MAX_TOKENS[s.type_name] for s in int8 if triton_gguf_i8.x_layout(s.type_name) == layout]
    return dataclasses.replace(layout, max_tokens=max(limits))


def fused_matmul(
    x: torch.Tensor, segments: list[Segment], n_total: int, configs: list[KernelConfig] | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (contiguous) -> [M, n_total] in x's dtype with the fused kernel, one launch per
    segment; `configs` (one per segment) overrides `config_for`. `into` [M, n_total] (a column slice
    of a wider output, rows of unit column stride) receives the result instead of a new tensor: the
    kernel writes there, or the split-K float32 sums are cast into it by one copy (a mixed linear's
    segment took a cast and a copy)."""
    m, k = x.shape
    cfgs = configs or [config_for(s.type_name, s.rows, k, m) for s in segments]
    atomic = any(c.split_k > 1 for c in cfgs)
    if atomic:
        out = torch.zeros(m, n_total, dtype=torch.float32, device=x.device)
    else:
        out = into if into is not None else torch.empty(m, n_total, dtype=x.dtype, device=x.device)
    for seg, cfg in zip(segments, cfgs, strict=True):
        bk = fit_block_k(cfg.block_k, k, seg.fmt)
        n_iters = k // bk
        per_split = math.ceil(n_iters / cfg.split_k)
        splits = math.ceil(n_iters / per_split)
        bm = 1 if m == 1 and cfg.block_m == 1 else max(16, cfg.block_m)
        grid = (triton.cdiv(seg.rows, cfg.block_n), splits, m if bm == 1 else triton.cdiv(m, bm))
        _fused_kernel[grid](
            x, out[:, seg.row_start :], *seg.pointers(), m, seg.rows, k, x.stride(0), out.stride(0), per_split,
            **seg.constexprs(), BM=bm, BN=cfg.block_n, BK=bk, ATOMIC=splits > 1, DOT_F32=_dot_fp32(x),
            Q6_K_TILE=_q6_k_tile_path(seg, x, bm), ASM=x.is_cuda, Q6_K_TRANSPOSED=q6_k_tile.TRANSPOSED,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if not atomic:
        return out
    if into is None:
        return out.to(x.dtype)
    return into.copy_(out)


def _q6_k_tile_path(seg: Segment, x: torch.Tensor, block_m: int) -> bool:
    """Whether the fused kernel decodes a Q6_K segment by q6_k_tile.py (tensor-core tiles of a
    16-bit x)."""
    return seg.type_name == "Q6_K" and block_m > 1 and x.dtype in (torch.bfloat16, torch.float16)


def i8_matmul(x: torch.Tensor, segments: list[Segment], n_total: int) -> torch.Tensor:
    """x [M, K] -> [M, n_total]: triton_gguf_i8 for the segments it takes at M tokens (x quantized
    once), the fused kernel for the others."""
    out = torch.empty(x.shape[0], n_total, dtype=x.dtype, device=x.device)
    quantized: dict[BlockLayout, x_int8_blocks.BlockParts] = {}
    for seg in segments:
        dst = out[:, seg.row_start : seg.row_start + seg.rows]
        if _int8_path(seg, x.shape[0]):
            layout = triton_gguf_i8.x_layout(seg.type_name)
            if layout not in quantized:
                quantized[layout] = triton_gguf_i8.quantize_x(x, seg.type_name)
            triton_gguf_i8.matmul_into(dst, quantized[layout], seg)
        else:
            fused_matmul(x, [seg.alone()], seg.rows, into=dst)
    return out


def dequant_into(seg: Segment, row0: int, row_end: int, dst: torch.Tensor, block_n: int = 32) -> None:
    """Rows [row0, row_end) of a segment, dequantized into dst [row_end - row0, K] (row stride
    dst.stride(0), dst's dtype)."""
    bk = fit_block_k(256, seg.k, seg.fmt)
    grid = (triton.cdiv(row_end - row0, block_n), seg.k // bk)
    _dequant_kernel[grid](
        dst, *seg.pointers(), row0, row_end, seg.k, dst.stride(0), **seg.constexprs(), BN=block_n, BK=bk,
        num_warps=4,
    )  # fmt: skip


def gather_rows(seg: Segment, ids: torch.Tensor, dst: torch.Tensor, block_n: int = 16) -> None:
    """Rows `ids` (int [T], on the device) of a segment, dequantized into dst [T, K] (dst's dtype):
    the embedding lookup. Bit-exact against `dequantize` (then the same cast): the fp32 operations
    are the reference's, in its order, and compiled without mul+add fusion (an FMA would round
    once where the reference rounds twice). One launch, shapes fixed by T: CUDA-graph safe."""
    t = ids.numel()
    if t == 0:
        return
    if dst.device.type != "cuda" and dst.dtype != torch.float32:
        # The interpreter truncates fp32 -> bf16 stores; CUDA rounds to nearest even, as torch.
        full = torch.empty(dst.shape, dtype=torch.float32, device=dst.device)
        gather_rows(seg, ids, full, block_n)
        dst.copy_(full)
        return
    bk = fit_block_k(256, seg.k, seg.fmt)
    grid = (triton.cdiv(t, block_n), seg.k // bk)
    _gather_kernel[grid](
        dst, ids, *seg.pointers(), t, seg.k, dst.stride(0), **seg.constexprs(), BN=block_n, BK=bk,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip


def _dot_fp32(x: torch.Tensor) -> bool:
    """Feed tl.dot fp32 off the GPU (TRITON_INTERPRET=1): the interpreter keeps bf16 as raw
    uint16 bits and its dot multiplies those integers (see triton_attention.dot_mode)."""
    return x.device.type != "cuda" and x.dtype == torch.bfloat16


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def scratch(device: torch.device, dtype: torch.dtype, elems: int) -> torch.Tensor:
    """The shared dequantization buffer (grown to the largest request, at most SCRATCH_ELEMS)."""
    key = (device, dtype)
    elems = min(elems, SCRATCH_ELEMS)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < elems:
        _SCRATCH[key] = buf = torch.empty(elems, dtype=dtype, device=device)
    return buf


def dequant_matmul(x: torch.Tensor, segments: list[Segment], n_total: int) -> torch.Tensor:
    """x [M, K] -> [M, n_total]: dequantize into the scratch buffer (in row chunks), cuBLAS GEMM."""
    m, k = x.shape
    buf = scratch(x.device, x.dtype, n_total * k)
    chunk = max(1, buf.numel() // k)
    if n_total <= chunk:
        w = buf[: n_total * k].view(n_total, k)
        for seg in segments:
            dequant_into(seg, 0, seg.rows, w[seg.row_start : seg.row_start + seg.rows])
        return F.linear(x, w)
    out = torch.empty(m, n_total, dtype=x.dtype, device=x.device)
    for a in range(0, n_total, chunk):
        b = min(n_total, a + chunk)
        w = buf[: (b - a) * k].view(b - a, k)
        for seg in segments:
            lo, hi = max(a, seg.row_start), min(b, seg.row_start + seg.rows)
            if lo < hi:
                dequant_into(seg, lo - seg.row_start, hi - seg.row_start, w[lo - a : hi - a])
        out[:, a:b] = F.linear(x, w)
    return out


# ---------------------------------------------------------------------------- the GGUFKernel


_VERIFIED: dict[tuple[str, str, torch.dtype], bool] = {}
# (type, device) whose int8 tensor-core path failed its self-check: their batched decode keeps the
# fused kernel
_INT8_FAILED: set[tuple[str, str]] = set()


def _int8_path(seg: Segment, m: int) -> bool:
    return (triton_gguf_i8.supports(seg.type_name, seg.k) and m <= triton_gguf_i8.I8_MAX_TOKENS[seg.type_name]
            and (seg.type_name, str(seg.planes["lo"].device)) not in _INT8_FAILED)  # fmt: skip


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)


def _self_check(seg: Segment, dtype: torch.dtype) -> bool:
    """Once per (type, device, dtype): the kernels on the first rows of a real layer against the
    torch reference (M = 1, 5, 16, 29, 61 and the dequant path). The int8 path first, on its own (5, 16,
    29 and 61 tokens: one and two token tiles): if it fails to compile or disagrees it is logged and
    left out (batched decode keeps the fused kernel). Then False (logged) if the others fail, and
    the layer falls back to dequantize-at-load."""
    dev = seg.planes["lo"].device
    key = (seg.type_name, str(dev), dtype)
    if key in _VERIFIED:
        return _VERIFIED[key]
    ok = True
    try:
        rows = min(seg.rows, 64)
        sub = Segment(seg.type_name, 0, rows, seg.k, {n: t[:rows] for n, t in seg.planes.items()})
        w = torch.empty(rows, seg.k, dtype=torch.float32, device=dev)
        dequant_into(sub, 0, rows, w)
        gen = torch.Generator(device=dev).manual_seed(0)
        xs = [torch.randn(m, seg.k, device=dev, generator=gen).to(dtype) for m in (1, 5, 16, 29, 61)]
        if _int8_path(sub, 2):
            try:
                errs = [_relative_error(i8_matmul(x, [sub], rows), x.float() @ w.t()) for x in xs[1:]]
                failure = None if max(errs) <= 1e-2 else f"relative error {max(errs):.3g}"
            except Exception as e:  # noqa: BLE001 (any compile/launch failure -> the fused kernel)
                failure = str(e)
            if failure is not None:
                logger.warning("GGUF %s int8 tensor-core kernel failed its self-check (%s); batched decode keeps "
                               "the fused kernel", seg.type_name, failure)  # fmt: skip
                _INT8_FAILED.add((seg.type_name, str(dev)))
        for x in xs:  # every token tile size the fused kernel launches (16, 32, 64)
            err = _relative_error(matmul(x, [sub], rows), x.float() @ w.t())
            if not err <= 1e-2:
                logger.warning("GGUF %s Triton kernel: relative error %.3g at M=%d", seg.type_name, err, x.shape[0])
                ok = False
    except Exception as e:  # noqa: BLE001 (any compile/launch failure -> the safe fallback)
        logger.warning(
            "GGUF %s Triton kernel failed its self-check (%s); dequantizing at load", seg.type_name, e
        )
        ok = False
    _VERIFIED[key] = ok
    return ok


class TritonGGUFKernel:
    """CUDA, bf16/fp16 activations, every shard of a type in `FORMATS`: fused dequant x matmul up
    to FUSED_MAX_TOKENS tokens, dequantize-to-scratch + cuBLAS above (module docstring)."""

    name: ClassVar[str] = "triton-gguf"

    def __init__(self, matmul: bool = True) -> None:
        # False: the layer only serves row lookups (an untied embedding): no scratch buffer.
        self.matmul = matmul

    @classmethod
    def can_implement(cls, shards: tuple[GGUFShard, ...], device: torch.device, dtype: torch.dtype) -> bool:
        return (
            triton is not None
            and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16)
            and all(s.type_name in FORMATS for s in shards)
        )

    def prepare(self, layer: nn.Module, shards: tuple[GGUFShard, ...], dtype: torch.dtype) -> None:
        from paphos.quant.gguf.base import DequantizedAtLoadKernel, drop_raw

        k = self._in_features(shards)
        self.dtype = dtype
        self.n_total = sum(s.rows for s in shards)
        self.segments = make_segments(layer.weight, shards, k)
        self.fallback: DequantizedAtLoadKernel | None = None
        if not all(_self_check(s, dtype) for s in self.segments):
            self.segments = []
            self.fallback = DequantizedAtLoadKernel()
            self.fallback.prepare(layer, shards, dtype)
            return
        for i, seg in enumerate(self.segments):
            for name, t in seg.planes.items():
                layer.register_buffer(f"gguf_{i}_{name}", t, persistent=False)
        if self.matmul:
            # Size the shared scratch buffer now (before KV-cache sizing and CUDA-graph capture).
            scratch(layer.weight.device, dtype, self.n_total * k)
        drop_raw(layer)

    @staticmethod
    def _in_features(shards: tuple[GGUFShard, ...]) -> int:
        s = shards[0]
        fmt = FORMATS[s.type_name]
        return s.row_bytes // type_size(s.type_name) * fmt.block

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback.apply(layer, x)
        return matmul(x.contiguous(), self.segments, self.n_total)

    def int8_input_layout(self) -> x_int8.Int8Layout | None:
        """Where the batch-1 GEMV reads x as int8 parts: the layout its producer should write."""
        return int8_input_layout(self.segments) if self.fallback is None and self.matmul else None

    def int8_block_layout(self) -> BlockLayout | None:
        """Where the int8 tensor-core kernel reads x at a few tokens: the layout its producer should write."""
        return int8_block_layout(self.segments) if self.fallback is None and self.matmul else None

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a one-segment weight (an embedding), dequantized: [*ids.shape, K]."""
        if self.fallback is not None:
            return self.fallback.embed(layer, ids)
        if len(self.segments) != 1:
            raise ValueError("row lookups need a weight of one GGUF type")
        seg = self.segments[0]
        flat = ids.reshape(-1).contiguous()
        out = torch.empty(flat.numel(), seg.k, dtype=self.dtype, device=flat.device)
        gather_rows(seg, flat, out)
        return out.view(*ids.shape, seg.k)
