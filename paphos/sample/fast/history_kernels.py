"""Triton kernel of the sampler's history stages: penalties, DRY and no-repeat-ngram in one launch.

Data flow: pre-chained float32 logits [R, V] and SamplingMetadata's history [R, T] (right-aligned,
-1 = none), output lengths, DRY breakers, parameter columns and per-row history stage codes ->
the same logits, rewritten in place at the ids of each row's history only, every row's enabled
history stages applied in the row's own order (sample/fast/history.py calls it; the torch ops in
sample/ops/penalties.py, dry.py and no_repeat_ngram.py are the reference).

One program per row (rows are independent). A row without an enabled history stage reads its first
code and stops. Otherwise, in chunks of BLOCK positions (the whole history when T <= MAX_BLOCK):
1. per position: the output flag (frequency / presence count only output tokens), the
   no-repeat-ngram ban (the n - 1 tokens before it equal the current suffix) and DRY's match value
   (the suffix match with breakers and range, the occurrence rank and early exit carried from the
   newer chunks), each by a loop over look-back distances that ends as soon as no position of the
   chunk still matches (1 or 2 steps on ordinary text);
2. the chunk's (token, position) keys sorted in registers, the per-position values gathered into
   that order, and a segmented scan over equal tokens: at the last slot of each token's run, the
   newest position, output count, ban count and longest DRY match of that token in the chunk;
3. after all chunks: every token's last slot in a chunk looks up the same token in the other
   chunks (binary search of their sorted keys): a newer chunk holding it means another slot
   writes it; an older one adds its counts and match. The remaining slot (the newest occurrence)
   reads the logit once, applies the stage codes in order in registers and writes it once, so a
   token repeated in the history gets exactly one well-defined write.
Why a sort and not [T, T] comparison tiles: tl.sort is a bitonic network, B log2 B (log2 B + 1) / 4
compare-exchanges for B keys, in registers, and the aggregates then cost one scan; the tiles cost
T^2 comparisons, each feeding four reductions (newest, count, ban, longest match). Per row:
T = 512: 11.5k compare-exchanges against 262k pairs; T = 4096 (two chunks of 2048): 135k
compare-exchanges and 2 x 2048 binary searches of 12 loads against 16.7M pairs. Longer histories
add (T / MAX_BLOCK)^2 chunk pairs of lookups, quadratic but with a 2048^2 smaller constant than
the tiles, and never a [T, T] or [R, V] pass.

Arithmetic is the ops' expression for expression (division rounded as torch's, no fused
multiply-add: the launch turns fp fusion off), except DRY's base^x: exp(x ln base) in float64,
rounded to float32 (the interpreter has no libdevice powf): the correctly rounded power in all but
rare ties, which torch's CPU powf gives and its CUDA powf gives within its few-ulp error bound.
"""

from __future__ import annotations

import torch

from paphos.sample import order as st

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch ops run instead.
    triton = None

# Stage codes of a row's history stages, in its order, 0-padded to len(HISTORY_CODE).
HISTORY_CODE = {stage: i + 1 for i, stage in enumerate((st.PENALTIES, st.DRY, st.NO_REPEAT_NGRAM))}
# SamplingMetadata.columns holds these consecutively, in this order; the kernel reads them at
# these offsets from the first one's column.
HISTORY_PARAMS = (
    "repetition_penalty", "repetition_penalty_range", "rep_pen_slope", "frequency_penalty", "presence_penalty",
    "no_repeat_ngram_size", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_range", "dry_max_ngram",
    "dry_max_occurrences", "dry_early_exit_match_len",
)
MAX_BLOCK = 2048  # positions one program sorts in registers (one chunk)
_SENTINEL = 0x7FFFFFFF  # token of unknown positions: sorts after every id, never written

