"""Triton kernel of the dense tail (sample/fast/dense_tail.py): static temperature, top-p, min-p
and the race for whole rows in one launch, one program per row, with the raw logsumexp and the
sampled token's logprob.

Data flow: the sampler's logits [R, V] (and their pre-chained float32 copy when a pre-chain
applies) -> `dense_tail` -> sampled ids, logprobs, logsumexp. The row is read twice, three times
when top-p cuts above the min-p threshold (`_dense_tail_kernel`); every pass keeps per-lane
partials and has the next four chunks in flight while it works on one. What made it fast on the
H200 (128k vocabulary, benchmarks/README.md): x / T by a product and an fma correction
(`kernels.divide`) instead of IEEE division, the max of x / T as max(x) / T, the normaliser's terms
as one fma and one flushing exp2, the histogram and the race only in blocks holding a min-p
survivor, the race in the second pass, so that a row where min-p decides is read twice, and four
chunks in flight (GPU time at batch 1 / 64 / 256: 0.18 / 0.22 / 0.45 ms two stops ago, the kernel
now 0.053 / 0.134 / 0.203). Float keys, the hash and the race step are kernels.py's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from paphos.sample.fast import kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch formulations are used.
    triton = None

# Top-p histogram: NBINS bins of 1 nat of x / T below floor(row max), the last one open below.
NBINS = 16
TAIL_CAP = 2048  # bracket tokens sorted in registers to place the top-p boundary exactly
TAIL_PIVOTS = 16
TAIL_FIRST_STEP = 1.0  # nats between the fallback's first edges (while its bracket is open below)


class TailLaunch(NamedTuple):
    """A launch shape of the dense tail kernel: lanes per quarter chunk, warps, chunks in flight."""

    block: int
    warps: int
    depth: int


# One large program per row while rows fit the H200's 132 processors, two smaller ones per
# processor beyond; four chunks in flight (benchmarks/bench_sampler.py --tail-configs, 128k
# vocabulary, rows 1 / 64 / 256: 0.053 / 0.134 / 0.203 ms against 0.065 / 0.147 / 0.263 with one).
TAIL_LAUNCH_FEW, TAIL_LAUNCH_MANY, TAIL_MANY_ROWS = TailLaunch(512, 16, 4), TailLaunch(256, 8, 4), 132
TAIL_SBLOCK = 64  # columns per step of the rare paths (narrowing, ties): [SBLOCK, K] temporaries


if triton is not None:
    LOG2E = tl.constexpr(1.4426950408889634)
    CHUNK = tl.constexpr(4)  # blocks per chunk: a pass's unit of loads and of its any-tests

    @triton.jit
    def _scaled_row(row_ptr, cols, n_cols, temp, rtemp):
        """x / T of a block, rounded as torch's division (rtemp = 1 / T); -inf past the row."""
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        return kernels.divide(x, temp, rtemp)

    @triton.jit
    def _narrow_bracket(row_ptr, n_cols, temp, rtemp, m, target, a_hi, lo, hi, n_b, CAP: tl.constexpr,
                        K: tl.constexpr, SBLOCK: tl.constexpr, FIRST_STEP: tl.constexpr):  # fmt: skip
        """While the bracket (lo, hi] of keys holds more than CAP tokens (a flat stretch of the
        distribution): K edges inside it, the mass and count above each, keep the sub-bracket
        where the mass from the top crosses target -> (lo, hi, mass above hi, tokens in it)."""
        neg_key = kernels.float_key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
        jj = tl.arange(0, K)
        while (n_b > CAP) & (hi - lo > 1):
            step_k = tl.maximum((hi - lo) // (K + 1), 1)
            by_key = hi - (jj + 1).to(tl.int64) * step_k
            # While lo is -inf, edges every FIRST_STEP nats below hi's value.
            by_value = kernels.float_key(kernels.key_float(hi.to(tl.int32)) - (jj + 1).to(tl.float32) * FIRST_STEP).to(tl.int64)
            edges = tl.where(lo == neg_key, by_value, by_key)
            edges = tl.maximum(tl.minimum(edges, hi - (jj + 1).to(tl.int64)), lo)
            mass = tl.zeros([K], tl.float32)
            cnt = tl.zeros([K], tl.int64)
            nb = tl.zeros([], tl.int64)
            for start in range(0, n_cols, SBLOCK):  # [SBLOCK, K] temporaries
                cols = start + tl.arange(0, SBLOCK)
                xs = _scaled_row(row_ptr, cols, n_cols, temp, rtemp)
                kx = kernels.float_key(xs).to(tl.int64)
                inb = (kx > lo) & (kx <= hi) & (cols < n_cols)
                if tl.max(inb.to(tl.int32), axis=0) > 0:
                    e = tl.exp(xs - m)
                    above = inb[:, None] & (kx[:, None] > edges[None, :])
                    mass += tl.sum(tl.where(above, e[:, None], 0.0), axis=0)
                    cnt += tl.sum(above.to(tl.int64), axis=0)
                    nb += tl.sum(inb.to(tl.int64), axis=0)
            a = a_hi + mass
            nlt = tl.sum((a < target).to(tl.int32), axis=0)
            sel_hi = jj == nlt - 1
            sel_lo = jj == nlt
            cnt_hi = tl.where(nlt > 0, tl.sum(tl.where(sel_hi, cnt, 0), axis=0), 0)
            cnt_lo = tl.where(nlt < K, tl.sum(tl.where(sel_lo, cnt, 0), axis=0), nb)
            new_hi = tl.where(nlt > 0, tl.sum(tl.where(sel_hi, edges, 0), axis=0), hi)
            a_hi = tl.where(nlt > 0, tl.sum(tl.where(sel_hi, a, 0.0), axis=0), a_hi)
            lo = tl.where(nlt < K, tl.sum(tl.where(sel_lo, edges, 0), axis=0), lo)
            hi = new_hi
            n_b = cnt_lo - cnt_hi
        return lo, hi, a_hi, n_b

    @triton.jit
    def _sorted_bracket(buf, n_b, m, a_hi, target, CAP: tl.constexpr):
        """The bracket's n_b <= CAP gathered tokens sorted by (value desc, id asc) and walked from
        the mass above it -> (keys, ids, tokens top-p keeps of them, last kept key, its id)."""
        slots = tl.arange(0, CAP)
        valid = slots < n_b
        packed = tl.sort(tl.load(buf + slots, mask=valid, other=0x7FFFFFFFFFFFFFFF), 0)
        kb = 0x7FFFFFFF - (packed >> 31)
        ids = packed & 0x7FFFFFFF
        e = tl.where(valid, tl.exp(kernels.key_float(kb.to(tl.int32)) - m), 0.0)
        before = a_hi + tl.cumsum(e, axis=0) - e
        n_kept = tl.maximum(tl.sum((valid & (before < target)).to(tl.int32), axis=0), 1)
        last = slots == n_kept - 1
        return kb, ids, n_kept, tl.sum(tl.where(last, kb, 0), axis=0), tl.sum(tl.where(last, ids, 0), axis=0)

    @triton.jit
    def _pack_bracket(kx, cols):
        """Sort keys of bracket tokens: ascending = value descending, then id ascending."""
        return ((0x7FFFFFFF - kx) << 31) | cols.to(tl.int64)

    @triton.jit
    def _load_chunk(row_ptr, start, n_cols, BLOCK: tl.constexpr):
        """A chunk: block i (i < CHUNK) holds columns start + i * BLOCK + lane, a tuple of [BLOCK]
        float32 tensors, -inf past the row: coalesced loads, no layout change between them."""
        cols = start + tl.arange(0, BLOCK)
        blocks = ()
        for i in tl.static_range(CHUNK):
            at = cols + i * BLOCK
            blocks = blocks + (tl.load(row_ptr + at, mask=at < n_cols, other=float("-inf")).to(tl.float32),)
        return blocks

    @triton.jit
    def _load_chunks(work, raw, start, n_cols, BLOCK: tl.constexpr, SAME: tl.constexpr):
        """`_load_chunk` of the work row and of the raw row (the same blocks when SAME)."""
        x = _load_chunk(work, start, n_cols, BLOCK)
        if SAME:
            return x, x
        return x, _load_chunk(raw, start, n_cols, BLOCK)

    @triton.jit
    def _ring_start(work, raw, n_cols, BLOCK: tl.constexpr, SAME: tl.constexpr, DEPTH: tl.constexpr):
        """The first DEPTH chunks' loads, in flight together: a pass loads chunk i + DEPTH before
        it works on chunk i, so DEPTH chunks' bytes are always on their way (a pass costs about
        one memory latency per DEPTH chunks; one chunk in flight left it latency-bound)."""
        ring = ()
        for i in tl.static_range(DEPTH):
            ring = ring + (_load_chunks(work, raw, i * CHUNK * BLOCK, n_cols, BLOCK, SAME),)
        return ring

    @triton.jit
    def _ring_step(ring, work, raw, start, n_cols, BLOCK: tl.constexpr, SAME: tl.constexpr, DEPTH: tl.constexpr):
        """-> (the chunk at start, the ring with the chunk DEPTH further on in flight)."""
        return ring[0], ring[1:] + (_load_chunks(work, raw, start + DEPTH * CHUNK * BLOCK, n_cols, BLOCK, SAME),)

    @triton.jit
    def _max_step(x, r, cols, lane_m, lane_arg, lane_rm, SAME: tl.constexpr):
        """Per lane: the max of x with its first column, and the raw max (x's when SAME)."""
        lane_arg = tl.where(x > lane_m, cols, lane_arg)
        if not SAME:
            lane_rm = tl.maximum(lane_rm, r)
        return tl.maximum(lane_m, x), lane_arg, lane_rm

    @triton.jit
    def _mass_step(x, r, c_x, c_m, c_r, lane_z, lane_rz, ASM: tl.constexpr):
        """Per lane: the sums of exp(x / T - max) as 2^(x (log2 e / T) - max log2 e) and of
        exp(raw - raw max) (c_x, c_m, c_r: the constants): one fma and one exp2 each. Within a few
        ulps of the exact terms, so Z moves by rounding only, as under another summation order;
        every decision on a token (bins, thresholds, the race) uses the exact quotient."""
        return lane_z + kernels.exp2_flush(x * c_x - c_m, ASM), lane_rz + kernels.exp2_flush(r * LOG2E - c_r, ASM)

    @triton.jit
    def _bin_step(xs, e, floor_v, top, jf, lane_bins, BINS: tl.constexpr):
        """Per lane: the mass of the v >= floor_v per 1-nat bin below top ([BINS, BLOCK]: the
        lanes' layout, no cross-thread traffic)."""
        depth = tl.minimum(top - tl.floor(xs), BINS - 1.0)
        return lane_bins + tl.where((jf[:, None] == depth[None, :]) & (xs >= floor_v)[None, :], e[None, :], 0.0)

    @triton.jit
    def _survivor_block(x, cols, temp, rtemp, safe, threshold, top, jf, p_on, step, lane_bins, best, best_id,
                        BINS: tl.constexpr):  # fmt: skip
        """A block's min-p survivors (v = x / T >= threshold): their mass per bin when top-p is on,
        and the race. A block without one costs its quotients and one any-test."""
        xs = kernels.divide(x, temp, rtemp)
        keep = (xs >= threshold) & (xs > float("-inf"))
        if tl.max(keep.to(tl.int32), axis=0) > 0:
            if p_on:
                lane_bins = _bin_step(xs, tl.exp(xs - safe), threshold, top, jf, lane_bins, BINS)
            best, best_id = kernels.race_merge(xs, keep, cols, step, best, best_id)
        return lane_bins, best, best_id

    @triton.jit
    def _race_keys(x, cols, n_cols, temp, rtemp, threshold, gather, lo, hi):
        """A block's v = x / T, its keys, the survivors above the bracket (key > hi, v >=
        threshold) and, when `gather`, its bracket tokens (lo, hi]."""
        xs = kernels.divide(x, temp, rtemp)
        kx = kernels.float_key(xs).to(tl.int64)
        return xs, kx, (kx > hi) & (xs >= threshold), tl.where(gather, (kx > lo) & (kx <= hi) & (cols < n_cols), False)

    @triton.jit
    def _race_gather_step(xs, kx, keep, inb, cols, step, best, best_id, buf, n_b, CAP: tl.constexpr):
        """The race over a block's kept tokens; its bracket tokens appended to buf."""
        best, best_id = kernels.race_block(xs, keep, cols, step, best, best_id)
        cnt = tl.sum(inb.to(tl.int64), axis=0)
        if cnt > 0:
            pos = n_b + tl.cumsum(inb.to(tl.int64), axis=0) - 1
            tl.store(buf + pos, _pack_bracket(kx, cols), mask=inb & (pos < CAP))
            n_b += cnt
        return best, best_id, n_b

    @triton.jit
    def _dense_tail_kernel(
        raw_ptr, work_ptr, stride_raw, stride_work, n_cols, col_ptr, col_stride, seed_ptr, pos_ptr, greedy_ptr,
        buf_ptr, tok_ptr, id_ptr, flt_ptr, n_rows,
        T_COL: tl.constexpr, P_COL: tl.constexpr, MP_COL: tl.constexpr, SAME: tl.constexpr,
        NUM_DRAWS: tl.constexpr, BLOCK: tl.constexpr, DEPTH: tl.constexpr, BINS: tl.constexpr, CAP: tl.constexpr,
        K: tl.constexpr, SBLOCK: tl.constexpr, FIRST_STEP: tl.constexpr, ASM: tl.constexpr,
    ):  # fmt: skip
        """One program per row, two or three reads of it: (1) the max of x with its first column
        and the raw max, max(v) = max(x) / T for v = x / T; (2) the raw logsumexp, the normaliser
        of v and, of the min-p survivors v >= threshold (all v with min-p off), the mass per
        1-nat bin below floor(max) and the race: top-p and min-p each keep a prefix by value, so
        when the survivors' mass stays below p * total, top-p keeps all of them and this race is
        the draw; (3) otherwise the bin where the mass crosses p * total brackets the top-p
        boundary: the race over the tokens above the bracket that pass min-p, and the bracket's
        tokens into buf when min-p leaves some of them; then the bracket sorted, the exact last
        kept token and the race over the kept bracket tokens. A bracket of more than CAP tokens
        is narrowed first and the race rerun over the row with the exact boundary."""
        row = tl.program_id(0).to(tl.int64)
        work = work_ptr + row * stride_work
        raw = raw_ptr + row * stride_raw
        buf = buf_ptr + row * CAP
        prm = col_ptr + row * col_stride
        temp = tl.load(prm + T_COL)
        rtemp = tl.math.div_rn(1.0, temp)
        top_p = tl.load(prm + P_COL)
        min_p = tl.load(prm + MP_COL)
        neg = float("-inf")
        offs = tl.arange(0, BLOCK)
        jf = tl.arange(0, BINS).to(tl.float32)
        # Every pass keeps per-lane partials (no cross-thread reduction per chunk) and loads the
        # chunk DEPTH chunks of CHUNK * BLOCK ahead before working on this one (`_ring_step`). Lane j
        # of a chunk at `start` holds columns start + i * BLOCK + j, i < CHUNK.
        # (1) maxima and the first argmax of x (greedy rows have T = 1: x's argmax is v's)
        lane_rm = tl.full([BLOCK], neg, tl.float32)
        lane_m = tl.full([BLOCK], neg, tl.float32)
        lane_arg = tl.zeros([BLOCK], tl.int32)
        ring = _ring_start(work, raw, n_cols, BLOCK, SAME, DEPTH)
        for start in range(0, n_cols, CHUNK * BLOCK):
            chunk, ring = _ring_step(ring, work, raw, start, n_cols, BLOCK, SAME, DEPTH)
            x, r = chunk  # (triton 3.6 takes no nested unpacking)
            for i in tl.static_range(CHUNK):
                lane_m, lane_arg, lane_rm = _max_step(x[i], r[i], start + offs + i * BLOCK, lane_m, lane_arg, lane_rm,
                                                      SAME)  # fmt: skip
        mx = tl.max(lane_m, axis=0)
        arg = tl.min(tl.where(lane_m == mx, lane_arg, 0x7FFFFFFF), axis=0).to(tl.int64)
        arg = tl.where(mx == neg, 0, arg)
        # Division by T > 0 rounded to nearest is monotone: the max of x / T is max(x) / T.
        m = kernels.divide(mx, temp, rtemp)
        rm = mx if SAME else tl.max(lane_rm, axis=0)
        safe = tl.where(m == neg, 0.0, m)
        rsafe = tl.where(rm == neg, 0.0, rm)
        top = tl.floor(safe)
        sampled = tl.load(greedy_ptr + row) == 0
        p_on = sampled & (top_p < 1.0) & (m > neg)
        threshold = m + tl.log(min_p)
        # Top-p and min-p both keep a prefix of the tokens by value, so the survivors are the
        # shorter prefix: only tokens at or above the min-p threshold are binned. A chunk without
        # one skips the bins (with min-p on, nearly all of them).
        floor_v = tl.where(p_on, threshold, float("inf"))
        # The race over min-p's survivors (v >= threshold, all finite v when min-p is off) runs
        # in this pass too wherever they may be the answer: top-p off, or min-p on (top-p may then
        # cut below the threshold); such rows skip pass 3 when top-p does not cut above it.
        race_floor = tl.where(sampled & (~p_on | (threshold > neg)), threshold, float("inf"))
        # The chunk test runs on x against the floor times T, lowered by more than the quotient's
        # and the product's rounding.
        hit_x = (race_floor - (tl.abs(race_floor) * 0.000001 + 1e-30)) * temp
        c_x, c_m, c_r = rtemp * LOG2E, safe * LOG2E, rsafe * LOG2E
        seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
        step = kernels.splitmix(kernels.splitmix(seed) + tl.load(pos_ptr + row).to(tl.uint64, bitcast=True) * NUM_DRAWS)
        best = tl.full([], neg, tl.float32)
        best_id = tl.zeros([], tl.int64)  # no survivor at all: id 0, as the race
        # (2) normalisers and, of v >= floor_v, the mass per 1-nat bin below floor(max), the last
        # bin open below
        lane_z = tl.zeros([BLOCK], tl.float32)
        lane_rz = tl.zeros([BLOCK], tl.float32)
        lane_bins = tl.zeros([BINS, BLOCK], tl.float32)
        ring = _ring_start(work, raw, n_cols, BLOCK, SAME, DEPTH)
        for start in range(0, n_cols, CHUNK * BLOCK):
            chunk, ring = _ring_step(ring, work, raw, start, n_cols, BLOCK, SAME, DEPTH)
            x, r = chunk  # (triton 3.6 takes no nested unpacking)
            for i in tl.static_range(CHUNK):
                lane_z, lane_rz = _mass_step(x[i], r[i], c_x, c_m, c_r, lane_z, lane_rz, ASM)
            if floor_v == neg:  # top-p with min-p off: every chunk binned, no race here
                for i in tl.static_range(CHUNK):
                    xs = kernels.divide(x[i], temp, rtemp)
                    lane_bins = _bin_step(xs, tl.exp(xs - safe), floor_v, top, jf, lane_bins, BINS)
            elif race_floor == neg:  # neither top-p nor min-p: the race over every finite v
                for i in tl.static_range(CHUNK):
                    xs = kernels.divide(x[i], temp, rtemp)
                    best, best_id = kernels.race_block(xs, xs > neg, start + offs + i * BLOCK, step, best, best_id)
            elif race_floor < float("inf"):  # min-p on: the blocks holding a token at or above it
                hit = x[0] >= hit_x
                for i in tl.static_range(1, CHUNK):
                    hit = hit | (x[i] >= hit_x)
                if tl.max(hit.to(tl.int32), axis=0) > 0:
                    for i in tl.static_range(CHUNK):
                        lane_bins, best, best_id = _survivor_block(x[i], start + offs + i * BLOCK, temp, rtemp, safe,
                                                                   threshold, top, jf, p_on, step, lane_bins, best,
                                                                   best_id, BINS)  # fmt: skip
        z = tl.sum(lane_z, axis=0)
        rz = tl.sum(lane_rz, axis=0)
        bins = tl.sum(lane_bins, axis=1)
        lse = rm + tl.log(rz)
        neg_key = kernels.float_key(tl.full([], neg, tl.float32)).to(tl.int64)
        tok = arg  # greedy rows (temperature 1, no truncation) take the first argmax
        key_last = neg_key  # (key_last, id_last) of top-p's last kept token; (-inf, -1): all kept
        id_last = tl.full([], -1, tl.int64)
        if sampled:
            target = top_p * z
            # min-p decides alone when the mass at or above its threshold stays below p * Z: the
            # race of pass 2 stands
            p_on = p_on & ((threshold == neg) | (tl.sum(bins, axis=0) >= target))
            if p_on:
                before = tl.cumsum(bins, axis=0) - bins
                g = tl.maximum(tl.sum((before < target).to(tl.int32), axis=0) - 1, 0).to(tl.float32)
                # the bracket (lo, hi] in keys: bin g holds v in [top - g, top - g + 1), the last
                # bin everything finite below, neither anything under the threshold; a_hi the mass
                # above it (bins above the one crossing p * Z lie wholly above the threshold)
                a_hi = tl.sum(tl.where(jf == g, before, 0.0), axis=0)
                lo = tl.where(g == BINS - 1, neg_key, kernels.float_key(top - g).to(tl.int64) - 1)
                lo = tl.maximum(lo, kernels.float_key(threshold).to(tl.int64) - 1)
                hi = kernels.float_key(top - g + 1.0).to(tl.int64) - 1
                gather = threshold < top - g + 1.0  # min-p may keep some bracket tokens
                key_last, id_last = hi, n_cols.to(tl.int64)  # min-p alone decides in the bracket
                best = tl.full([], neg, tl.float32)
                best_id = tl.zeros([], tl.int64)
                n_b = tl.zeros([], tl.int64)
                # (3) the race over the survivors above the bracket (key > hi); the bracket's tokens
                # gathered. One any-test per chunk skips chunks with neither (nearly all of them).
                work_ring = _ring_start(work, work, n_cols, BLOCK, True, DEPTH)
                for start in range(0, n_cols, CHUNK * BLOCK):
                    chunk, work_ring = _ring_step(work_ring, work, work, start, n_cols, BLOCK, True, DEPTH)
                    x = chunk[0]
                    blocks = ()
                    for i in tl.static_range(CHUNK):
                        blocks = blocks + (_race_keys(x[i], start + offs + i * BLOCK, n_cols, temp, rtemp, threshold,
                                                      gather, lo, hi),)  # fmt: skip
                    hit = blocks[0][2] | blocks[0][3]
                    for i in tl.static_range(1, CHUNK):
                        hit = hit | blocks[i][2] | blocks[i][3]
                    if tl.max(hit.to(tl.int32), axis=0) > 0:
                        for i in tl.static_range(CHUNK):
                            xs, kx, keep, inb = blocks[i]
                            best, best_id, n_b = _race_gather_step(xs, kx, keep, inb, start + offs + i * BLOCK, step,
                                                                   best, best_id, buf, n_b, CAP)  # fmt: skip
                exact = gather & (n_b > CAP)
                if gather:
                    if n_b <= CAP:
                        kb, ids, n_kept, key_last, id_last = _sorted_bracket(buf, n_b, m, a_hi, target, CAP)
                        vals = kernels.key_float(kb.to(tl.int32))
                        keep = (tl.arange(0, CAP) < n_kept) & (vals >= threshold)
                        best, best_id = kernels.race_block(vals, keep, ids, step, best, best_id)
                    else:
                        lo, hi, a_hi, n_b = _narrow_bracket(work, n_cols, temp, rtemp, m, target, a_hi, lo, hi, n_b, CAP, K,
                                                            SBLOCK, FIRST_STEP)  # fmt: skip
                        if n_b <= CAP:
                            off = tl.zeros([], tl.int64)
                            for start in range(0, n_cols, SBLOCK):
                                cols = start + tl.arange(0, SBLOCK)
                                kx = kernels.float_key(_scaled_row(work, cols, n_cols, temp, rtemp)).to(tl.int64)
                                inb = (kx > lo) & (kx <= hi) & (cols < n_cols)
                                pos = off + tl.cumsum(inb.to(tl.int64), axis=0) - 1
                                tl.store(buf + pos, _pack_bracket(kx, cols), mask=inb)
                                off += tl.sum(inb.to(tl.int64), axis=0)
                            _, _, _, key_last, id_last = _sorted_bracket(buf, n_b, m, a_hi, target, CAP)
                        else:
                            # More than CAP tokens on one key (hi): keep the first n_t of them by id.
                            ev = tl.exp(kernels.key_float(hi.to(tl.int32)) - m)
                            n_t = tl.where(ev > 0, tl.ceil((target - a_hi) / ev), n_b.to(tl.float32))
                            n_t = tl.minimum(tl.maximum(n_t, 1.0), n_b.to(tl.float32)).to(tl.int64)
                            off = tl.zeros([], tl.int64)
                            found = tl.zeros([], tl.int64)
                            for start in range(0, n_cols, SBLOCK):
                                cols = start + tl.arange(0, SBLOCK)
                                tie = (kernels.float_key(_scaled_row(work, cols, n_cols, temp, rtemp)).to(tl.int64) == hi) & (cols < n_cols)
                                c = off + tl.cumsum(tie.to(tl.int64), axis=0)
                                found += tl.sum(tl.where(tie & (c == n_t), cols.to(tl.int64), 0), axis=0)
                                off += tl.sum(tie.to(tl.int64), axis=0)
                            key_last, id_last = hi, found
                if exact:
                    best = tl.full([], neg, tl.float32)
                    best_id = tl.zeros([], tl.int64)
                    for start in range(0, n_cols, BLOCK):
                        cols = start + offs
                        xs = _scaled_row(work, cols, n_cols, temp, rtemp)
                        kx = kernels.float_key(xs).to(tl.int64)
                        kept = (kx > key_last) | ((kx == key_last) & (cols.to(tl.int64) <= id_last))
                        best, best_id = kernels.race_block(xs, kept & (xs >= threshold) & (xs > neg), cols, step, best,
                                                    best_id)  # fmt: skip
            tok = best_id
        tl.store(tok_ptr + row, tok)
        tl.store(id_ptr + row, id_last)
        tl.store(flt_ptr + row, tl.load(raw + tok).to(tl.float32) - lse)
        tl.store(flt_ptr + n_rows + row, lse)
        tl.store(flt_ptr + 2 * n_rows + row, kernels.key_float(key_last.to(tl.int32)))


class TailResult(NamedTuple):
    token: torch.Tensor  # int64 [R]: the race winner (greedy rows: the first argmax)
    logprob: torch.Tensor  # float32 [R]: the token's raw logit - lse
    lse: torch.Tensor  # float32 [R]: logsumexp of the raw logits
    last_value: torch.Tensor  # float32 [R]: top-p's last kept value of x / T (-inf: all kept) ...
    last_id: torch.Tensor  # int64 [R]: ... and its id: tokens after it on that value are cut


def dense_tail(
    raw: torch.Tensor, work: torch.Tensor, columns: torch.Tensor, column_index: tuple[int, int, int],
    seeds: torch.Tensor, positions: torch.Tensor, greedy: torch.Tensor, num_draws: int,
    cap: int | None = None, pivots: int | None = None, launch: TailLaunch | None = None,
) -> TailResult:
    """Per row of work (the raw logits, or their pre-chained float32 copy): x / T -> top-p (exact,
    sort-free over the vocabulary) -> min-p -> race keyed by (seed, position), greedy rows their
    argmax; with the raw logits' logsumexp and the token's logprob. One launch, one program per
    row (the `_dense_tail_kernel` docstring); T, p and min_p are `columns` [R, C] at the indices
    `column_index`. When min-p alone decides inside the top-p bracket, (last_value, last_id) is
    the bracket's top value with every id (the survivors are the same)."""
    cap = cap or TAIL_CAP
    raw, work = kernels.contiguous_rows(raw), kernels.contiguous_rows(work)
    rows, n = work.shape
    tokens = kernels.empty_on(rows, dtype=torch.int64, like=work)
    last_ids = kernels.empty_on(rows, dtype=torch.int64, like=work)
    floats = kernels.empty_on(3, rows, dtype=torch.float32, like=work)
    if rows:
        t_col, p_col, mp_col = column_index
        buf = kernels.empty_on(rows, cap, dtype=torch.int64, like=work)
        launch = launch or (TAIL_LAUNCH_MANY if rows > TAIL_MANY_ROWS else TAIL_LAUNCH_FEW)
        _dense_tail_kernel[(rows,)](
            raw, work, raw.stride(0), work.stride(0), n, columns, columns.stride(0), seeds, positions, greedy, buf,
            tokens, last_ids, floats, rows, T_COL=t_col, P_COL=p_col, MP_COL=mp_col, SAME=raw is work,
            NUM_DRAWS=num_draws, BLOCK=launch.block, DEPTH=launch.depth, BINS=NBINS, CAP=cap, K=pivots or TAIL_PIVOTS,
            SBLOCK=min(TAIL_SBLOCK, triton.next_power_of_2(max(n, 16))), FIRST_STEP=TAIL_FIRST_STEP,
            ASM=work.is_cuda, num_warps=launch.warps,
        )  # fmt: skip
    return TailResult(tokens, floats[0], floats[1], floats[2], last_ids)
