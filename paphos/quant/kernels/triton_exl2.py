"""Triton kernels of EXL2 weights (ExLlamaV2's per-group mixed bit widths) on CUDA, and `matmul`,
the one entry point an EXL2 layer calls every step.

Data flow: paphos/quant/exl2.py loads each shard's checkpoint tensors, `pack` turns them into one
`EXL2Planes` per layer (all shards of a merged q|k|v or gate|up layer in one set of planes) and
frees the checkpoint tensors (with `-tp N`, a rank's part: its output columns, or a row-parallel
rank's stored rows as a layer of their own, exl2.py; the layout is the same); then every forward
is `matmul(x, planes)`, by tokens per step M:
  - M <= GEMV_MAX_TOKENS (decode): `_gemv_kernel`, one launch per layer (merged shards included),
    reading each packed word once for all M tokens, fp32 accumulation, output in x's dtype.
  - above: `_dequant_kernel` writes W^T [K, N] in the model dtype, rows in input order, into the
    scratch buffer shared with the GGUF and int families (triton_gguf.scratch; in column chunks
    where it is smaller), then cuBLAS (`x @ W^T`).

The layout on the GPU (`pack`): the checkpoint's bytes, re-indexed, nothing expanded.
  words   int32 [sum of R_s * N_s]   every shard's q_weight as stored (per output column a bit
                                     stream along K, [R, N] row-major: a word row is contiguous
                                     over the columns, so a program's columns load coalesced)
  scales  int32 [sum of G_s * N_s/8] every shard's q_scale as stored (4-bit codes, 8 per word)
  smax    fp16  [sum of G_s]         fp16(q_scale_max / 256): the rounded maximum every scale
                                     multiplies (exl2.py's rule), computed once
  runs    int32 [S, ceil(K / 32), 2] per shard and run of 32 stored rows: its first q_weight row
                                     and (bits | group << 4). A run never crosses a group (groups
                                     are whole runs but the last, `supports` checks), so a run
                                     has one bit width and one scale row, known by one load
  perm    int32 [S * K]              per shard argsort(q_invperm): stored row j multiplies
                                     x[perm[j]]; `_gather_kernel` writes x in every shard's
                                     stored order (float32) before the GEMV, which then reads it
                                     without masks (in-GEMV gathers cost 9.7 instructions per
                                     weight against 8.5, sm_90 assembly); the dequantization
                                     writes stored row j as input row perm[j]
                                     (so one cuBLAS call serves shards with different perms)
  meta    int32 [S, 8]               per shard: offsets and strides into the planes above, its
                                     first output column and its columns
  tiles   int32 [T, 2]               (shard, first column) of each BLOCK_N-column program tile
                                     (tiles never cross shards): one launch per merged layer
About K / 4 + 8 bytes per shard beyond the checkpoint's tensors (runs against q_groups).
Why these and not more: the scales stay 4-bit codes (a scale per group and column in fp16 would
be 4x q_scale's bytes, +3-5 % of the weights at 4 bpw, to save a load and ~8 integer ops per 32
codes); the bit streams stay as written, since every code of a run sits at a position fixed by
the bit width alone and each kernel has a compile-time unpacking per width (2, 3, 4, 5, 6, 8
bits; 3/5/6-bit codes that straddle two words are joined from both), chosen per run at run time
(one uniform branch per 32 rows). x is permuted rather than the weights (the weights stay
untouched) and the merged shards keep their own permutations.

Numerics (exact to exl2.dequantize, the bit-exact rule): the scale is fp16((qs + 1)**2 *
smax), the weight fp16(code * scale), both rounded from float32 products that are exact (codes
become floats by the 2**23 mantissa trick: no integer conversion); the GEMV multiplies that fp16
value by x in float32 (the dense path converts it to the model dtype first, as the CPU path
does). CUDA-graph safe: no host syncs, buffers sized by shapes only; split-K partials are summed
by the last program of each tile (split_k.py); the GEMV uses programmatic dependent launch
(paphos/layers/pdl.py). Measured on the H200: benchmarks/bench_quant_gpu.py (`exl2_kernels`,
`exl2`, `exl2_mix`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from paphos.layers import pdl

try:
    import triton
    import triton.language as tl

    from paphos.quant.gguf import triton_gguf
    from paphos.quant.kernels import split_k
except ImportError:  # CPU-only installs: the layers dequantize at load
    triton = None

# The bit widths the kernels unpack (exllamav2's converter writes these).
KERNEL_BITS = (2, 3, 4, 5, 6, 8)
META = 8  # int32 entries per shard in `meta`
# Up to this many tokens the GEMV runs (weights decoded once for all of them); above, dequantize
# + cuBLAS. bench_quant_gpu.py's `exl2_kernels` section times both at 1-16 tokens.
GEMV_MAX_TOKENS = 8
NUM_SMS_GUESS = 132
# Split-K: aim for this many programs per SM, each slice keeping at least MIN_RUNS runs of 32 rows.
PROGRAMS_PER_SM = 8
MIN_RUNS = 4
GATHER_BLOCK = 1024

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
    def _code(w0, w1, w2, w3, w4, w5, w6, w7, START: tl.constexpr, BITS: tl.constexpr):
        """The unsigned code at stream bit START of a run (uint32 words): its low bits from word
        START // 32, shifted down; a code that straddles a word boundary takes its high bits from
        the next word (a funnel shift)."""
        LO: tl.constexpr = START // 32
        S: tl.constexpr = START % 32
        lo = _pick(w0, w1, w2, w3, w4, w5, w6, w7, LO)
        if S + BITS > 32:
            hi = _pick(w0, w1, w2, w3, w4, w5, w6, w7, LO + 1)
            c = (lo >> S) | (hi << (32 - S))
        else:
            c = lo >> S
        return c & ((1 << BITS) - 1)

    @triton.jit
    def _weight(c, scale, BITS: tl.constexpr):
        """fp16((code - 2**(BITS - 1)) * scale) as float32: the code OR-ed into the mantissa of
        2**23 is the float 2**23 + code exactly; the product with the fp16 scale is exact in
        float32 and rounded to fp16 once (exl2.dequantize's rule)."""
        f = (c | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + (1 << (BITS - 1)))
        return (f * scale).to(tl.float16).to(tl.float32)

    @triton.jit
    def _word_row(wp, ROW: tl.constexpr, w_stride, col_ok, rows_left, EVEN_K: tl.constexpr):
        """Word row ROW of a run for the program's columns, as uint32; rows past the shard's
        q_weight (only in a short last run, never when K is a multiple of 32) read as 0."""
        if EVEN_K:
            mask = col_ok
        else:
            # (a scalar condition broadcast through a vector: the interpreter cannot AND a scalar bool)
            mask = col_ok & (rows_left + col_ok.to(tl.int32) * 0 > ROW)
        return tl.load(wp + ROW * w_stride, mask=mask, other=0).to(tl.uint32, bitcast=True)

    @triton.jit
    def _load_words(wp, w_stride, col_ok, rows_left, BITS: tl.constexpr, EVEN_K: tl.constexpr):
        """A run's BITS word rows (the rest alias row 0 and are never read)."""
        w0 = _word_row(wp, 0, w_stride, col_ok, rows_left, EVEN_K)
        w1 = w0
        w2 = w0
        w3 = w0
        w4 = w0
        w5 = w0
        w6 = w0
        w7 = w0
        if BITS > 1:
            w1 = _word_row(wp, 1, w_stride, col_ok, rows_left, EVEN_K)
        if BITS > 2:
            w2 = _word_row(wp, 2, w_stride, col_ok, rows_left, EVEN_K)
        if BITS > 3:
            w3 = _word_row(wp, 3, w_stride, col_ok, rows_left, EVEN_K)
        if BITS > 4:
            w4 = _word_row(wp, 4, w_stride, col_ok, rows_left, EVEN_K)
        if BITS > 5:
            w5 = _word_row(wp, 5, w_stride, col_ok, rows_left, EVEN_K)
        if BITS > 6:
            w6 = _word_row(wp, 6, w_stride, col_ok, rows_left, EVEN_K)
        if BITS > 7:
            w7 = _word_row(wp, 7, w_stride, col_ok, rows_left, EVEN_K)
        return w0, w1, w2, w3, w4, w5, w6, w7

    @triton.jit
    def _run_gemv(acc, wp, w_stride, col_ok, rows_left, scale, xp, ms, BITS: tl.constexpr, MP: tl.constexpr,
                  EVEN_K: tl.constexpr):  # fmt: skip
        """acc [MP, BN] += xg[v, :] * w[v, cols] over the run's 32 stored rows v (xg: x gathered into
        stored order by `_gather_kernel`, float32, MP tokens per row)."""
        w0, w1, w2, w3, w4, w5, w6, w7 = _load_words(wp, w_stride, col_ok, rows_left, BITS, EVEN_K)
        for v in tl.static_range(32):
            w = _weight(_code(w0, w1, w2, w3, w4, w5, w6, w7, v * BITS, BITS), scale, BITS)
            xv = tl.load(xp + v * MP + ms)
            acc += xv[:, None] * w[None, :]
        return acc

    @triton.jit
    def _run_store(
        out_ptr, stride_o, o_cols, wp, w_stride, col_ok, rows_left, scale, pp, j0, K,
        BITS: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        """The run's 32 stored rows v of the program's columns into out[perm[j0 + v], o_cols]."""
        w0, w1, w2, w3, w4, w5, w6, w7 = _load_words(wp, w_stride, col_ok, rows_left, BITS, EVEN_K)
        for v in tl.static_range(32):
            w = _weight(_code(w0, w1, w2, w3, w4, w5, w6, w7, v * BITS, BITS), scale, BITS)
            if EVEN_K:
                row = tl.load(pp + v)
                tl.store(out_ptr + row.to(tl.int64) * stride_o + o_cols, w.to(out_ptr.dtype.element_ty), mask=col_ok)
            else:
                ok = j0 + v < K
                row = tl.load(pp + v, mask=ok, other=0)
                tl.store(out_ptr + row.to(tl.int64) * stride_o + o_cols, w.to(out_ptr.dtype.element_ty),
                         mask=col_ok & (o_cols * 0 + j0 + v < K))  # fmt: skip

    @triton.jit
    def _tile(meta_ptr, tile_ptr, tile, BN: tl.constexpr):
        """A program tile's shard and its planes' offsets: (shard, w_off, w_stride, w_rows, s_off,
        s_stride, m_off, first output column, columns of the tile (index), column ok)."""
        shard = tl.load(tile_ptr + 2 * tile)
        c0 = tl.load(tile_ptr + 2 * tile + 1)
        meta = meta_ptr + shard * 8
        w_off = tl.load(meta).to(tl.int64)
        w_stride = tl.load(meta + 1)
        w_rows = tl.load(meta + 2)
        s_off = tl.load(meta + 3).to(tl.int64)
        s_stride = tl.load(meta + 4)
        m_off = tl.load(meta + 5)
        col0 = tl.load(meta + 6)
        n_cols = tl.load(meta + 7)
        cols = c0 + tl.arange(0, BN)
        return shard, w_off, w_stride, w_rows, s_off, s_stride, m_off, col0, cols, cols < n_cols

    @triton.jit
    def _run_scale(s_ptr, m_ptr, s_off, s_stride, m_off, g, cols, col_ok):
        """The fp16 scales of group g for the columns, as float32: fp16((qs + 1)**2 * smax)."""
        qs = (tl.load(s_ptr + s_off + g * s_stride + cols // 8, mask=col_ok, other=0) >> ((cols % 8) * 4)) & 15
        smax = tl.load(m_ptr + m_off + g).to(tl.float32)
        return (((qs + 1) * (qs + 1)).to(tl.float32) * smax).to(tl.float16).to(tl.float32)

    @triton.jit
    def _gemv_kernel(
        xg_ptr, out_ptr, part_ptr, count_ptr, w_ptr, s_ptr, m_ptr, run_ptr, meta_ptr, tile_ptr,
        M, N, n_runs, runs_per_split,
        BN: tl.constexpr, MP: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """out [M, N] = x [M, K] W^T: one program per tile of BN columns (of one shard) and slice
        of runs_per_split runs (grid axis 1; SPLIT: more than one slice, the last program of a
        tile to finish sums the float32 partials). Per run: its bit width picks the unpacking
        (a uniform branch), its group the scales; x comes gathered into stored order, float32
        (`_gather_kernel`: one load per code and thread, no masks)."""
        pdl.release(PDL)
        tile = tl.program_id(0)
        pid_k = tl.program_id(1)
        shard, w_off, w_stride, w_rows, s_off, s_stride, m_off, col0, cols, col_ok = _tile(meta_ptr, tile_ptr, tile, BN)
        ms = tl.arange(0, MP)
        m_ok = ms < M
        r0 = pid_k * runs_per_split
        r1 = tl.minimum(r0 + runs_per_split, n_runs)
        acc = tl.zeros((MP, BN), dtype=tl.float32)
        pdl.wait(PDL)  # xg comes from the kernel before
        for r in range(r0, r1):
            rp = run_ptr + (shard * n_runs + r) * 2
            word_row = tl.load(rp)
            info = tl.load(rp + 1)
            bits = info & 15
            scale = _run_scale(s_ptr, m_ptr, s_off, s_stride, m_off, info >> 4, cols, col_ok)
            wp = w_ptr + w_off + word_row.to(tl.int64) * w_stride + cols
            rows_left = w_rows - word_row
            xp = xg_ptr + (shard * n_runs + r) * (32 * MP)
            if bits == 4:
                acc = _run_gemv(acc, wp, w_stride, col_ok, rows_left, scale, xp, ms, 4, MP, EVEN_K)
            elif bits == 3:
                acc = _run_gemv(acc, wp, w_stride, col_ok, rows_left, scale, xp, ms, 3, MP, EVEN_K)
            elif bits == 5:
                acc = _run_gemv(acc, wp, w_stride, col_ok, rows_left, scale, xp, ms, 5, MP, EVEN_K)
            elif bits == 6:
                acc = _run_gemv(acc, wp, w_stride, col_ok, rows_left, scale, xp, ms, 6, MP, EVEN_K)
            elif bits == 2:
                acc = _run_gemv(acc, wp, w_stride, col_ok, rows_left, scale, xp, ms, 2, MP, EVEN_K)
            else:
                acc = _run_gemv(acc, wp, w_stride, col_ok, rows_left, scale, xp, ms, 8, MP, EVEN_K)
        o_cols = col0 + cols
        mask = m_ok[:, None] & col_ok[None, :]
        at = ms[:, None] * N + o_cols[None, :]  # out and the partial planes are [M, N]
        if SPLIT:
            last, total = split_k.sum_slices(acc, part_ptr, count_ptr, tile, at, mask, pid_k, tl.num_programs(1),
                                             M * N, ASM)  # fmt: skip
            if last:
                tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gather_kernel(
        x_ptr, perm_ptr, out_ptr, M, K, KP, stride_xm, total, MP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """out [S, KP, MP] float32 = x[m, perm_s[j]] for shard s, stored row j < K and token m < M,
        0 elsewhere (KP: K rounded up to whole runs, MP: M rounded up to a power of two), so the
        GEMV reads x with no masks, MP tokens of a row in one vector."""
        pdl.release(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        m = i % MP
        row = i // MP
        j = row % KP
        valid = ok & (j < K) & (m < M)
        src = tl.load(perm_ptr + (row // KP) * K + j, mask=valid, other=0)  # static: before the wait
        pdl.wait(PDL)
        v = tl.load(x_ptr + m * stride_xm + src, mask=valid, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, v, mask=ok)

    @triton.jit
    def _dequant_kernel(
        out_ptr, w_ptr, s_ptr, m_ptr, run_ptr, perm_ptr, meta_ptr, tile_ptr, K, n_runs, col_a, col_b, stride_o,
        BN: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        """Output columns [col_a, col_b) of W^T, rows in input order, into out [K, col_b - col_a]
        (its dtype): one program per column tile and run."""
        tile = tl.program_id(0)
        r = tl.program_id(1)
        shard, w_off, w_stride, w_rows, s_off, s_stride, m_off, col0, cols, col_ok = _tile(meta_ptr, tile_ptr, tile, BN)
        o_cols = col0 + cols
        col_ok = col_ok & (o_cols >= col_a) & (o_cols < col_b)
        rp = run_ptr + (shard * n_runs + r) * 2
        word_row = tl.load(rp)
        info = tl.load(rp + 1)
        bits = info & 15
        scale = _run_scale(s_ptr, m_ptr, s_off, s_stride, m_off, info >> 4, cols, col_ok)
        wp = w_ptr + w_off + word_row.to(tl.int64) * w_stride + cols
        rows_left = w_rows - word_row
        pp = perm_ptr + shard * K + r * 32
        j0 = r * 32
        oc = o_cols - col_a
        if bits == 4:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, rows_left, scale, pp, j0, K, 4, EVEN_K)
        elif bits == 3:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, rows_left, scale, pp, j0, K, 3, EVEN_K)
        elif bits == 5:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, rows_left, scale, pp, j0, K, 5, EVEN_K)
        elif bits == 6:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, rows_left, scale, pp, j0, K, 6, EVEN_K)
        elif bits == 2:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, rows_left, scale, pp, j0, K, 2, EVEN_K)
        else:
            _run_store(out_ptr, stride_o, oc, wp, w_stride, col_ok, rows_left, scale, pp, j0, K, 8, EVEN_K)


# ---------------------------------------------------------------------------- the planes


@dataclass(frozen=True)
class Shard:
    """One checkpoint shard's tensors, validated (exl2.check_tensors), as `pack` takes them."""

    q_weight: torch.Tensor  # int32 [R, Npad]
    q_scale: torch.Tensor  # int32 [G, ceil(Npad / 8)]
    q_scale_max: torch.Tensor  # fp16 [G]
    invperm: torch.Tensor  # [K]
    groups: list[tuple[int, int, int]]  # per group (bits, first q_weight row, first stored row)
    columns: int  # output columns the layer keeps (<= Npad)


@dataclass
class EXL2Planes:
    """A layer's weights as the kernels read them (module docstring)."""

    words: torch.Tensor
    scales: torch.Tensor
    smax: torch.Tensor
    runs: torch.Tensor
    perm: torch.Tensor
    meta: torch.Tensor
    tiles: torch.Tensor
    k: int
    n: int  # output columns of all shards
    block_n: int
    splits: dict[int, int] = field(default_factory=dict)  # GEMV K slices by MP, filled on first use

    @property
    def n_runs(self) -> int:
        return self.runs.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in ("words", "scales", "smax", "runs", "perm", "meta", "tiles")}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def unsupported(shard_groups: list[list[tuple[int, int, int]]], k: int) -> str | None:
    """Why the kernels cannot take a layer whose shards have these groups, or None: bit widths
    they do not unpack, or a group other than the last whose rows are not whole runs of 32."""
    for groups in shard_groups:
        for g, (bits, _, row) in enumerate(groups):
            end = groups[g + 1][2] if g + 1 < len(groups) else k
            if bits not in KERNEL_BITS:
                return f"{bits}-bit groups (the kernels unpack {', '.join(map(str, KERNEL_BITS))} bits)"
            if row % 32 or (g + 1 < len(groups) and (end - row) % 32):
                return f"a group of {end - row} rows at row {row} (the kernels take groups of whole 32-row runs)"
    return None


def default_block_n(columns: tuple[int, ...]) -> int:
    """256 columns per program tile (4 per thread on 2 warps: 16-byte loads of each word row),
    fewer for layers whose every shard is narrower."""
    return max(16, min(256, triton.next_power_of_2(max(columns)) if triton is not None else 256))


def pack(shards: list[Shard], block_n: int | None = None) -> EXL2Planes:
    """The kernels' planes of a layer's shards (same K; on their device). Call `unsupported` first."""
    k = shards[0].invperm.numel()
    device = shards[0].q_weight.device
    n_runs = -(-k // 32)
    block_n = block_n or default_block_n(tuple(s.columns for s in shards))
    runs: list[list[int]] = []  # per shard and run: first q_weight row, bits | group << 4
    meta, tiles = [], []
    w_off = s_off = m_off = col0 = 0
    for i, s in enumerate(shards):
        for g, (bits, word0, row0) in enumerate(s.groups):
            end = s.groups[g + 1][2] if g + 1 < len(s.groups) else k
            runs += [[word0 + bits * (run - row0 // 32), bits | g << 4] for run in range(row0 // 32, -(-end // 32))]
        r, npad = s.q_weight.shape
        meta.append([w_off, npad, r, s_off, s.q_scale.shape[1], m_off, col0, s.columns])
        tiles += [[i, c] for c in range(0, s.columns, block_n)]
        w_off += s.q_weight.numel()
        s_off += s.q_scale.numel()
        m_off += s.q_scale_max.numel()
        col0 += s.columns
    if w_off >= 1 << 31 or s_off >= 1 << 31:
        raise ValueError("EXL2 layer too large for 32-bit offsets")
    return EXL2Planes(
        words=torch.cat([s.q_weight.reshape(-1) for s in shards]),
        scales=torch.cat([s.q_scale.reshape(-1) for s in shards]),
        # exllamav2's rounding of the maximum (exl2.py): fp16(fp16 max / 256), exact in float32 first
        smax=torch.cat([(s.q_scale_max.float() / 256).half() for s in shards]),
        runs=torch.tensor(runs, dtype=torch.int32, device=device).view(len(shards), n_runs, 2),
        perm=torch.cat([torch.argsort(s.invperm.long()) for s in shards]).to(torch.int32),
        meta=torch.tensor(meta, dtype=torch.int32, device=device),
        tiles=torch.tensor(tiles, dtype=torch.int32, device=device),
        k=k,
        n=col0,
        block_n=block_n,
    )


# ---------------------------------------------------------------------------- torch reference


def reference_weight(planes: EXL2Planes) -> torch.Tensor:
    """float32 [N, K] (input order) from the planes, in torch: what every kernel computes."""
    k = planes.k
    runs, meta = planes.runs.cpu(), planes.meta.cpu().tolist()
    out = []
    words_all = planes.words.cpu().to(torch.int64) & 0xFFFFFFFF
    for i, (w_off, npad, r, s_off, s_words, m_off, _, cols) in enumerate(meta):
        words = words_all[w_off : w_off + r * npad].view(r, npad)
        qs_words = planes.scales.cpu()[s_off:].to(torch.int64)
        stored = torch.empty(k, npad, dtype=torch.float32)
        for run in range(planes.n_runs):
            word0, info = runs[i, run].tolist()
            bits, g = info & 15, info >> 4
            rows = min(32, k - run * 32)
            stream = torch.zeros(bits, npad, dtype=torch.int64)
            avail = min(bits, r - word0)
            stream[:avail] = words[word0 : word0 + avail]
            start = torch.arange(rows) * bits
            lo, sh = start // 32, (start % 32)[:, None]
            hi = torch.clamp(lo + 1, max=bits - 1)
            codes = ((stream[lo] >> sh) | torch.where(sh + bits > 32, stream[hi] << (32 - sh), 0)) & ((1 << bits) - 1)
            qs = (qs_words[g * s_words + torch.arange(npad) // 8] >> (torch.arange(npad) % 8 * 4)) & 15
            scale = ((qs + 1).square().float() * planes.smax.cpu()[m_off + g].float()).half().float()
            stored[run * 32 : run * 32 + rows] = ((codes - (1 << (bits - 1))).float() * scale).half().float()
        perm = planes.perm.cpu()[i * k : (i + 1) * k].long()
        w = torch.empty(npad, k)
        w[:, perm] = stored.t()
        out.append(w[:cols])
    return torch.cat(out)


# ---------------------------------------------------------------------------- launches


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """CUDA of compute capability 8.0 or later, Triton, fp16 / bf16 activations."""
    return (
        triton is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


def gemv_split(planes: EXL2Planes, mp: int = 1) -> int:
    """K slices of the GEMV: the column tiles alone are too few programs for narrow layers (o and
    down_proj: 16 tiles of 256), so slices of runs are added (a power of two) until the grid
    reaches PROGRAMS_PER_SM programs per SM or a slice would keep fewer than MIN_RUNS runs."""
    split = planes.splits.get(mp)
    if split is None:
        tiles, split = planes.tiles.shape[0], 1
        while tiles * split * 2 <= PROGRAMS_PER_SM * NUM_SMS_GUESS and planes.n_runs // (split * 2) >= MIN_RUNS:
            split *= 2
        planes.splits[mp] = split
    return split


def gemv(x: torch.Tensor, planes: EXL2Planes, split: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """x [M, K] (contiguous, M <= 16 or so: registers grow with M) -> [M, N] in x's dtype."""
    m = x.shape[0]
    mp = max(1, triton.next_power_of_2(m))
    n_runs = planes.n_runs
    split = split or gemv_split(planes, mp)
    per_split = -(-n_runs // split)
    splits = -(-n_runs // per_split)
    tiles = planes.tiles.shape[0]
    use_split = splits > 1 and tiles <= split_k.COUNTERS and splits * m * planes.n < 1 << 31
    if not use_split:
        per_split, splits = n_runs, 1
    shards = planes.meta.shape[0]
    kp = n_runs * 32
    xg = torch.empty(shards, kp, mp, dtype=torch.float32, device=x.device)
    total = xg.numel()
    _gather_kernel[(triton.cdiv(total, GATHER_BLOCK),)](
        x, planes.perm, xg, m, planes.k, kp, x.stride(0), total, MP=mp, BLOCK=GATHER_BLOCK, num_warps=4,
        **pdl.options(x),
    )  # fmt: skip
    out = torch.empty(m, planes.n, dtype=x.dtype, device=x.device)
    partials = torch.empty(splits if use_split else 1, m, planes.n, dtype=torch.float32, device=x.device)
    counters = split_k.counters(x.device) if use_split else partials
    warps = num_warps or max(1, min(4, planes.block_n // 128))
    _gemv_kernel[(tiles, splits)](
        xg, out, partials, counters, planes.words, planes.scales, planes.smax, planes.runs, planes.meta, planes.tiles,
        m, planes.n, n_runs, per_split,
        BN=planes.block_n, MP=mp, SPLIT=use_split, EVEN_K=planes.k % 32 == 0, ASM=x.is_cuda, num_warps=warps,
        **pdl.options(x),
    )  # fmt: skip
    return out


def dequantize_into(planes: EXL2Planes, col_a: int, col_b: int, dst: torch.Tensor) -> None:
    """Output columns [col_a, col_b) of W^T (rows in input order) into dst [K, col_b - col_a]
    (its dtype: fp16 / bf16 on the GPU, float32 in the interpreter)."""
    _dequant_kernel[(planes.tiles.shape[0], planes.n_runs)](
        dst, planes.words, planes.scales, planes.smax, planes.runs, planes.perm, planes.meta, planes.tiles,
        planes.k, planes.n_runs, col_a, col_b, dst.stride(0),
        BN=planes.block_n, EVEN_K=planes.k % 32 == 0, num_warps=max(1, min(4, planes.block_n // 64)),
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
    """Size the shared scratch buffer at load (before KV-cache sizing and CUDA-graph capture)."""
    triton_gguf.scratch(device, dtype, planes.n * planes.k)


def bits_per_weight(planes: EXL2Planes) -> float:
    """Bytes on the GPU per weight of the layer, in bits (its padding columns included)."""
    return planes.nbytes() * 8 / (planes.n * planes.k) if planes.n else math.nan