if triton is not None:
    _PENALTIES, _DRY, _NGRAM = (tl.constexpr(HISTORY_CODE[s]) for s in (st.PENALTIES, st.DRY, st.NO_REPEAT_NGRAM))
    (_P_RP, _P_RANGE, _P_SLOPE, _P_FREQ, _P_PRES, _P_NGRAM, _P_MULT, _P_BASE, _P_ALLOWED, _P_DRANGE, _P_MAX_NGRAM,
     _P_MAX_OCC, _P_EXIT) = (tl.constexpr(i) for i in range(len(HISTORY_PARAMS)))
    _SENT = tl.constexpr(_SENTINEL)

    @triton.jit
    def _run_combine(t1, d1, s1, t2, d2, s2):
        """Scan over sorted tokens: (token, longest DRY match, packed counts) of the run of the
        right operand's token that ends at it. Associative because equal tokens are contiguous."""
        same = t1 == t2
        return t2, tl.where(same, tl.maximum(d1, d2), d2), tl.where(same, s1 + s2, s2)

    @triton.jit
    def _is_breaker(tok, brk_ptr, n_brk):
        """tok (a tensor or a scalar) is one of the row's n_brk breaker ids (the -1 padding matches
        unknown positions only, which nothing counts)."""
        hit = tok != tok
        for b in range(n_brk):
            hit = hit | (tok == tl.load(brk_ptr + b).to(tl.int32))
        return hit

    @triton.jit
    def _history_kernel(
        x_ptr, x_stride, hist_ptr, hist_stride, length, nout_ptr, brk_ptr, brk_stride, n_brk, prm_ptr, prm_stride,
        code_ptr, key_ptr, agg_ptr, scratch_stride,
        P0: tl.constexpr, NC: tl.constexpr, BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        if tl.load(code_ptr + row * NC) != 0:  # codes are packed first: 0 first = no stage enabled
            use_dry = False
            use_ngram = False
            for s in tl.static_range(NC):
                code = tl.load(code_ptr + row * NC + s)
                use_dry = use_dry | (code == _DRY)
                use_ngram = use_ngram | (code == _NGRAM)
            hist = hist_ptr + row * hist_stride
            brk = brk_ptr + row * brk_stride
            prm = prm_ptr + row * prm_stride + P0
            lanes = tl.arange(0, BLOCK)
            # Known positions: the last n_known (right-aligned history).
            n_known = tl.zeros([], tl.int32)
            for start in range(0, length, BLOCK):
                cols = start + lanes
                n_known += tl.sum((tl.load(hist + cols, mask=cols < length, other=-1) >= 0).to(tl.int32), axis=0)
            first = length - n_known
            n_chunks = tl.cdiv(n_known, BLOCK)
            n_out = tl.load(nout_ptr + row).to(tl.int32)
            # no-repeat-ngram: needs n - 1 known tokens for a suffix (HF bans nothing before that).
            need = tl.load(prm + _P_NGRAM).to(tl.int32) - 1
            ngram_on = use_ngram & (need >= 0) & (n_known >= need)
            # DRY: nothing happens when the last token is unknown or a breaker.
            # Limits as thresholds (<= 0: none), not as scalar flags: the interpreter cannot broadcast
            # a scalar bool against a tensor.
            drange = tl.load(prm + _P_DRANGE).to(tl.int32)
            max_age = tl.where(drange > 0, drange, length) - 1  # DRY's sequence: ages <= max_age
            max_ngram = tl.load(prm + _P_MAX_NGRAM).to(tl.int32)
            max_occ = tl.load(prm + _P_MAX_OCC).to(tl.int32)
            max_rank = tl.where(max_occ > 0, max_occ, _SENT)
            early_exit = tl.load(prm + _P_EXIT).to(tl.int32)
            exit_len = tl.where(early_exit > 0, early_exit, _SENT)
            last = tl.load(hist + length - 1).to(tl.int32)
            dry_on = use_dry & (last >= 0) & (max_ngram >= 1)
            dry_on = dry_on & ~_is_breaker(last, brk, tl.where(dry_on, n_brk, 0))
            newer_candidates = tl.zeros([], tl.int32)  # DRY candidates in the chunks done (newer)
            stop = tl.full([], -1, tl.int32)  # newest position where DRY's early exit was reached
            for c in range(n_chunks):  # newest chunk first: DRY's rank and early exit run that way
                pos = length - (c + 1) * BLOCK + lanes
                valid = pos >= first
                tok = tl.load(hist + pos, mask=valid, other=-1).to(tl.int32)
                ban = tl.where(ngram_on, valid, False)
                # Each look-back loop has its own counter: triton 3.6 fails to lower the kernel
                # (RemoveLayoutConversions) when the two loops share one.
                k_ngram = 0
                go = ngram_on & (need > 0)
                while go:
                    # k_ngram < need <= n_known: the target, the k_ngram-th newest token, is known.
                    target = tl.load(hist + length - 1 - k_ngram).to(tl.int32)
                    back = pos - 1 - k_ngram
                    ban = ban & (tl.load(hist + back, mask=ban & (back >= first), other=-1).to(tl.int32) == target)
                    k_ngram += 1
                    go = (k_ngram < need) & (tl.max(ban.to(tl.int32), axis=0) > 0)
                match = tl.zeros([BLOCK], tl.int32)
                if dry_on:
                    # Candidates: known, no breaker (and in range, as the position before a match is).
                    alive = valid & ~_is_breaker(tok, brk, n_brk)
                    eligible = alive
                    k_dry = 0
                    go = tl.max(alive.to(tl.int32), axis=0) > 0
                    while go:
                        # The k_dry-th newest token, unless a breaker, must precede (it is known: a
                        # position still matching has k_dry known ones before it; and newer than
                        # them, so in range when they are).
                        target = tl.load(hist + length - 1 - k_dry).to(tl.int32)
                        target_ok = ~_is_breaker(target, brk, n_brk)
                        back = pos - 1 - k_dry
                        prev = tl.load(hist + back, mask=alive & (back >= first), other=-1).to(tl.int32)
                        alive = tl.where(target_ok, alive & (prev == target) & (length - 1 - back <= max_age), False)
                        match += alive.to(tl.int32)
                        k_dry += 1
                        go = (k_dry < max_ngram) & (tl.max(alive.to(tl.int32), axis=0) > 0)
                    candidate = eligible & (match >= 1)
                    # rank 1 = the newest candidate of the row (before max_occurrences drops any)
                    cand = candidate.to(tl.int32)
                    total = tl.sum(cand, axis=0)
                    rank = newer_candidates + total - tl.cumsum(cand, axis=0) + cand
                    newer_candidates += total
                    candidate = candidate & (rank <= max_rank)
                    reached = candidate & (match >= exit_len)
                    stop = tl.where(stop >= 0, stop, tl.max(tl.where(reached, pos, -1), axis=0))
                    candidate = candidate & (pos >= stop)
                    match = tl.where(candidate, match, 0)
                counts = (valid & (pos >= length - n_out)).to(tl.int32) + (ban.to(tl.int32) << 16)
                keys = tl.sort((tl.where(valid, tok, _SENT).to(tl.int64) << 32) | lanes.to(tl.int64), 0)
                perm = (keys & (BLOCK - 1)).to(tl.int32)
                _, longest, packed = tl.associative_scan(
                    ((keys >> 32).to(tl.int32), tl.gather(match, perm, 0), tl.gather(counts, perm, 0)), 0, _run_combine
                )
                slot = row * scratch_stride + c * BLOCK + lanes
                tl.store(key_ptr + slot, keys)
                tl.store(agg_ptr + slot, (longest.to(tl.int64) << 32) | packed.to(tl.int64))
            tl.debug_barrier()  # the scratch written above is read by other threads below

            rp = tl.load(prm + _P_RP)
            rep_range = tl.load(prm + _P_RANGE).to(tl.int32)
            slope = tl.load(prm + _P_SLOPE)
            freq = tl.load(prm + _P_FREQ)
            pres = tl.load(prm + _P_PRES)
            window = tl.minimum(tl.minimum(tl.where(rep_range > 0, rep_range, length), length), n_known)
            older_rp = 1 + (rp - 1) * slope
            mult = tl.load(prm + _P_MULT)
            base = tl.load(prm + _P_BASE)
            allowed = tl.load(prm + _P_ALLOWED)
            for c in range(n_chunks):
                chunk = row * scratch_stride + c * BLOCK
                keys = tl.load(key_ptr + chunk + lanes)
                nxt = tl.load(key_ptr + chunk + lanes + 1, mask=lanes + 1 < BLOCK, other=-1)
                tok = (keys >> 32).to(tl.int32)
                write = (tok != _SENT) & (tok != (nxt >> 32).to(tl.int32))  # last slot of its token's run
                agg = tl.load(agg_ptr + chunk + lanes, mask=write, other=0)
                longest = (agg >> 32).to(tl.int32)
                n_outputs = (agg & 0xFFFF).to(tl.int32)
                n_bans = ((agg >> 16) & 0xFFFF).to(tl.int32)
                for d in range(n_chunks):
                    if d != c:
                        other = row * scratch_stride + d * BLOCK
                        # The last slot of chunk d with a token <= tok (d's keys are sorted).
                        lo = tl.zeros([BLOCK], tl.int32)
                        hi = tl.full([BLOCK], BLOCK, tl.int32)
                        for _ in tl.static_range(LOG_BLOCK + 1):
                            live = write & (lo < hi)
                            mid = (lo + hi) // 2
                            le = (tl.load(key_ptr + other + mid, mask=live, other=0) >> 32).to(tl.int32) <= tok
                            lo = tl.where(live & le, mid + 1, lo)
                            hi = tl.where(live & ~le, mid, hi)
                        at = lo - 1
                        found = write & (at >= 0)
                        at_tok = (tl.load(key_ptr + other + at, mask=found, other=-1) >> 32).to(tl.int32)
                        found = found & (at_tok == tok)
                        if d < c:
                            write = write & ~found  # a newer occurrence's slot writes this token
                        else:
                            more = tl.load(agg_ptr + other + at, mask=found, other=0)
                            longest = tl.maximum(longest, (more >> 32).to(tl.int32))
                            n_outputs += (more & 0xFFFF).to(tl.int32)
                            n_bans += ((more >> 16) & 0xFFFF).to(tl.int32)
                age = (c + 1) * BLOCK - 1 - (keys & (BLOCK - 1)).to(tl.int32)  # of the newest occurrence
                ptr = x_ptr + row * x_stride + tok
                v = tl.load(ptr, mask=write, other=0.0)
                for s in tl.static_range(NC):
                    code = tl.load(code_ptr + row * NC + s)
                    if code == _PENALTIES:
                        in_window = age < window
                        # where, not &: the interpreter cannot broadcast a scalar float comparison
                        use_older = tl.where((slope < 1) & (rp > 1), age >= window - window // 2, False)
                        factor = tl.where(in_window, tl.where(use_older, older_rp, rp), 1.0)
                        v = tl.where(v > 0, tl.math.div_rn(v, factor), v * factor)
                        cnt = n_outputs.to(tl.float32)
                        v = v - freq * cnt - pres * (n_outputs > 0).to(tl.float32)
                    elif code == _DRY:
                        dry_len = longest.to(tl.float32)
                        powed = tl.exp((dry_len - allowed).to(tl.float64) * tl.log(base.to(tl.float64)))
                        penalty = mult * powed.to(tl.float32)
                        v = v - tl.where((dry_len >= allowed) & (dry_len > 0), penalty, 0.0)
                    elif code == _NGRAM:
                        v = v + tl.where(n_bans > 0, float("-inf"), 0.0)
                tl.store(ptr, v, mask=write)


def block_for(length: int) -> int:
    """Positions per chunk: the whole history up to MAX_BLOCK (one sort), at least 128 (ptxas
    spills a few bytes for 32 and 64 on sm_90)."""
    return min(MAX_BLOCK, max(128, triton.next_power_of_2(length)))


def warps_for(block: int) -> int:
    """Warps per program: 4 positions per thread from 512 to 1024, 8 at MAX_BLOCK (no spills on
    sm_90 with triton 3.6 or 3.9; 16 warps cap registers at 128 and spill under 3.6)."""
    return min(8, max(4, block // 128))


def apply_history(
    x: torch.Tensor, history: torch.Tensor, num_output: torch.Tensor, breakers: torch.Tensor | None,
    params: torch.Tensor, first_param: int, codes: torch.Tensor, block: int | None = None,
) -> torch.Tensor:
    """x [R, V] float32 (rows contiguous) with each row's history stages applied in place: codes
    int32 [R, len(HISTORY_CODE)] (HISTORY_CODE, in the row's order, 0-padded), params [R, C] with
    HISTORY_PARAMS at columns first_param.., history int64 [R, T] right-aligned (-1 = none),
    num_output int64 [R], breakers int64 [R, B] (-1 padded) or None when no row runs DRY."""
    rows, length = history.shape
    if not rows:
        return x
    assert x.stride(1) == 1 and history.stride(1) == 1 and params.stride(1) == 1 and codes.is_contiguous()
    block = block or block_for(length)
    keys = torch.empty(rows, triton.cdiv(length, block) * block, dtype=torch.int64, device=x.device)
    agg = torch.empty_like(keys)
    brk = breakers if breakers is not None else history
    _history_kernel[(rows,)](
        x, x.stride(0), history, history.stride(0), length, num_output, brk, brk.stride(0),
        breakers.shape[1] if breakers is not None else 0, params, params.stride(0), codes, keys, agg, keys.stride(0),
        P0=first_param, NC=codes.shape[1], BLOCK=block, LOG_BLOCK=block.bit_length() - 1,
        num_warps=warps_for(block), enable_fp_fusion=False,
    )  # fmt: skip
    return x
