"""Triton kernels of the sampler fast paths: row stats, the race, the fused chain; the float keys,
hash and race step that tail_kernels.py (the dense tail) shares.

Each kernel has a torch formulation next to its caller (rowstats.py, race.py, dense_tail.py,
chain.py): the torch code is the CPU path and the reference the tests compare against. Kernels run
on CUDA tensors; tests force them on CPU tensors under the Triton interpreter (`force_kernels`).

Layout: row stats and the race cut a row of V logits into NB tiles of BLOCK columns on a grid
(rows, NB), one tile per program, and write per-tile partials [R, NB] that a one-program-per-row
kernel combines in a fixed order: a batch-1 step of a 128k vocabulary spreads over ~128 SMs, and
every reduction has the same order whatever the batch, so a seeded row draws the same token alone
or among others. The fused chain (_chain_kernel) is one program per row: after top-k a row's
candidates fit in registers, and its stages, each a full reduction over them, run back to back
there without a launch or a memory round trip each. No launch depends on data known only on the
device (no host sync).

Float keys: float_key(x) maps float32 to int32 monotonically (x < y <=> float_key(x) <
float_key(y); -0.0 is canonicalised to +0.0 first so the two zeros tie as under float comparison).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from paphos.sample import order as st

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch formulations are used.
    triton = None

_FORCED = False


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve this tensor: a CUDA tensor, or any tensor while forced."""
    return triton is not None and (x.is_cuda or _FORCED)


@contextlib.contextmanager
def force_kernels(on: bool = True) -> Iterator[None]:
    """Tests: run the kernels on CPU tensors (needs TRITON_INTERPRET=1 at import of this module)."""
    global _FORCED
    previous, _FORCED = _FORCED, on
    try:
        yield
    finally:
        _FORCED = previous


# Fused chain (_chain_kernel, sample/fast/chain.py). Per-row parameters: the first columns of
# SamplingMetadata.columns, in this order. A row's stages: codes in its own order, 0 ends the list.
CHAIN_PARAMS = (
    "temperature", "dynatemp_min", "dynatemp_max", "dynatemp_exponent", "top_k", "top_p", "top_a", "min_p",
    "tfs", "typical_p", "eta", "epsilon", "nsigma", "smoothing_factor", "smoothing_curve", "xtc_threshold",
    "xtc_probability", "skew",
)
CHAIN_STAGES = (
    st.TEMPERATURE, st.TOP_K, st.TOP_P, st.TOP_A, st.MIN_P, st.TFS, st.TYPICAL_P, st.ETA, st.EPSILON,
    st.TOP_NSIGMA, st.QUADRATIC, st.XTC,
)
CHAIN_CODE = {stage: i + 1 for i, stage in enumerate(CHAIN_STAGES)}
CHAIN_MAX_WIDTH = 1024  # candidates one program holds in registers (top_k <= 512)
# Per-row statistics of the full vocabulary for stages before top-k ([R, PREFIX_STATS], float32):
# finite count, entropy of the softmax, population std of the finite logits.
PREFIX_STATS = 3


