"""Triton kernels of the sampler fast paths, one program per row (rows are independent).

Each kernel has a torch formulation next to its caller (rowstats.py, race.py, dense_tail.py): the
torch code is the CPU path and the reference the tests compare against. Kernels run on CUDA
tensors; tests force them on CPU tensors under the Triton interpreter (`force_kernels`).

Float keys: key(x) maps float32 to int32 monotonically (x < y <=> key(x) < key(y); -0.0 is
canonicalised to +0.0 first so the two zeros tie as they do under float comparison).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

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


if triton is not None:

    @triton.jit
    def _key(x):
        b = (x + 0.0).to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _unkey(k):
        return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _mix(z):
        # splitmix64 on uint64 (wrapping arithmetic), as rng.py.
        z = z + 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _gumbel(step, cols):
        h = _mix(step + cols.to(tl.uint64))
        u = ((h >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        return -tl.log(-tl.log(u))

    @triton.jit
    def _row_stats_kernel(x_ptr, stride, n_cols, max_ptr, arg_ptr, lse_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        arg = tl.zeros([], tl.int64)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            bm = tl.max(x, axis=0)
            bi = tl.argmax(x, axis=0, tie_break_left=True)
            new_m = tl.maximum(m, bm)
            safe = tl.where(new_m == float("-inf"), 0.0, new_m)
            s = s * tl.exp(m - safe) + tl.sum(tl.exp(x - safe), axis=0)
            arg = tl.where(bm > m, (start + bi).to(tl.int64), arg)
            m = new_m
        tl.store(max_ptr + row, m)
        tl.store(arg_ptr + row, arg)
        tl.store(lse_ptr + row, m + tl.log(s))

    @triton.jit
    def _race_kernel(x_ptr, stride, n_cols, step_ptr, out_ptr, BLOCK: tl.constexpr):
        """Dense rows: argmax over finite entries of x + Gumbel(seed, position, id)."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        step = tl.load(step_ptr + row).to(tl.uint64, bitcast=True)
        offs = tl.arange(0, BLOCK)
        best = tl.full([], float("-inf"), tl.float32)
        best_id = tl.zeros([], tl.int64)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            if tl.max(x, axis=0) > float("-inf"):  # blocks without a survivor cost one read
                g = tl.where(x > float("-inf"), x + _gumbel(step, cols), float("-inf"))
                bm = tl.max(g, axis=0)
                bi = tl.argmax(g, axis=0, tie_break_left=True)
                best_id = tl.where(bm > best, (start + bi).to(tl.int64), best_id)
                best = tl.maximum(best, bm)
        tl.store(out_ptr + row, best_id)

    @triton.jit
    def _tail_kernel(
        x_ptr, stride, n_cols, t_ptr, p_ptr, mp_ptr, step_ptr, buf_ptr, tok_ptr, arg_ptr, last_v_ptr, last_id_ptr,
        CAP: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, SBLOCK: tl.constexpr, FIRST_STEP: tl.constexpr,
    ):  # fmt: skip
        """x / T -> top-p (exact, sort-free) -> min-p -> race, one row per program.

        Passes over the row: (1) max, first argmax and normaliser of x / T; (2) while the bracket
        (lo, hi] of float keys that holds the top-p boundary has more than CAP tokens: K edges
        inside it, the mass and count above each, keep the sub-bracket where the cumulative mass
        crosses p * Z; (3) the bracket's tokens into buf (id order), sorted there by (value desc,
        id asc) to find the last kept token exactly; (4) the race over the survivors.
        """
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        temp = tl.load(t_ptr + row)
        top_p = tl.load(p_ptr + row)
        min_p = tl.load(mp_ptr + row)
        # (1) online max / argmax / sum of exp(x/T - max).
        m = tl.full([], float("-inf"), tl.float32)
        z = tl.zeros([], tl.float32)
        arg = tl.zeros([], tl.int64)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            xs = tl.math.div_rn(x, temp)
            bm = tl.max(xs, axis=0)
            bi = tl.argmax(xs, axis=0, tie_break_left=True)
            new_m = tl.maximum(m, bm)
            safe = tl.where(new_m == float("-inf"), 0.0, new_m)
            z = z * tl.exp(m - safe) + tl.sum(tl.exp(xs - safe), axis=0)
            arg = tl.where(bm > m, (start + bi).to(tl.int64), arg)
            m = new_m
        tl.store(arg_ptr + row, arg)

        # The last kept token of top-p: (key_last, id_last); everything at or above survives.
        neg_key = _key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
        key_last = neg_key
        id_last = tl.full([], -1, tl.int64)
        if top_p < 1.0:
            target = top_p * z
            lo = neg_key  # A(lo) = Z >= target: the boundary is above lo
            hi = _key(m).to(tl.int64)  # A(hi) = 0 < target: the boundary is at or below hi
            a_hi = tl.zeros([], tl.float32)  # mass strictly above hi
            n_b = n_cols + 0  # tokens in (lo, hi]; unknown yet
            jj = tl.arange(0, K)
            # (2) narrow the bracket.
            while (n_b > CAP) & (hi - lo > 1):
                step_k = tl.maximum((hi - lo) // (K + 1), 1)
                by_key = hi - (jj + 1).to(tl.int64) * step_k
                # While lo is -inf, edges every FIRST_STEP nats below hi's value.
                by_value = _key(_unkey(hi.to(tl.int32)) - (jj + 1).to(tl.float32) * FIRST_STEP).to(tl.int64)
                edges = tl.where(lo == neg_key, by_value, by_key)
                edges = tl.maximum(tl.minimum(edges, hi - (jj + 1).to(tl.int64)), lo)
                mass = tl.zeros([K], tl.float32)
                cnt = tl.zeros([K], tl.int32)
                nb = tl.zeros([], tl.int32)
                for start in range(0, n_cols, SBLOCK):  # [SBLOCK, K] temporaries: a smaller block
                    cols = start + tl.arange(0, SBLOCK)
                    x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                    xs = tl.math.div_rn(x, temp)
                    kx = _key(xs).to(tl.int64)
                    inb = (kx > lo) & (kx <= hi) & (cols < n_cols)
                    if tl.max(inb.to(tl.int32), axis=0) > 0:
                        e = tl.exp(xs - m)
                        above = inb[:, None] & (kx[:, None] > edges[None, :])
                        mass += tl.sum(tl.where(above, e[:, None], 0.0), axis=0)
                        cnt += tl.sum(above.to(tl.int32), axis=0)
                        nb += tl.sum(inb.to(tl.int32), axis=0)
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
            if n_b <= CAP:
                # (3) gather the bracket (id order), sort by (value desc, id asc), walk the mass.
                off = tl.zeros([], tl.int32)
                for start in range(0, n_cols, BLOCK):
                    cols = start + offs
                    x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                    kx = _key(tl.math.div_rn(x, temp)).to(tl.int64)
                    inb = (kx > lo) & (kx <= hi) & (cols < n_cols)
                    pos = off + tl.cumsum(inb.to(tl.int32), axis=0) - 1
                    packed = ((0x7FFFFFFF - kx) << 31) | cols.to(tl.int64)
                    tl.store(buf_ptr + row * CAP + pos, packed, mask=inb)
                    off += tl.sum(inb.to(tl.int32), axis=0)
                slots = tl.arange(0, CAP)
                valid = slots < n_b
                packed = tl.load(buf_ptr + row * CAP + slots, mask=valid, other=0x7FFFFFFFFFFFFFFF)
                packed = tl.sort(packed, 0)
                kb = 0x7FFFFFFF - (packed >> 31)
                ids = packed & 0x7FFFFFFF
                e = tl.where(valid, tl.exp(_unkey(kb.to(tl.int32)) - m), 0.0)
                before = a_hi + tl.cumsum(e, axis=0) - e
                n_kept = tl.maximum(tl.sum((valid & (before < target)).to(tl.int32), axis=0), 1)
                last = slots == n_kept - 1
                key_last = tl.sum(tl.where(last, kb, 0), axis=0)
                id_last = tl.sum(tl.where(last, ids, 0), axis=0)
            else:
                # More than CAP tokens tie on one key: keep the first n_t of them by id.
                v = _unkey(hi.to(tl.int32))
                ev = tl.exp(v - m)
                n_t = tl.where(ev > 0, tl.ceil((target - a_hi) / ev), n_b.to(tl.float32))
                n_t = tl.minimum(tl.maximum(n_t, 1.0), n_b.to(tl.float32)).to(tl.int32)
                off = tl.zeros([], tl.int32)
                found = tl.zeros([], tl.int64)
                for start in range(0, n_cols, BLOCK):
                    cols = start + offs
                    x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                    tie = (_key(tl.math.div_rn(x, temp)).to(tl.int64) == hi) & (cols < n_cols)
                    c = off + tl.cumsum(tie.to(tl.int32), axis=0)
                    found += tl.sum(tl.where(tie & (c == n_t), cols.to(tl.int64), 0), axis=0)
                    off += tl.sum(tie.to(tl.int32), axis=0)
                key_last = hi
                id_last = found

        tl.store(last_v_ptr + row, _unkey(key_last.to(tl.int32)))
        tl.store(last_id_ptr + row, id_last)
        # (4) race over the survivors of top-p and min-p.
        threshold = m + tl.log(min_p)
        step = tl.load(step_ptr + row).to(tl.uint64, bitcast=True)
        best = tl.full([], float("-inf"), tl.float32)
        best_id = arg
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            xs = tl.math.div_rn(x, temp)
            kx = _key(xs).to(tl.int64)
            keep = (kx > key_last) | ((kx == key_last) & (cols.to(tl.int64) <= id_last))
            keep = keep & (xs >= threshold) & (xs > float("-inf"))
            if tl.max(keep.to(tl.int32), axis=0) > 0:
                g = tl.where(keep, xs + _gumbel(step, cols), float("-inf"))
                bm = tl.max(g, axis=0)
                bi = tl.argmax(g, axis=0, tie_break_left=True)
                best_id = tl.where(bm > best, (start + bi).to(tl.int64), best_id)
                best = tl.maximum(best, bm)
        tl.store(tok_ptr + row, best_id)


def _block(n_cols: int, cap: int = 4096) -> int:
    return min(cap, triton.next_power_of_2(max(n_cols, 16)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def row_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = _rows(x)
    rows, n = x.shape
    amax = torch.empty(rows, dtype=torch.float32, device=x.device)
    arg = torch.empty(rows, dtype=torch.int64, device=x.device)
    lse = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _row_stats_kernel[(rows,)](x, x.stride(0), n, amax, arg, lse, BLOCK=_block(n), num_warps=8)
    return amax, arg, lse


def race(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    x = _rows(x)
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        _race_kernel[(rows,)](x, x.stride(0), n, step, out, BLOCK=_block(n), num_warps=8)
    return out


TAIL_CAP = 2048
TAIL_PIVOTS = 16
TAIL_FIRST_STEP = 1.0  # nats between the first pass's edges (while the bracket is open below)


def tail(
    x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, step: torch.Tensor,
    cap: int | None = None, pivots: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(race winner, argmax of x / T, top-p's last kept value and id) per row; see _tail_kernel.
    Rows exempt from top-p report (-inf, -1): every finite token is kept."""
    cap = cap or TAIL_CAP
    pivots = pivots or TAIL_PIVOTS
    x = _rows(x)
    rows, n = x.shape
    tok = torch.empty(rows, dtype=torch.int64, device=x.device)
    arg = torch.empty(rows, dtype=torch.int64, device=x.device)
    last_v = torch.empty(rows, dtype=torch.float32, device=x.device)
    last_id = torch.empty(rows, dtype=torch.int64, device=x.device)
    buf = torch.empty((max(rows, 1), cap), dtype=torch.int64, device=x.device)
    if rows:
        _tail_kernel[(rows,)](
            x, x.stride(0), n, temperature.float().contiguous(), top_p.float().contiguous(),
            min_p.float().contiguous(), step, buf, tok, arg, last_v, last_id,
            CAP=cap, K=pivots, BLOCK=_block(n, 2048), SBLOCK=_block(n, 512), FIRST_STEP=TAIL_FIRST_STEP, num_warps=8,
        )  # fmt: skip
    return tok, arg, last_v, last_id
