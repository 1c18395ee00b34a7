"""Triton kernels of the batched multi-LoRA shrink and expand (segmented gather matmuls, as in
punica / S-LoRA) for one flat batch in which every token uses its own adapter slot, or none.

Data flow: a model layer's base matmul writes y [T, O]; the layer's LoRA apply then calls
`lora_shrink` (h [T_cap, N] float32 = x A^T per token) and `lora_expand` (y += h B^T, summed in
float32 and rounded once into y) with the step's `LoRAMapping` (mapping.py). The torch reference
(reference.py) is the oracle and the CPU path.

Layout per projection (S slots, maximal rank R, n_slices output slices: 3 for q|k|v):
  a [S, N = n_slices * R, K]: slice j's A in rows j * R .. j * R + rank - 1, zeros below;
  b [S, O, R]: the slices' B (scale folded in) side by side on O, columns past the rank zero.

Launch grids depend only on the mapping's capacity T_cap, the slot count S and the shapes, never
on the mapping's contents, so a CUDA graph captures them. Axis 0 enumerates the mapping's tiles
(mapping.py: a slot's tokens in tiles of BM rows, at most cdiv(T_cap, BM) + S of them); a program
reads its tile's slot, rank and token rows in one round trip and exits at once if the tile is
unused. Padded rank is skipped: shrink masks A's rows past the rank (masked rows cost no memory
traffic) and a tile of only such rows writes zeros without reading anything; expand reads B and h
only in BK chunks below the rank.

Shrink (tiny N, K up to 14336) splits K across grid axis 2 so that a decode step's few tiles
still fill 132 SMs; the last program of a tile to finish (an atomic count per tile, reset by it:
split_k.py's counters) sums the float32 partials of all K slices. Expand (O up to
28672) has enough tiles over O alone. Block sizes: `shrink_config` / `expand_config`.

Both kernels read the mapping before they wait for their predecessors through programmatic
dependent launch (paphos/layers/pdl.py): nothing in a step writes it (it is copied in before the
step's first kernel), so those loads overlap the kernel before. Expand issues its loads of y
together with those of h and B, so that a tile costs one round trip to memory, not two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paphos.layers import pdl
from paphos.lora.kernels.mapping import DECODE_MAX_TOKENS, LoRAMapping, tile_rows

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels import split_k
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None

NUM_SMS_GUESS = 132  # H100 / H200
# K slices per shrink tile at most: the last program of a tile sums all slices' partials.
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class ShrinkConfig:
    """`_shrink_kernel`'s launch: rows of A (BN) per program, K per step, K slices (the token rows
    per tile are the mapping's)."""

    block_n: int = 16
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ExpandConfig:
    """`_expand_kernel`'s launch: output columns (BN) per block and blocks per program, rank per
    step (the token rows per tile are the mapping's)."""

    block_n: int = 32
    block_k: int = 16
    num_warps: int = 4
    num_stages: int = 2
    col_blocks: int = 1


