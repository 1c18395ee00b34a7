"""Triton kernel of the dense tail (sample/fast/dense_tail.py): static temperature, top-p, min-p
and the race for whole rows in one launch, one program per row, with the raw logsumexp and the
sampled token's logprob.

Data flow: the sampler's logits [R, V] (and their pre-chained float32 copy when a pre-chain
applies) -> `dense_tail` -> sampled ids, logprobs, logsumexp. The row is read three times
(`_dense_tail_kernel`); every pass keeps per-lane partials and loads the next chunk before working
on the current one, so a lone row (batch 1) is not bound by one load's latency per block: on the
H200 a 128k-vocabulary step is 0.18 ms of GPU time at batch 1 and 0.45 ms at batch 256
(benchmarks/README.md), where the three IEEE divisions per logit and the 16-bin histogram, not
the reads, bound it. Float keys, the hash and the race step are kernels.py's.
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


if triton is not None:

    @triton.jit
    def _scaled_row(row_ptr, cols, n_cols, temp):
        """x / T of a block, rounded as torch's division; -inf past the row."""
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        return tl.math.div_rn(x, temp)

    @triton.jit
    def _narrow_bracket(row_ptr, n_cols, temp, m, target, a_hi, lo, hi, n_b, CAP: tl.constexpr,
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
                xs = _scaled_row(row_ptr, cols, n_cols, temp)
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
        """Columns start + 4 i + (0, 1, 2, 3) for lanes i < BLOCK as four [BLOCK] float32 tensors,
        -inf past the row (one 16-byte load per lane)."""
        i = 4 * tl.arange(0, BLOCK)[:, None, None] + 2 * tl.arange(0, 2)[None, :, None] + tl.arange(0, 2)[None, None, :]
        cols = start + i
        v = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        even, odd = tl.split(v)  # [BLOCK, 2]: columns 4 i + (0, 2) and 4 i + (1, 3)
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        return c0, c1, c2, c3

    @triton.jit
    def _load_chunks(work, raw, start, n_cols, BLOCK: tl.constexpr, SAME: tl.constexpr):
        """`_load_chunk` of the work row and of the raw row (the same tensors when SAME)."""
        x0, x1, x2, x3 = _load_chunk(work, start, n_cols, BLOCK)
        if SAME:
            return x0, x1, x2, x3, x0, x1, x2, x3
        r0, r1, r2, r3 = _load_chunk(raw, start, n_cols, BLOCK)
        return x0, x1, x2, x3, r0, r1, r2, r3

    @triton.jit
    def _max_step(x, r, cols, temp, lane_m, lane_arg, lane_rm):
        """Per lane: the max of v = x / T with its first column, and the raw max."""
        xs = tl.math.div_rn(x, temp)
        lane_arg = tl.where(xs > lane_m, cols, lane_arg)
        return tl.maximum(lane_m, xs), lane_arg, tl.maximum(lane_rm, r)

    @triton.jit
    def _mass_step(x, r, temp, safe, rsafe, top, jf, lane_z, lane_rz, lane_bins, BINS: tl.constexpr):
        """Per lane: the sums of exp(v - max) and exp(raw - raw max), and v's mass per bin."""
        xs = tl.math.div_rn(x, temp)
        e = tl.exp(xs - safe)
        depth = tl.minimum(top - tl.floor(xs), BINS - 1.0)
        lane_bins += tl.where(jf[:, None] == depth[None, :], e[None, :], 0.0)  # [BINS, BLOCK]: lanes' layout
        return lane_z + e, lane_rz + tl.exp(r - rsafe), lane_bins

    @triton.jit
    def _race_gather_step(x, cols, n_cols, temp, cut, threshold, step, best, best_id, gather, lo, hi, buf, n_b,
                          CAP: tl.constexpr):  # fmt: skip
        """The race over a block's survivors above the bracket (key > cut, v >= threshold) and,
        when `gather`, its bracket tokens (lo, hi] appended to buf."""
        xs = tl.math.div_rn(x, temp)
        kx = kernels.float_key(xs).to(tl.int64)
        best, best_id = kernels.race_block(xs, (kx > cut) & (xs >= threshold), cols, step, best, best_id)
        if gather:
            inb = (kx > lo) & (kx <= hi) & (cols < n_cols)
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
        NUM_DRAWS: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, CAP: tl.constexpr, K: tl.constexpr,
        SBLOCK: tl.constexpr, FIRST_STEP: tl.constexpr,
    ):  # fmt: skip
        """One program per row, three reads of it: (1) the raw max and, of v = x / T, the max and
        first argmax; (2) the raw logsumexp, the normaliser of v and its mass per 1-nat bin below
        floor(max): the bin where the mass from the top crosses p * total brackets the top-p
        boundary; (3) the race over the tokens above the bracket that pass min-p, and the
        bracket's tokens into buf when min-p leaves some of them; then the bracket sorted, the
        exact last kept token and the race over the kept bracket tokens. A bracket of more than
        CAP tokens is narrowed first and the race rerun over the row with the exact boundary."""
        row = tl.program_id(0).to(tl.int64)
        work = work_ptr + row * stride_work
        raw = raw_ptr + row * stride_raw
        buf = buf_ptr + row * CAP
        prm = col_ptr + row * col_stride
        temp = tl.load(prm + T_COL)
        top_p = tl.load(prm + P_COL)
        min_p = tl.load(prm + MP_COL)
        neg = float("-inf")
        offs = tl.arange(0, BLOCK)
        jf = tl.arange(0, BINS).to(tl.float32)
        # Every pass keeps per-lane partials (no cross-thread reduction per chunk) and loads the
        # next chunk of 4 * BLOCK before working on this one: a lone row is latency-bound
        # otherwise. Lane i of a chunk at `start` holds columns start + 4 i + (0, 1, 2, 3).
        lanes = 4 * tl.arange(0, BLOCK)
        # (1) maxima and the first argmax of v
        lane_rm = tl.full([BLOCK], neg, tl.float32)
        lane_m = tl.full([BLOCK], neg, tl.float32)
        lane_arg = tl.zeros([BLOCK], tl.int32)
        x0, x1, x2, x3, r0, r1, r2, r3 = _load_chunks(work, raw, 0, n_cols, BLOCK, SAME)
        for start in range(0, n_cols, 4 * BLOCK):
            n0, n1, n2, n3, s0, s1, s2, s3 = _load_chunks(work, raw, start + 4 * BLOCK, n_cols, BLOCK, SAME)
            lane_m, lane_arg, lane_rm = _max_step(x0, r0, start + lanes, temp, lane_m, lane_arg, lane_rm)
            lane_m, lane_arg, lane_rm = _max_step(x1, r1, start + lanes + 1, temp, lane_m, lane_arg, lane_rm)
            lane_m, lane_arg, lane_rm = _max_step(x2, r2, start + lanes + 2, temp, lane_m, lane_arg, lane_rm)
            lane_m, lane_arg, lane_rm = _max_step(x3, r3, start + lanes + 3, temp, lane_m, lane_arg, lane_rm)
            x0, x1, x2, x3, r0, r1, r2, r3 = n0, n1, n2, n3, s0, s1, s2, s3
        m = tl.max(lane_m, axis=0)
        arg = tl.min(tl.where(lane_m == m, lane_arg, 0x7FFFFFFF), axis=0).to(tl.int64)
        arg = tl.where(m == neg, 0, arg)
        rm = tl.max(lane_rm, axis=0)
        safe = tl.where(m == neg, 0.0, m)
        rsafe = tl.where(rm == neg, 0.0, rm)
        top = tl.floor(safe)
        # (2) normalisers and the mass per 1-nat bin of v below floor(max), the last bin open below
        lane_z = tl.zeros([BLOCK], tl.float32)
        lane_rz = tl.zeros([BLOCK], tl.float32)
        lane_bins = tl.zeros([BINS, BLOCK], tl.float32)
        x0, x1, x2, x3, r0, r1, r2, r3 = _load_chunks(work, raw, 0, n_cols, BLOCK, SAME)
        for start in range(0, n_cols, 4 * BLOCK):
            n0, n1, n2, n3, s0, s1, s2, s3 = _load_chunks(work, raw, start + 4 * BLOCK, n_cols, BLOCK, SAME)
            lane_z, lane_rz, lane_bins = _mass_step(x0, r0, temp, safe, rsafe, top, jf, lane_z, lane_rz, lane_bins,
                                                    BINS)  # fmt: skip
            lane_z, lane_rz, lane_bins = _mass_step(x1, r1, temp, safe, rsafe, top, jf, lane_z, lane_rz, lane_bins,
                                                    BINS)  # fmt: skip
            lane_z, lane_rz, lane_bins = _mass_step(x2, r2, temp, safe, rsafe, top, jf, lane_z, lane_rz, lane_bins,
                                                    BINS)  # fmt: skip
            lane_z, lane_rz, lane_bins = _mass_step(x3, r3, temp, safe, rsafe, top, jf, lane_z, lane_rz, lane_bins,
                                                    BINS)  # fmt: skip
            x0, x1, x2, x3, r0, r1, r2, r3 = n0, n1, n2, n3, s0, s1, s2, s3
        z = tl.sum(lane_z, axis=0)
        rz = tl.sum(lane_rz, axis=0)
        bins = tl.sum(lane_bins, axis=1)
        lse = rm + tl.log(rz)
        neg_key = kernels.float_key(tl.full([], neg, tl.float32)).to(tl.int64)
        tok = arg  # greedy rows (temperature 1, no truncation) take the first argmax
        key_last = neg_key  # (key_last, id_last) of top-p's last kept token; (-inf, -1): all kept
        id_last = tl.full([], -1, tl.int64)
        if tl.load(greedy_ptr + row) == 0:
            target = top_p * z
            before = tl.cumsum(bins, axis=0) - bins
            g = tl.maximum(tl.sum((before < target).to(tl.int32), axis=0) - 1, 0).to(tl.float32)
            # the bracket (lo, hi] in keys: bin g holds v in [top - g, top - g + 1), the last bin
            # everything finite below; a_hi the mass above it
            a_hi = tl.sum(tl.where(jf == g, before, 0.0), axis=0)
            lo = tl.where(g == BINS - 1, neg_key, kernels.float_key(top - g).to(tl.int64) - 1)
            hi = kernels.float_key(top - g + 1.0).to(tl.int64) - 1
            threshold = m + tl.log(min_p)
            p_on = (top_p < 1.0) & (m > neg)
            gather = p_on & (threshold < top - g + 1.0)  # min-p may keep some bracket tokens
            cut = tl.where(p_on, hi, neg_key)  # above it: kept by top-p
            if p_on:
                key_last, id_last = hi, n_cols.to(tl.int64)  # min-p alone decides in the bracket
            seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
            step = kernels.splitmix(kernels.splitmix(seed) + tl.load(pos_ptr + row).to(tl.uint64, bitcast=True) * NUM_DRAWS)
            best = tl.full([], neg, tl.float32)
            best_id = tl.zeros([], tl.int64)  # no survivor at all: id 0, as the race
            n_b = tl.zeros([], tl.int64)
            # (3) the race over the survivors above the bracket; the bracket's tokens gathered
            x0, x1, x2, x3 = _load_chunk(work, 0, n_cols, BLOCK)
            for start in range(0, n_cols, 4 * BLOCK):
                n0, n1, n2, n3 = _load_chunk(work, start + 4 * BLOCK, n_cols, BLOCK)
                best, best_id, n_b = _race_gather_step(x0, start + lanes, n_cols, temp, cut, threshold, step, best,
                                                       best_id, gather, lo, hi, buf, n_b, CAP)  # fmt: skip
                best, best_id, n_b = _race_gather_step(x1, start + lanes + 1, n_cols, temp, cut, threshold, step,
                                                       best, best_id, gather, lo, hi, buf, n_b, CAP)  # fmt: skip
                best, best_id, n_b = _race_gather_step(x2, start + lanes + 2, n_cols, temp, cut, threshold, step,
                                                       best, best_id, gather, lo, hi, buf, n_b, CAP)  # fmt: skip
                best, best_id, n_b = _race_gather_step(x3, start + lanes + 3, n_cols, temp, cut, threshold, step,
                                                       best, best_id, gather, lo, hi, buf, n_b, CAP)  # fmt: skip
                x0, x1, x2, x3 = n0, n1, n2, n3
            exact = gather & (n_b > CAP)
            if gather:
                if n_b <= CAP:
                    kb, ids, n_kept, key_last, id_last = _sorted_bracket(buf, n_b, m, a_hi, target, CAP)
                    vals = kernels.key_float(kb.to(tl.int32))
                    keep = (tl.arange(0, CAP) < n_kept) & (vals >= threshold)
                    best, best_id = kernels.race_block(vals, keep, ids, step, best, best_id)
                else:
                    lo, hi, a_hi, n_b = _narrow_bracket(work, n_cols, temp, m, target, a_hi, lo, hi, n_b, CAP, K,
                                                        SBLOCK, FIRST_STEP)  # fmt: skip
                    if n_b <= CAP:
                        off = tl.zeros([], tl.int64)
                        for start in range(0, n_cols, SBLOCK):
                            cols = start + tl.arange(0, SBLOCK)
                            kx = kernels.float_key(_scaled_row(work, cols, n_cols, temp)).to(tl.int64)
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
                            tie = (kernels.float_key(_scaled_row(work, cols, n_cols, temp)).to(tl.int64) == hi) & (cols < n_cols)
                            c = off + tl.cumsum(tie.to(tl.int64), axis=0)
                            found += tl.sum(tl.where(tie & (c == n_t), cols.to(tl.int64), 0), axis=0)
                            off += tl.sum(tie.to(tl.int64), axis=0)
                        key_last, id_last = hi, found
            if exact:
                best = tl.full([], neg, tl.float32)
                best_id = tl.zeros([], tl.int64)
                for start in range(0, n_cols, BLOCK):
                    cols = start + offs
                    xs = _scaled_row(work, cols, n_cols, temp)
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
    cap: int | None = None, pivots: int | None = None, block: int | None = None,
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
        _dense_tail_kernel[(rows,)](
            raw, work, raw.stride(0), work.stride(0), n, columns, columns.stride(0), seeds, positions, greedy, buf,
            tokens, last_ids, floats, rows, T_COL=t_col, P_COL=p_col, MP_COL=mp_col, SAME=raw is work,
            NUM_DRAWS=num_draws, BLOCK=block or 512, BINS=NBINS, CAP=cap, K=pivots or TAIL_PIVOTS,
            SBLOCK=min(512, triton.next_power_of_2(max(n, 16))), FIRST_STEP=TAIL_FIRST_STEP, num_warps=8,
        )  # fmt: skip
    return TailResult(tokens, floats[0], floats[1], floats[2], last_ids)
