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
on the mapping's contents, so a CUDA graph captures them. Axis 0 enumerates tiles of BM tokens of
one slot: slot s with tokens and a nonzero rank owns ceil(count_s / BM) of them, in slot order,
which sum to at most cdiv(T_cap, BM) + S; each program finds its slot from slot_starts and
slot_ranks (a prefix sum over S values) and exits at once if it has none. Padded rank is skipped:
shrink masks A's rows past the rank (masked rows cost no memory traffic) and a tile of only such
rows writes zeros without reading anything; expand reads B and h only in BK chunks below the
rank.

Shrink (tiny N, K up to 14336) splits K across grid axis 2 so that a decode step's few tiles
still fill 132 SMs; the last program of a tile to finish (an atomic count per tile, reset by it:
split_k.py's counters) sums the float32 partials of all K slices. Expand (O up to
28672) has enough tiles over O alone. Block sizes: `shrink_config` / `expand_config`.

Every kernel waits for its predecessors through programmatic dependent launch before it reads
anything (paphos/layers/pdl.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paphos.layers import pdl
from paphos.lora.kernels.mapping import LoRAMapping

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels import split_k
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None

NUM_SMS_GUESS = 132  # H100 / H200
# Up to this many tokens in the mapping's capacity the tiles are a decode step's: 16 tokens, the
# smallest tl.dot tile, since a slot holds a few of them; above, 64-token tiles of prefill chunks.
DECODE_MAX_TOKENS = 64
# K slices per shrink tile at most: the last program of a tile sums all slices' partials.
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class ShrinkConfig:
    """`_shrink_kernel`'s launch: tokens (BM) x rows of A (BN) per tile, K per step, K slices."""

    block_m: int = 16
    block_n: int = 16
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ExpandConfig:
    """`_expand_kernel`'s launch: tokens (BM) x output columns (BN) per tile, rank per step."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 16
    num_warps: int = 4
    num_stages: int = 2


if triton is not None:

    @triton.jit
    def _slot_tile(pid, starts_ptr, ranks_ptr, S, BM: tl.constexpr, SP: tl.constexpr):
        """Tile `pid` of grid axis 0 -> (its slot, its first position in sorted_token_ids, the end
        of the slot's positions, the slot's rank); rank 0 where pid is past the last tile. SP: a
        power of two >= S."""
        i = tl.arange(0, SP)
        ok = i < S
        lo = tl.load(starts_ptr + i, mask=ok, other=0)
        hi = tl.load(starts_ptr + i + 1, mask=ok, other=0)
        rank = tl.load(ranks_ptr + i, mask=ok, other=0)
        tiles = tl.where(rank > 0, (hi - lo + BM - 1) // BM, 0)
        ends = tl.cumsum(tiles, 0)
        slot = tl.sum((ends <= pid).to(tl.int32), 0)  # ends are non-decreasing: slots wholly before pid
        mine = i == slot
        first = tl.sum(tl.where(mine, lo, 0), 0) + (pid - tl.sum(tl.where(mine, ends - tiles, 0), 0)) * BM
        return slot, first, tl.sum(tl.where(mine, hi, 0), 0), tl.sum(tl.where(mine, rank, 0), 0)

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
        x_ptr, a_ptr, h_ptr, part_ptr, count_ptr, ids_ptr, starts_ptr, ranks_ptr,
        S, N, K, R, stride_x, stride_h, iters_per_split, plane,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr, SPLIT: tl.constexpr,
        EVEN_K: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """h[t, n] = sum_k x[t, k] a[slot, n, k] for the BM tokens of tile pid 0 and rows n of tile
        pid 1, over K slice pid 2. F32: float32 operands, exact products (the interpreter, and
        float32 x or A); else x in A's 16-bit type."""
        pdl.release(PDL)
        pdl.wait(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        slot, p0, p_end, rank = _slot_tile(pid_m, starts_ptr, ranks_ptr, S, BM, SP)
        if rank == 0:
            return
        n = pid_n * BN + tl.arange(0, BN)
        n_ok = (n < N) & (n % R < rank)
        p = p0 + tl.arange(0, BM)
        p_ok = p < p_end
        t = tl.load(ids_ptr + p, mask=p_ok, other=0).to(tl.int64)
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
    def _expand_kernel(
        h_ptr, b_ptr, y_ptr, ids_ptr, starts_ptr, ranks_ptr, S, N_OUT, R, stride_h, stride_y,
        SLICES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SP: tl.constexpr,
        EVEN_R: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """y[t, c] += sum_k h[t, j * R + k] b[slot, c, k] for the BM tokens of tile pid 0 and
        columns c of tile pid 1, j the slice of column c (SLICES: the n_slices + 1 column
        offsets); a tile across a slice boundary takes one product per slice it touches, B's
        other columns masked. The rank in BK chunks up to the slot's rank (EVEN_R: BK divides R,
        no mask along it: the chunk's columns past the rank are zeros in h and b). PRECISION:
        tf32 into a 16-bit y on the GPU (B exact in it, h rounded to 10 bits: finer than y's
        rounding), else ieee (float32 y, the interpreter)."""
        pdl.release(PDL)
        pdl.wait(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot, p0, p_end, rank = _slot_tile(pid_m, starts_ptr, ranks_ptr, S, BM, SP)
        if rank == 0:
            return
        c0 = pid_n * BN
        c = c0 + tl.arange(0, BN)
        p = p0 + tl.arange(0, BM)
        p_ok = p < p_end
        t = tl.load(ids_ptr + p, mask=p_ok, other=0).to(tl.int64)
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
        out = y_ptr + t[:, None] * stride_y + c[None, :]
        mask = p_ok[:, None] & (c < N_OUT)[None, :]
        base = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (base.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------- launch configuration


def supports(device: torch.device) -> bool:
    """CUDA with tensor cores for 16-bit tl.dot (compute capability 8.0 or later), and Triton."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def _pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def shrink_config(t_cap: int, num_slots: int, n: int, k: int) -> ShrinkConfig:
    """Decode (t_cap <= DECODE_MAX_TOKENS): 16 tokens x 16 rows of A x 128 K per step, the
    smallest tiles (reading A is all the work, and small tiles give the most programs), K split
    as finely as allowed (a power of two <= MAX_SPLIT_K, at least two steps a slice): a decode
    shrink is latency-bound, and on the H200 the finest split was the fastest for every Llama-3-8B
    projection at 1-64 tokens over 1-16 adapters (qkv at 16 tokens over 4: 9.4 -> 6.2 us).
    Prefill: 64 x up to 64 x 64, split while the tiles of a step that uses every slot (at least one
    tile per slot, or per BM tokens) times the split stay within two programs per SM."""
    decode = t_cap <= DECODE_MAX_TOKENS
    if decode:
        bm, bn, bk = 16, 16, 128
    else:
        bm, bn, bk = 64, min(64, max(16, _pow2(n))), 64
    bk = min(bk, max(16, _pow2(k)))
    tiles = max(min(num_slots, t_cap), -(-t_cap // bm)) * -(-n // bn)
    steps = -(-k // bk)
    split = 1
    while split * 2 <= MAX_SPLIT_K and steps >= split * 4 and (decode or tiles * split * 2 <= 2 * NUM_SMS_GUESS):
        split *= 2
    return ShrinkConfig(bm, bn, bk, split)


def expand_config(t_cap: int, o: int, r: int) -> ExpandConfig:
    """Decode: 16 tokens x 64 columns (128 with 8 warps from O > 8192), the fastest of the H200
    sweep on Llama-3-8B projections (o at 64 tokens over 4 adapters: 32 columns 4.4 us, 64 2.8;
    gate|up: 64 columns 12.0, 128 9.8); prefill: 64 x 64. The rank in chunks of 32 where it divides
    R (rank 16 of R = 64 reads half of B's row), else 16 (the smallest tl.dot step)."""
    bk = 32 if r % 32 == 0 else 16
    if t_cap <= DECODE_MAX_TOKENS:
        return ExpandConfig(16, 64, bk) if o <= 8192 else ExpandConfig(16, 128, bk, num_warps=8)
    return ExpandConfig(64, 64, bk)


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
    tiles = (-(-mapping.capacity // cfg.block_m) + s, -(-n // cfg.block_n))
    if tiles[0] * tiles[1] > split_k.COUNTERS:
        split, per_split = 1, steps  # one count per tile
    plane = h.shape[0] * n
    partials = torch.empty(split, plane if split > 1 else 1, dtype=torch.float32, device=x.device)
    counters = split_k.counters(x.device) if split > 1 else partials
    _shrink_kernel[(*tiles, split)](
        x, a, h, partials, counters, mapping.sorted_token_ids, mapping.slot_starts, mapping.slot_ranks,
        s, n, k, n // n_slices, x.stride(0), h.stride(0), per_split, plane,
        BM=cfg.block_m, BN=cfg.block_n, BK=bk, SP=max(2, _pow2(s)), SPLIT=split, EVEN_K=k % bk == 0,
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
    grid = (-(-mapping.capacity // cfg.block_m) + s, -(-o // cfg.block_n))
    _expand_kernel[grid](
        h, b, y, mapping.sorted_token_ids, mapping.slot_starts, mapping.slot_ranks, s, o, r, h.stride(0), y.stride(0),
        SLICES=slices, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, SP=max(2, _pow2(s)),
        EVEN_R=r % cfg.block_k == 0, PRECISION="tf32" if y.is_cuda and y.dtype != torch.float32 else "ieee",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(y),
    )  # fmt: skip