if triton is not None:

    @triton.jit
    def _tile(pid, meta_ptr, ids_ptr, BM: tl.constexpr):
        """Tile `pid` of grid axis 0 -> (its slot, its rank: 0 for an unused tile, its token rows
        as int64, which of them are real): two independent loads."""
        slot = tl.load(meta_ptr + 2 * pid)
        rank = tl.load(meta_ptr + 2 * pid + 1)
        t = tl.load(ids_ptr + pid * BM + tl.arange(0, BM))
        return slot, rank, t.to(tl.int64), t >= 0

    @triton.jit
    def _sum_splits(acc, part_ptr, count_ptr, tile, at, mask, pid_k, plane, SPLIT: tl.constexpr, ASM: tl.constexpr):
        """split_k.sum_slices' protocol (store the partial, fence, count; the last program sums and
        resets the count), the last program's loop over the slices unrolled (SPLIT constexpr) so
        that their loads are in flight together rather than one round trip to L2 each."""
        tl.store(part_ptr + pid_k * plane + at, acc, mask=mask)
        split_k.fence(ASM)  # every thread's partial is visible GPU-wide before the count says so
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = done == SPLIT - 1
        total = tl.zeros_like(acc)
        if last:
            split_k.fence(ASM)
            for s in tl.static_range(SPLIT):
                total += tl.load(part_ptr + s * plane + at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch
        return last, total

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, h_ptr, part_ptr, count_ptr, meta_ptr, ids_ptr,
        N, K, R, stride_x, stride_h, iters_per_split, plane,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
        EVEN_K: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """h[t, n] = sum_k x[t, k] a[slot, n, k] for the BM tokens of tile pid 0 and rows n of tile
        pid 1, over K slice pid 2. F32: float32 operands, exact products (the interpreter, and
        float32 x or A); else x in A's 16-bit type."""
        pdl.release(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        slot, rank, t, p_ok = _tile(pid_m, meta_ptr, ids_ptr, BM)
        pdl.wait(PDL)
        if rank == 0:
            return
        n = pid_n * BN + tl.arange(0, BN)
        n_ok = (n < N) & (n % R < rank)
        t = tl.where(p_ok, t, 0)
        out = h_ptr + t[:, None] * stride_h + n[None, :]
        out_mask = p_ok[:, None] & (n < N)[None, :]
        if tl.max(n_ok.to(tl.int32), 0) == 0:
            # only rank padding: its h columns are zeros (expand may read a whole BK chunk of them)
            if pid_k == 0:
                tl.store(out, tl.zeros((BM, BN), tl.float32), mask=out_mask)
            return
        xs = x_ptr + t[:, None] * stride_x
        ws = a_ptr + slot.to(tl.int64) * N * K + n[:, None] * K
        it0 = pid_k * iters_per_split
        it1 = tl.minimum(it0 + iters_per_split, tl.cdiv(K, BK))
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for it in range(it0, it1):
            k = it * BK + tl.arange(0, BK)
            if EVEN_K:  # masks constant along K keep the loads vectorized
                xt = tl.load(xs + k[None, :], mask=p_ok[:, None], other=0.0)
                at = tl.load(ws + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                xt = tl.load(xs + k[None, :], mask=p_ok[:, None] & (k < K)[None, :], other=0.0)
                at = tl.load(ws + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
            if F32:
                acc = tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt.to(a_ptr.dtype.element_ty), tl.trans(at), acc)
        if SPLIT > 1:
            last, total = _sum_splits(acc, part_ptr, count_ptr, pid_m * tl.num_programs(1) + pid_n,
                                      t[:, None] * N + n[None, :], out_mask, pid_k, plane, SPLIT, ASM)  # fmt: skip
            if last:
                tl.store(out, total, mask=out_mask)
        else:
            tl.store(out, acc, mask=out_mask)

    @triton.jit
    def _expand_block(
        c0, h_ptr, b_ptr, y_ptr, slot, rank, t, p_ok, N_OUT, R, stride_h, stride_y,
        SLICES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        EVEN_R: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """`_expand_kernel` over columns c0 .. c0 + BN - 1."""
        c = c0 + tl.arange(0, BN)
        out = y_ptr + t[:, None] * stride_y + c[None, :]
        mask = p_ok[:, None] & (c < N_OUT)[None, :]
        base = tl.load(out, mask=mask, other=0.0)
        hs = h_ptr + t[:, None] * stride_h
        bs = b_ptr + slot.to(tl.int64) * N_OUT * R + c[:, None] * R
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for j in tl.static_range(len(SLICES) - 1):
            if (c0 < SLICES[j + 1]) & (c0 + BN > SLICES[j]):
                c_ok = (c >= SLICES[j]) & (c < SLICES[j + 1])
                for k0 in range(0, rank, BK):
                    k = k0 + tl.arange(0, BK)
                    if EVEN_R:
                        hv = tl.load(hs + (j * R + k)[None, :], mask=p_ok[:, None], other=0.0)
                        bv = tl.load(bs + k[None, :], mask=c_ok[:, None], other=0.0)
                    else:
                        hv = tl.load(hs + (j * R + k)[None, :], mask=p_ok[:, None] & (k < R)[None, :], other=0.0)
                        bv = tl.load(bs + k[None, :], mask=c_ok[:, None] & (k < R)[None, :], other=0.0)
                    acc = tl.dot(hv, tl.trans(bv.to(tl.float32)), acc, input_precision=PRECISION)
        tl.store(out, (base.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _expand_kernel(
        h_ptr, b_ptr, y_ptr, meta_ptr, ids_ptr, N_OUT, R, stride_h, stride_y,
        SLICES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, COL_BLOCKS: tl.constexpr,
        EVEN_R: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """y[t, c] += sum_k h[t, j * R + k] b[slot, c, k] for the BM tokens of tile pid 0 and
        COL_BLOCKS blocks of BN columns c of tile pid 1 (unrolled, so their loads are in flight
        together), j the slice of column c (SLICES: the n_slices + 1 column offsets); a block
        across a slice boundary takes one product per slice it touches, B's other columns masked.
        The rank in BK chunks up to the slot's rank (EVEN_R: BK divides R, no mask along it: the
        chunk's columns past the rank are zeros in h and b). PRECISION: tf32 into a 16-bit y on
        the GPU (B exact in it, h rounded to 10 bits: finer than y's rounding), else ieee
        (float32 y, the interpreter)."""
        pdl.release(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot, rank, t, p_ok = _tile(pid_m, meta_ptr, ids_ptr, BM)
        pdl.wait(PDL)
        if rank == 0:
            return
        t = tl.where(p_ok, t, 0)
        for cb in tl.static_range(COL_BLOCKS):
            _expand_block((pid_n * COL_BLOCKS + cb) * BN, h_ptr, b_ptr, y_ptr, slot, rank, t, p_ok, N_OUT, R,
                          stride_h, stride_y, SLICES, BM, BN, BK, EVEN_R, PRECISION)  # fmt: skip


# ---------------------------------------------------------------------------- launch configuration


def supports(device: torch.device) -> bool:
    """CUDA with tensor cores for 16-bit tl.dot (compute capability 8.0 or later), and Triton."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def _pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def shrink_config(t_cap: int, num_slots: int, n: int, k: int) -> ShrinkConfig:
    """Decode (t_cap <= DECODE_MAX_TOKENS: tiles of 16 tokens): 16 rows of A x 128 K per step, the
    smallest tiles (reading A is all the work, and small tiles give the most programs), K split
    as finely as allowed (a power of two <= MAX_SPLIT_K, at least two steps a slice): a decode
    shrink is latency-bound, and on the H200 the finest split was the fastest for every Llama-3-8B
    projection at 1-64 tokens over 1-16 adapters (qkv at 16 tokens over 4: 9.4 -> 6.2 us).
    Prefill (tiles of 64 tokens): up to 64 rows x 64 K, split while the tiles of a step that uses
    every slot (at least one tile per slot, or per 64 tokens) times the split stay within two
    programs per SM."""
    decode = t_cap <= DECODE_MAX_TOKENS
    bn, bk = (16, 128) if decode else (min(64, max(16, _pow2(n))), 64)
    bk = min(bk, max(16, _pow2(k)))
    tiles = max(min(num_slots, t_cap), -(-t_cap // tile_rows(t_cap))) * -(-n // bn)
    steps = -(-k // bk)
    split = 1
    while split * 2 <= MAX_SPLIT_K and steps >= split * 4 and (decode or tiles * split * 2 <= 2 * NUM_SMS_GUESS):
        split *= 2
    return ShrinkConfig(bn, bk, split)


def expand_config(t_cap: int, o: int, r: int) -> ExpandConfig:
    """Decode: blocks of 128 columns with 8 warps, two per program from O > 8192, the fastest rule
    of the H200 sweep on Llama-3-8B projections at 64 tokens over 4 and 16 adapters, rank 16 (us,
    over 4: q|k|v 2.55, o 2.29, gate|up 6.09, down 2.31; 64 columns with 4 warps: 3.03, 2.35, 6.79
    with one block, 2.36); prefill: 64 columns. The rank in chunks of 32 where it divides R (rank
    16 of R = 64 reads half of B's row), else 16 (the smallest tl.dot step)."""
    bk = 32 if r % 32 == 0 else 16
    if t_cap <= DECODE_MAX_TOKENS:
        return ExpandConfig(128, bk, num_warps=8, col_blocks=1 if o <= 8192 else 2)
    return ExpandConfig(64, bk)


# ---------------------------------------------------------------------------- launches


def _check_mapping(mapping: LoRAMapping, num_slots: int, rows: int, what: str) -> None:
    if mapping.num_slots != num_slots:
        raise ValueError(f"{what} has {num_slots} slots, the mapping {mapping.num_slots}")
    if rows < mapping.capacity:
        raise ValueError(f"h has {rows} rows for a mapping of capacity {mapping.capacity}")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, mapping: LoRAMapping, h: torch.Tensor, *, n_slices: int,
                cfg: ShrinkConfig | None = None) -> None:  # fmt: skip
    """h[t, :] = x[t, :] @ a[s].T in float32 for each token t of slot s (reference.shrink_ref).
    x [T, K] fp16 / bf16 / fp32 with unit column stride (any row stride), a [S, n_slices * R, K]
    contiguous, h [T_cap, N] float32 with unit column stride. n_slices gives R, which the rank
    skip needs (the reference does not: its padded rows are zeros). `cfg` overrides
    `shrink_config`."""
    s, n, k = a.shape
    _check_mapping(mapping, s, h.shape[0], "a")
    if n % n_slices or h.shape[1] != n or x.shape[1] != k:
        raise ValueError(f"shrink of x {tuple(x.shape)} by a {tuple(a.shape)} ({n_slices} slices) into h {tuple(h.shape)}")
    if x.stride(1) != 1 or h.stride(1) != 1 or not a.is_contiguous() or h.dtype != torch.float32:
        raise ValueError("lora_shrink needs unit column strides, a contiguous, h float32")
    cfg = cfg or shrink_config(mapping.capacity, s, n, k)
    bk = min(cfg.block_k, max(16, _pow2(k)))
    steps = -(-k // bk)
    per_split = -(-steps // cfg.split_k)
    split = -(-steps // per_split)
    tiles = (mapping.num_tiles, -(-n // cfg.block_n))
    if tiles[0] * tiles[1] > split_k.COUNTERS:
        split, per_split = 1, steps  # one count per tile
    plane = h.shape[0] * n
    partials = torch.empty(split, plane if split > 1 else 1, dtype=torch.float32, device=x.device)
    # counters of their own: the model's layers run shrinks on a side stream, beside split-K matmuls
    counters = split_k.counters(x.device, "lora") if split > 1 else partials
    _shrink_kernel[(*tiles, split)](
        x, a, h, partials, counters, mapping.tile_meta, mapping.tile_ids,
        n, k, n // n_slices, x.stride(0), h.stride(0), per_split, plane,
        BM=mapping.tile_rows, BN=cfg.block_n, BK=bk, SPLIT=split, EVEN_K=k % bk == 0,
        F32=not x.is_cuda or torch.float32 in (x.dtype, a.dtype), ASM=x.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x),
    )  # fmt: skip


def lora_expand(h: torch.Tensor, b: torch.Tensor, slice_starts: tuple[int, ...], mapping: LoRAMapping,
                y: torch.Tensor, cfg: ExpandConfig | None = None) -> None:  # fmt: skip
    """y[t, c] += sum_k h[t, j * R + k] * b[s, c, k] for each token t of slot s, j the slice of
    column c (reference.expand_ref): float32 sums rounded once into y. h [T_cap, n_slices * R]
    float32, b [S, O, R] contiguous, y [T, O] with unit column stride (any row stride),
    slice_starts: the n_slices + 1 column offsets, 0 first and O last. `cfg` overrides
    `expand_config`."""
    s, o, r = b.shape
    _check_mapping(mapping, s, h.shape[0], "b")
    slices = tuple(int(v) for v in slice_starts)
    if slices[0] != 0 or slices[-1] != o or y.shape[1] != o or h.shape[1] != r * (len(slices) - 1):
        raise ValueError(f"expand of h {tuple(h.shape)} by b {tuple(b.shape)} into y {tuple(y.shape)}, slices {slices}")
    if y.stride(1) != 1 or h.stride(1) != 1 or not b.is_contiguous() or h.dtype != torch.float32:
        raise ValueError("lora_expand needs unit column strides, b contiguous, h float32")
    cfg = cfg or expand_config(mapping.capacity, o, r)
    grid = (mapping.num_tiles, -(-o // (cfg.block_n * cfg.col_blocks)))
    _expand_kernel[grid](
        h, b, y, mapping.tile_meta, mapping.tile_ids, o, r, h.stride(0), y.stride(0),
        SLICES=slices, BM=mapping.tile_rows, BN=cfg.block_n, BK=cfg.block_k, COL_BLOCKS=cfg.col_blocks,
        EVEN_R=r % cfg.block_k == 0, PRECISION="tf32" if y.is_cuda and y.dtype != torch.float32 else "ieee",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(y),
    )  # fmt: skip