if triton is not None:

    @triton.jit
    def float_key(x):
        b = (x + 0.0).to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def key_float(k):
        return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def divide(x, d, rd):
        """x / d rounded as IEEE division (torch's `x / d`), given rd = 1 / d so rounded: the
        quotient through rd, then one residual correction (Markstein's; r = x - d q is exact in an
        fma). Three instructions instead of div.rn's reciprocal, Newton steps and range check.
        Bit for bit wherever 2^-100 <= |x| and |x / d| < 2^127 (below, the residual underflows;
        above, the product may round to infinity): benchmarks/sampler_division_check.py compares
        the two on every float32 x for 99 temperatures. Non-finite quotients (x = +-inf, overflow)
        keep the plain product."""
        q = x * rd
        r = tl.fma(-d, q, x)
        qr = tl.fma(r, rd, q)
        return tl.where(qr == qr, qr, q)

    @triton.jit
    def exp2_flush(x, ASM: tl.constexpr):
        """2^x, results below 2^-126 flushed to zero: one MUFU instruction on the GPU, where
        tl.exp2's denormal range fix costs three more per call; tl.exp2 where inline PTX cannot
        run (the interpreter). For sums whose largest term is 1: a flushed term is below their
        rounding."""
        if ASM:
            return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)  # fmt: skip
        return tl.exp2(x)

    @triton.jit
    def splitmix(z):
        # splitmix64 on uint64 (wrapping arithmetic), as rng.py.
        z = z + 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def gumbel(step, cols):
        h = splitmix(step + cols.to(tl.uint64))
        u = ((h >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        return -tl.log(-tl.log(u))

    @triton.jit
    def _tile(x_ptr, stride, n_cols, BLOCK: tl.constexpr):
        """This program's tile (grid: rows x tiles): (row, tile index over the grid, columns,
        values, -inf past the row)."""
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        return row, row * tl.num_programs(1) + blk, cols, v

    @triton.jit
    def _stats_kernel(x_ptr, stride, n_cols, pmax_ptr, parg_ptr, psum_ptr, BLOCK: tl.constexpr):
        """One tile: max, first argmax, sum of exp(v - tile max)."""
        row, out, cols, v = _tile(x_ptr, stride, n_cols, BLOCK)
        bm = tl.max(v, axis=0)
        safe = tl.where(bm == float("-inf"), 0.0, bm)
        tl.store(pmax_ptr + out, bm)
        tl.store(parg_ptr + out, tl.program_id(1) * BLOCK + tl.argmax(v, axis=0, tie_break_left=True).to(tl.int64))
        tl.store(psum_ptr + out, tl.sum(tl.exp(v - safe), axis=0))

    @triton.jit
    def _stats_combine_kernel(pmax_ptr, parg_ptr, psum_ptr, nb, max_ptr, arg_ptr, lse_ptr, NBP: tl.constexpr):
        """Per row: max, first argmax (tiles are in id order) and logsumexp of the tiles' partials."""
        row = tl.program_id(0).to(tl.int64)
        b = tl.arange(0, NBP)
        valid = b < nb
        bm = tl.load(pmax_ptr + row * nb + b, mask=valid, other=float("-inf"))
        m = tl.max(bm, axis=0)
        first = tl.argmax(bm, axis=0, tie_break_left=True)
        safe = tl.where(m == float("-inf"), 0.0, m)
        scale = tl.where(bm == float("-inf"), 0.0, tl.exp(bm - safe))
        z = tl.sum(tl.load(psum_ptr + row * nb + b, mask=valid, other=0.0) * scale, axis=0)
        tl.store(max_ptr + row, m)
        tl.store(arg_ptr + row, tl.load(parg_ptr + row * nb + first))
        tl.store(lse_ptr + row, m + tl.log(z))

    @triton.jit
    def _race_kernel(x_ptr, stride, n_cols, step_ptr, pbest_ptr, pid_ptr, BLOCK: tl.constexpr):
        """One tile: the best x + Gumbel(seed, position, id) over its finite entries."""
        row, out, cols, v = _tile(x_ptr, stride, n_cols, BLOCK)
        step = tl.load(step_ptr + row).to(tl.uint64, bitcast=True)
        best, best_id = race_block(v, v > float("-inf"), cols, step, tl.full([], float("-inf"), tl.float32),
                                    tl.full([], -1, tl.int64))  # fmt: skip
        tl.store(pbest_ptr + out, best)
        tl.store(pid_ptr + out, best_id)

    @triton.jit
    def _race_combine_kernel(pbest_ptr, pid_ptr, nb, out_ptr, NBP: tl.constexpr):
        """The first tile with the best key wins (lowest id on ties); a row without a finite
        entry takes id 0, as argmax does."""
        row = tl.program_id(0).to(tl.int64)
        b = tl.arange(0, NBP)
        best = tl.load(pbest_ptr + row * nb + b, mask=b < nb, other=float("-inf"))
        first = tl.argmax(best, axis=0, tie_break_left=True)
        tok = tl.load(pid_ptr + row * nb + first)
        tl.store(out_ptr + row, tl.where(tl.max(best, axis=0) > float("-inf"), tok, 0))

    @triton.jit
    def race_merge(xs, keep, cols, step, best, best_id):
        """The race over the kept entries of a block merged into (best, best_id): the larger key
        wins, the lower id on a tie."""
        g = tl.where(keep, xs + gumbel(step, cols), float("-inf"))
        bm = tl.max(g, axis=0)
        bid = tl.min(tl.where(keep & (g == bm), cols.to(tl.int64), 0x7FFFFFFFFFFFFFFF), axis=0)
        take = (bm > best) | ((bm == best) & (bid < best_id))
        return tl.maximum(best, bm), tl.where(take, bid, best_id)

    @triton.jit
    def race_block(xs, keep, cols, step, best, best_id):
        """`race_merge`, skipping the hashes of a block without a kept entry."""
        if tl.max(keep.to(tl.int32), axis=0) > 0:
            best, best_id = race_merge(xs, keep, cols, step, best, best_id)
        return best, best_id

    (_TEMPERATURE, _TOP_K, _TOP_P, _TOP_A, _MIN_P, _TFS, _TYPICAL, _ETA, _EPSILON, _NSIGMA, _QUADRATIC,
     _XTC) = (tl.constexpr(CHAIN_CODE[s]) for s in CHAIN_STAGES)
    (_P_T, _P_DMIN, _P_DMAX, _P_DEXP, _P_TOP_K, _P_TOP_P, _P_TOP_A, _P_MIN_P, _P_TFS, _P_TYPICAL, _P_ETA,
     _P_EPSILON, _P_NSIGMA, _P_SMOOTH, _P_CURVE, _P_XTC_T, _P_XTC_P, _P_SKEW) = (
        tl.constexpr(i) for i in range(len(CHAIN_PARAMS)))

    @triton.jit
    def _prefix_moments_kernel(x_ptr, stride, n_cols, part_ptr, BLOCK: tl.constexpr):
        """One tile: max, finite count, sum of e = exp(x - max) and of e (x - max), mean of the
        finite values and their squared deviations from it (combined per row by Chan's rule)."""
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        out = (row * tl.num_programs(1) + blk) * 6
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        fin = x > float("-inf")
        m = tl.max(x, axis=0)
        safe = tl.where(m == float("-inf"), 0.0, m)
        e = tl.exp(x - safe)
        n = tl.sum(fin.to(tl.float32), axis=0)
        mean = tl.sum(tl.where(fin, x, 0.0), axis=0) / tl.maximum(n, 1.0)
        tl.store(part_ptr + out + 0, m)
        tl.store(part_ptr + out + 1, n)
        tl.store(part_ptr + out + 2, tl.sum(e, axis=0))
        tl.store(part_ptr + out + 3, tl.sum(tl.where(fin, e * (x - safe), 0.0), axis=0))
        tl.store(part_ptr + out + 4, mean)
        tl.store(part_ptr + out + 5, tl.sum(tl.where(fin, (x - mean) * (x - mean), 0.0), axis=0))

    @triton.jit
    def _prefix_combine_kernel(part_ptr, nb, stats_ptr, NBP: tl.constexpr, NS: tl.constexpr):
        """Per row: finite count, entropy log Z - sum(e (x - max)) / Z, std of the finite values."""
        row = tl.program_id(0).to(tl.int64)
        b = tl.arange(0, NBP)
        valid = b < nb
        base = part_ptr + (row * nb + b) * 6
        bm = tl.load(base + 0, mask=valid, other=float("-inf"))
        bn = tl.load(base + 1, mask=valid, other=0.0)
        m = tl.max(bm, axis=0)
        # Tiles without a finite entry contribute nothing (their shift would be -inf * 0).
        shift = tl.where(bm == float("-inf"), 0.0, bm - m)
        scale = tl.where(bm == float("-inf"), 0.0, tl.exp(shift))
        bz = tl.load(base + 2, mask=valid, other=0.0)
        z = tl.sum(bz * scale, axis=0)
        s1 = tl.sum(scale * (tl.load(base + 3, mask=valid, other=0.0) + bz * shift), axis=0)
        n = tl.sum(bn, axis=0)
        bmean = tl.load(base + 4, mask=valid, other=0.0)
        mean = tl.sum(bn * bmean, axis=0) / tl.maximum(n, 1.0)
        m2 = tl.sum(tl.load(base + 5, mask=valid, other=0.0) + bn * (bmean - mean) * (bmean - mean), axis=0)
        tl.store(stats_ptr + row * NS + 0, n)
        tl.store(stats_ptr + row * NS + 1, tl.log(z) - s1 / z)
        tl.store(stats_ptr + row * NS + 2, tl.sqrt(m2 / tl.maximum(n, 1.0)))

    @triton.jit
    def _softmax_parts(x):
        """Row max, softmax and log-softmax with torch's formulas (exp(x - m) / Z, x - m - log Z)."""
        m = tl.max(x, axis=0)
        e = tl.exp(x - m)
        z = tl.sum(e, axis=0)
        return m, e / z, (x - m) - tl.log(z)

    @triton.jit
    def _entropy(p, lp):
        return -tl.sum(tl.where(lp > float("-inf"), p * lp, 0.0), axis=0)

    @triton.jit
    def _desc_keys(x, cols):
        """(value desc, column asc) sort keys: columns are in id order, so this is the ops' stable
        descending order; the low 31 bits hold the column."""
        return ((0x7FFFFFFF - float_key(x).to(tl.int64)) << 31) | cols.to(tl.int64)

    @triton.jit
    def _at(values, cols, j):
        """values[j] of a row held in registers."""
        return tl.sum(tl.where(cols == j, values, 0), axis=0)

    @triton.jit
    def _chain_kernel(
        val_ptr, id_ptr, width, prm_ptr, prm_stride, code_ptr, n_codes, stats_ptr, seed_ptr, pos_ptr,
        greedy_ptr, out_ptr, BLOCK: tl.constexpr, NUM_DRAWS: tl.constexpr, NS: tl.constexpr,
    ):  # fmt: skip
        """One row's candidates (top-`width` logits, any column order) in registers: the row's stage
        codes in its order, skew, then the race (greedy rows: the first argmax). Stages before the
        top-k code take full-vocabulary statistics from stats_ptr (dynatemp's entropy and count,
        top-nσ's std, scaled by the temperatures applied before it); the others compute theirs on
        the candidates, which is exact: removed tokens are -inf in the ops too."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        neg = float("-inf")
        x = tl.load(val_ptr + row * width + cols, mask=cols < width, other=neg)
        ids = tl.load(id_ptr + row * width + cols, mask=cols < width, other=0x7FFFFFFF)
        # Columns into id order: the ops' positional tie-breaks (lowest id first) become column ones.
        by_id = tl.sort((ids << 12) | cols.to(tl.int64), 0)
        x = tl.gather(x, (by_id & 0xFFF).to(tl.int32), 0)
        ids = by_id >> 12
        prm = prm_ptr + row * prm_stride
        counter = splitmix(tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)) + (
            tl.load(pos_ptr + row).to(tl.uint64, bitcast=True) * NUM_DRAWS)
        if tl.load(greedy_ptr + row) == 0:
            pre = tl.full([], 1, tl.int32)  # before the row's top-k
            scale = tl.full([], 1.0, tl.float32)  # product of the temperatures applied before top-k
            for s in range(n_codes):
                code = tl.load(code_ptr + row * n_codes + s)
                keys = _desc_keys(x, cols)
                srt = keys
                if (code == _TOP_K) | (code == _TOP_P) | (code == _TFS):
                    srt = tl.sort(keys, 0)
                if code == _TEMPERATURE:
                    t = tl.load(prm + _P_T)
                    dmin = tl.load(prm + _P_DMIN)
                    dmax = tl.load(prm + _P_DMAX)
                    if (dmin > 0) | (dmax > 0):
                        if pre != 0:
                            n_fin = tl.load(stats_ptr + row * NS + 0)
                            h = tl.load(stats_ptr + row * NS + 1)
                        else:
                            n_fin = tl.sum((x > neg).to(tl.float32), axis=0)
                            _, p, lp = _softmax_parts(x)
                            h = _entropy(p, lp)
                        norm = tl.minimum(tl.maximum(h / tl.log(tl.maximum(n_fin, 2.0)), 0.0), 1.0)
                        dexp = tl.load(prm + _P_DEXP)
                        powed = tl.where(norm > 0, tl.exp(dexp * tl.log(norm)), tl.where(dexp == 0, 1.0, 0.0))
                        t = tl.where(n_fin <= 1, dmin, dmin + (dmax - dmin) * powed)
                        t = tl.maximum(t, 1e-5)
                    x = tl.math.div_rn(x, t)
                    scale = scale * t
                elif code == _NSIGMA:
                    n = tl.load(prm + _P_NSIGMA)  # > 0: the code is there only when enabled
                    if pre != 0:
                        std = tl.load(stats_ptr + row * NS + 2) / scale
                    else:
                        fin = x > neg
                        cnt = tl.maximum(tl.sum(fin.to(tl.float32), axis=0), 1.0)
                        mean = tl.sum(tl.where(fin, x, 0.0), axis=0) / cnt
                        std = tl.sqrt(tl.sum(tl.where(fin, (x - mean) * (x - mean), 0.0), axis=0) / cnt)
                    x = tl.where(x < tl.max(x, axis=0) - n * std, neg, x)
                elif code == _TOP_K:
                    k = tl.minimum(tl.maximum(tl.load(prm + _P_TOP_K).to(tl.int32), 1), BLOCK)
                    # Keep every value >= the k-th largest (its ties too).
                    x = tl.where((keys >> 31) > (_at(srt, cols, k - 1) >> 31), neg, x)
                    pre = pre * 0
                elif code == _TOP_P:
                    top_p = tl.load(prm + _P_TOP_P)
                    if top_p < 1.0:
                        _, probs, _ = _softmax_parts(tl.gather(x, (srt & 0x7FFFFFFF).to(tl.int32), 0))
                        before = tl.cumsum(probs, 0) - probs
                        n_kept = tl.maximum(tl.sum((before < top_p).to(tl.int32), axis=0), 1)
                        x = tl.where(keys > _at(srt, cols, n_kept - 1), neg, x)
                elif code == _TOP_A:
                    m, _, lp = _softmax_parts(x)
                    threshold = tl.log(tl.load(prm + _P_TOP_A)) + 2 * tl.max(lp, axis=0)
                    x = tl.where((lp < threshold) & (x < m), neg, x)
                elif code == _MIN_P:
                    x = tl.where(x < tl.max(x, axis=0) + tl.log(tl.load(prm + _P_MIN_P)), neg, x)
                elif code == _TFS:
                    z = tl.load(prm + _P_TFS)
                    sv = tl.gather(x, (srt & 0x7FFFFFFF).to(tl.int32), 0)
                    _, probs, _ = _softmax_parts(sv)
                    n_fin = tl.sum((sv > neg).to(tl.int32), axis=0)
                    p1 = tl.gather(probs, tl.minimum(cols + 1, BLOCK - 1), 0)
                    p2 = tl.gather(probs, tl.minimum(cols + 2, BLOCK - 1), 0)
                    d = tl.where(cols > n_fin - 3, 0.0, tl.abs(probs - 2 * p1 + p2))
                    total = tl.sum(d, axis=0)
                    over = (tl.cumsum(d, 0) / tl.maximum(total, 1e-30)) > z
                    first = tl.min(tl.where(over, cols, BLOCK), axis=0)
                    first = tl.where(first < BLOCK, first, n_fin - 1)
                    if (total > 0) & (z < 1.0):
                        x = tl.where(keys > _at(srt, cols, first), neg, x)
                elif code == _TYPICAL:
                    typical = tl.load(prm + _P_TYPICAL)
                    if typical < 1.0:
                        _, p, lp = _softmax_parts(x)
                        dev_keys = (float_key(tl.abs(-lp - _entropy(p, lp))).to(tl.int64) << 31) | cols.to(tl.int64)
                        by_dev = tl.sort(dev_keys, 0)
                        sp = tl.gather(p, (by_dev & 0x7FFFFFFF).to(tl.int32), 0)
                        n_kept = tl.maximum(tl.sum(((tl.cumsum(sp, 0) - sp) < typical).to(tl.int32), axis=0), 1)
                        x = tl.where(dev_keys > _at(by_dev, cols, n_kept - 1), neg, x)
                elif code == _ETA:
                    eta = tl.load(prm + _P_ETA)
                    m, p, lp = _softmax_parts(x)
                    threshold = tl.minimum(eta, tl.sqrt(eta) * tl.exp(-_entropy(p, lp)))
                    x = tl.where((p < threshold) & (x < m), neg, x)
                elif code == _EPSILON:
                    m, p, _ = _softmax_parts(x)
                    x = tl.where((p < tl.load(prm + _P_EPSILON)) & (x < m), neg, x)
                elif code == _QUADRATIC:
                    f = tl.load(prm + _P_SMOOTH)  # > 0
                    c = tl.load(prm + _P_CURVE)
                    m = tl.max(x, axis=0)
                    d = x - m
                    kq = f * (3 - c) / 2
                    sq = f * (c - 1) / 2
                    x = tl.where(x > neg, m - kq * d * d + sq * d * d * d, x)
                elif code == _XTC:
                    coin = (splitmix(counter + 1) >> 40).to(tl.float32) * (1.0 / 16777216.0)
                    if coin < tl.load(prm + _P_XTC_P):
                        _, p, _ = _softmax_parts(x)
                        above = p >= tl.load(prm + _P_XTC_T)
                        least = tl.min(tl.where(above, p, float("inf")), axis=0)
                        kept = tl.max(tl.where(above & (p == least), cols, -1), axis=0)
                        if tl.sum(above.to(tl.int32), axis=0) >= 2:
                            x = tl.where(above & (cols != kept), neg, x)
            skew = tl.load(prm + _P_SKEW)
            if skew != 0:
                # On the descending order, in float64: p' = diff(cdf^(e^skew)); the result stays in
                # that order (the race reads ids, not columns).
                srt = tl.sort(_desc_keys(x, cols), 0)
                order = (srt & 0x7FFFFFFF).to(tl.int32)
                sv = tl.gather(x, order, 0)
                ids = tl.gather(ids, order, 0)
                _, p, _ = _softmax_parts(sv.to(tl.float64))
                cdf = tl.minimum(tl.maximum(tl.cumsum(p, 0), 0.0), 1.0)
                skewed = tl.where(cdf > 0, tl.exp(tl.exp(skew.to(tl.float64)) * tl.log(cdf)), 0.0)
                prev = tl.where(cols > 0, tl.gather(skewed, tl.maximum(cols - 1, 0), 0), 0.0)
                x = tl.where(sv > neg, tl.log(tl.maximum(skewed - prev, 0.0)).to(tl.float32), neg)
            x = tl.where(x > neg, x + gumbel(splitmix(counter), ids), neg)
        best = tl.max(x, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(x == best, ids, 0x7FFFFFFF), axis=0))


def split_block(n_cols: int) -> int:
    """Tile width: about 128 tiles per row (a batch-1 row spreads over the GPU), 256..4096."""
    return min(4096, max(256, triton.next_power_of_2(triton.cdiv(n_cols, 128))))


def contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def empty_on(*shape: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


def row_stats(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = contiguous_rows(x)
    rows, n = x.shape
    amax = empty_on(rows, dtype=torch.float32, like=x)
    arg = empty_on(rows, dtype=torch.int64, like=x)
    lse = empty_on(rows, dtype=torch.float32, like=x)
    if rows:
        block = block or split_block(n)
        nb = triton.cdiv(n, block)
        pmax = empty_on(rows, nb, dtype=torch.float32, like=x)
        parg = empty_on(rows, nb, dtype=torch.int64, like=x)
        psum = empty_on(rows, nb, dtype=torch.float32, like=x)
        _stats_kernel[(rows, nb)](x, x.stride(0), n, pmax, parg, psum, BLOCK=block, num_warps=4)
        _stats_combine_kernel[(rows,)](pmax, parg, psum, nb, amax, arg, lse, NBP=triton.next_power_of_2(nb),
                                       num_warps=1)
    return amax, arg, lse


def race(x: torch.Tensor, step: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Dense rows: argmax over finite entries of x + Gumbel(seed, position, id)."""
    x = contiguous_rows(x)
    rows, n = x.shape
    out = empty_on(rows, dtype=torch.int64, like=x)
    if rows:
        block = block or split_block(n)
        nb = triton.cdiv(n, block)
        pbest = empty_on(rows, nb, dtype=torch.float32, like=x)
        pid = empty_on(rows, nb, dtype=torch.int64, like=x)
        _race_kernel[(rows, nb)](x, x.stride(0), n, step, pbest, pid, BLOCK=block, num_warps=4)
        _race_combine_kernel[(rows,)](pbest, pid, nb, out, NBP=triton.next_power_of_2(nb), num_warps=1)
    return out


def prefix_stats(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """float32 [R, PREFIX_STATS] of the rows of x: finite count, entropy, std (module constants)."""
    x = contiguous_rows(x)
    rows, n = x.shape
    stats = empty_on(rows, PREFIX_STATS, dtype=torch.float32, like=x)
    if rows:
        block = block or split_block(n)
        nb = triton.cdiv(n, block)
        part = empty_on(rows, nb, 6, dtype=torch.float32, like=x)
        _prefix_moments_kernel[(rows, nb)](x, x.stride(0), n, part, BLOCK=block, num_warps=4)
        _prefix_combine_kernel[(rows,)](part, nb, stats, NBP=triton.next_power_of_2(nb), NS=PREFIX_STATS,
                                        num_warps=1)
    return stats


def chain(
    values: torch.Tensor, ids: torch.Tensor, params: torch.Tensor, codes: torch.Tensor, stats: torch.Tensor | None,
    seeds: torch.Tensor, positions: torch.Tensor, greedy: torch.Tensor, num_draws: int,
) -> torch.Tensor:
    """Sampled token ids [R] from the candidates values / ids [R, C] (C <= CHAIN_MAX_WIDTH): each
    row's stage codes [R, S] with its parameters (params [R, >= len(CHAIN_PARAMS)]), skew and the
    race keyed by (seed, position) with `num_draws` uniforms per position (rng.py)."""
    rows, width = values.shape
    out = empty_on(rows, dtype=torch.int64, like=values)
    if rows:
        block = triton.next_power_of_2(width)
        _chain_kernel[(rows,)](
            values.contiguous(), ids.contiguous(), width, params, params.stride(0), codes, codes.shape[1],
            stats if stats is not None else values, seeds, positions, greedy, out, BLOCK=block,
            NUM_DRAWS=num_draws, NS=PREFIX_STATS, num_warps=4 if block <= 512 else 8,
        )  # fmt: skip
    return out
