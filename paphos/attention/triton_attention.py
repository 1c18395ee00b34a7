"""Triton kernels for decoding over the paged KV cache, and what the prefill kernels
(triton_prefill.py) share with them: the score, K/V gather and online-softmax pieces, the dot
dtype and the cache's scales.

Data flow: model runner (AttentionMetadata) -> model -> attention layer -> TritonAttentionBackend
(triton_backend.py) -> `paged_attention_decode` here, `paged_attention_prefill` in
triton_prefill.py (the K/V write is in triton_kv_write.py).

`paged_attention_decode` takes rows with query_len 1, split-KV ("flash decoding"): each
(sequence, kv head) context is cut into NUM_SPLITS segments handled by separate programs, and a
second small kernel merges the partial results by their log-sum-exp. NUM_SPLITS is a launch
constant chosen by the caller from the number of rows only, and context lengths are read from the
device `seq_lens`, so the launch can be captured in a CUDA graph.

Every kernel reads K/V through the block table ([num_blocks, 2, block_size, Hkv, D] cache),
accumulates in fp32 and uses the softmax in base 2 (scores are pre-multiplied by log2(e)).
An fp8 cache under bf16 queries is multiplied in fp16 (`dot_mode` says why). Measured on an H100
(benchmarks/gpu_attention_check.py): decoding 64 sequences of 4096 tokens 0.322 -> 0.281 ms
(CUDA-graph replay; a bf16 cache: 0.419), and with V widened where it is loaded (`widen_v`) 256
sequences of 1536 tokens 0.374 -> 0.315 ms (2.15 -> 2.56 TB/s; a bf16 cache 0.541, 2.98 TB/s);
a 4 x 4096 prefill unchanged at 2.39 ms (eager; bf16 cache 1.74-1.81; its 128 x 32 tiles spill
a few registers either way; its V already converts where it loads); offline with FP8 weights
(1000 prompts, 1000 tokens in and out) 8445 output tok/s with a bf16 cache, 10788 with the fp8
one (bf16 weights and cache: 6281), where decode attention was 60 % of a 256-sequence step
(before the three stages and `widen_v`; not re-run since).
Only Triton APIs present in 3.6 are used (the H200 image); tests run them under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paphos.attention.backend import FP8_KV_DTYPES
from paphos.layers import pdl, x_int8_outputs
from paphos.layers.x_int8_outputs import Int8Outputs

LOG2E = 1.4426950408889634



# ------------------------------------------------------------------------------------------ helpers


@triton.jit
def _tanh(x):
    # tl.math has no tanh in every Triton version we support; this form saturates cleanly
    # (exp overflow -> 1, underflow -> -1) and its ~1e-7 absolute error is far below bf16's.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# How q meets K/V in the dots (`dot_mode`): as loaded, widened to fp32, or pre-scaled to fp16.
DOT_AS_IS, DOT_FP32, DOT_FP16 = 0, 1, 2


@triton.jit
def dot_q(q, q_prescale, DOT: tl.constexpr):
    """q [M, D] in the dtype the dots take (DOT: `dot_mode`'s DOT_AS_IS 0, DOT_FP32 1, DOT_FP16 2,
    pre-scaled by q_prescale); K/V and the softmax weights follow it."""
    if DOT == 1:
        return q.to(tl.float32)
    elif DOT == 2:
        return (q.to(tl.float32) * q_prescale).to(tl.float16)
    else:
        return q


@triton.jit
def scores(q, k_t, qk_scale, soft_cap, USE_SOFTCAP: tl.constexpr):
    """q [M, D] x k_t [D, N] -> scores in log2 units (already times log2(e)), fp32."""
    s = tl.dot(q, k_t)
    if USE_SOFTCAP:
        s = (soft_cap * 1.4426950408889634) * _tanh(s * (qk_scale / soft_cap))
    else:
        s = s * (qk_scale * 1.4426950408889634)
    return s


@triton.jit
def load_kv_tile(
    cache_ptr,
    bt_row_ptr,
    tok,
    tok_valid,
    kv_head,
    offs_d,
    d_valid,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_ckv,
    BLOCK_SIZE: tl.constexpr,
):
    """Gather K^T [D, N] and V [N, D] of the tokens `tok` through one sequence's block table."""
    page = tl.load(bt_row_ptr + tok // BLOCK_SIZE, mask=tok_valid, other=0).to(tl.int64)
    base = cache_ptr + page * stride_cb + (tok % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    k_t = tl.load(base[None, :] + offs_d[:, None], mask=tok_valid[None, :] & d_valid[:, None], other=0.0)
    v = tl.load(
        base[:, None] + stride_ckv + offs_d[None, :], mask=tok_valid[:, None] & d_valid[None, :], other=0.0
    )
    return k_t, v


@triton.jit
def widen_v(v, tok_valid, dtype: tl.constexpr):
    """The V tile [N, D] in the dot's dtype, converted where it was loaded. The select on the valid
    tokens changes no value (the load zero-fills the others) but anchors the conversion in the
    load's layout: without it Triton reads an fp8 tile from shared memory straight into the
    dot's operand layout, which runs along the tokens while V's bytes run along D, one byte-wide
    LDS per value (128 a thread per 128-token tile on sm_90), where this way the tile moves in
    16-byte loads and is transposed in fp16 by ldmatrix. A tile already in the dot's dtype is
    left alone (the select would move it through registers for nothing)."""
    if v.dtype == dtype:
        widened = v
    else:
        widened = tl.where(tok_valid[:, None], v.to(dtype), 0.0)
    return widened


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v):
    """Fold one block of masked log2-scores s [M, N] (-inf = masked) and values v [N, D] (in the
    dot's input dtype) into (m, l, acc).

    Rows that have seen no valid key yet keep m = -inf; using 0 in their place avoids the
    (-inf) - (-inf) = NaN that would otherwise poison alpha and p.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# ------------------------------------------------------------------------------------------ decode


# The block-table row stride is the widest table of the step: unspecialized, so a new width never
# compiles a new variant in the middle of serving (a ~1 s stall of every stream).
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_bt,
    head_dim,
    q_prescale,
    qk_scale,
    v_scale,
    soft_cap,
    sliding_window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIXED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.release(PDL)
    pdl.wait(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if MIXED:
        # A flat batch that also holds prefill chunks: only its query_len == 1 sequences are ours.
        row = tl.load(query_start_loc_ptr + seq)
        if tl.load(query_start_loc_ptr + seq + 1) - row != 1:
            return
    else:
        row = seq
    ctx = tl.load(seq_lens_ptr + seq)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - sliding_window, 0)
    # Segments start on BLOCK_N boundaries so each step's tokens share as few pages as possible.
    lo_aligned = (lo // BLOCK_N) * BLOCK_N
    seg = tl.cdiv(tl.cdiv(ctx - lo_aligned, NUM_SPLITS), BLOCK_N) * BLOCK_N
    seg_lo = lo_aligned + split * seg
    seg_hi = tl.minimum(seg_lo + seg, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_valid = offs_g < GROUP
    d_valid = offs_d < head_dim
    heads = kv_head * GROUP + offs_g
    row64 = row.to(tl.int64)
    q = tl.load(
        q_ptr + row64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    q = dot_q(q, q_prescale, DOT)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(seg_lo, seg_hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_valid = (tok < seg_hi) & (tok >= lo)
        k_t, v = load_kv_tile(
            cache_ptr, bt_row, tok, tok_valid, kv_head, offs_d, d_valid,
            stride_cb, stride_cs, stride_ch, stride_ckv, BLOCK_SIZE,
        )  # fmt: skip
        s = scores(q, k_t.to(q.dtype), qk_scale, soft_cap, USE_SOFTCAP)
        s = tl.where(tok_valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, widen_v(v, tok_valid, q.dtype))

    # Empty segments (short contexts, padding rows with seq_len 0) leave l = 0: write zeros.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if NUM_SPLITS == 1:
        o = acc / l_safe[:, None] * v_scale
        tl.store(
            out_ptr + row64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_valid[:, None] & d_valid[None, :],
        )
    else:
        # Partials are laid out [seq, Hq, NUM_SPLITS, BLOCK_D] and [seq, Hq, NUM_SPLITS].
        part = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(
            part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :],
            acc / l_safe[:, None],
            mask=g_valid[:, None],
        )
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_valid)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, q_ptr, f_ptr, order_ptr, bq_ptr, bdx_ptr, bsum_ptr,
    n_rows, stride_ot, stride_oh, head_dim, v_scale,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, MIXED: tl.constexpr, HEADS: tl.constexpr,
    QLO: tl.constexpr, QTW: tl.constexpr, BXB: tl.constexpr, BSUM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """HEADS heads of one row per program; with QLO / BXB (a decode-only batch, contiguous out,
    head_dim == BLOCK_D) also the o projection's int8 parts of those columns
    (x_int8_outputs.write_after_store)."""
    pdl.release(PDL)
    pdl.wait(PDL)
    seq = tl.program_id(0)
    if MIXED:
        row = tl.load(query_start_loc_ptr + seq)
        if tl.load(query_start_loc_ptr + seq + 1) - row != 1:
            return
    else:
        row = seq
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    num_heads = tl.num_programs(1) * HEADS
    for i in tl.static_range(HEADS):
        head = tl.program_id(1) * HEADS + i
        part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s
        lse = tl.load(part_lse_ptr + part)
        o = tl.load(part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :])
        lse_max = tl.max(lse, 0)
        # All splits empty only for padding rows (seq_len 0); keep their weights 0, not NaN.
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        w = tl.exp2(lse - lse_max)
        denom = tl.sum(w, 0)
        denom = tl.where(denom > 0.0, denom, 1.0)
        res = tl.sum(o * w[:, None], 0) / denom * v_scale
        tl.store(
            out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
            res.to(out_ptr.dtype.element_ty),
            mask=offs_d < head_dim,
        )
    x_int8_outputs.write_after_store(out_ptr + row.to(tl.int64) * stride_ot, q_ptr, f_ptr, order_ptr, bq_ptr, bdx_ptr,
                                     bsum_ptr, row, n_rows, tl.program_id(1) * (HEADS * BLOCK_D), num_heads * BLOCK_D,
                                     HEADS * BLOCK_D, QLO, QTW, BXB, BSUM)  # fmt: skip


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


def default_decode_config(head_dim: int, device: torch.device, cache_dtype: torch.dtype) -> DecodeConfig:
    if device.type != "cuda":
        return DecodeConfig(block_n=16, num_warps=4, num_stages=1)
    # Measured on an H200 (benchmarks/gpu_attention_check.py --sweep, triton 3.6): bf16 decode at
    # batch 64 x 4096 reads ~4.2 TB/s with 64-token tiles; fp8 tiles want 128 tokens, and on an
    # H100 three stages: 64 x 4096 0.258 -> 0.250 ms, 256 x 1536 (the offline workload's decode)
    # 0.387 -> 0.374 ms, where 256 tokens, 8 warps and four stages were no faster; with
    # `widen_v` 0.233 and 0.315 ms, 2 stages 4.8 and 3.8 % slower, 64-token tiles 4 % faster on
    # the first and 8 % slower on the second.
    if head_dim > 128:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    if cache_dtype in FP8_KV_DTYPES:
        return DecodeConfig(block_n=128, num_warps=4, num_stages=3)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=2)


def paged_attention_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    num_splits: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    query_start_loc: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    int8_outputs: Int8Outputs | None = None,
) -> None:
    """Attend query_len-1 rows over their paged contexts, writing `out` [T, Hq, D] in place.
    With `int8_outputs` (the o projection's layouts), the merge kernel also writes the int8
    parts of `out` that projection reads at T tokens and attaches them (`_reduce_outputs` says
    when).

    Without `query_start_loc`, row i of q belongs to sequence i (a decode-only batch; rows past
    the real ones may be padding with seq_len 0, which get zeros). With it, the batch is mixed:
    sequence i's single row is query_start_loc[i], and sequences with query_len != 1 are skipped.
    `num_splits` (a power of two) must not depend on context lengths for CUDA-graph capture.
    Reads no host metadata and never synchronizes.
    """
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if num_seqs == 0:
        return
    q = last_dim_contiguous(q)
    check_out(out, q)
    shared = launch_args(q, out, kv_cache, block_tables, scale, k_scale, v_scale, soft_cap, sliding_window)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    group = num_heads // num_kv_heads
    cfg = config or default_decode_config(head_dim, q.device, kv_cache.dtype)
    block_d = triton.next_power_of_2(head_dim)
    mixed = query_start_loc is not None
    if num_splits > 1:
        part_out = torch.empty(
            num_seqs * num_heads * num_splits * block_d, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(num_seqs * num_heads * num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    qsl = query_start_loc if mixed else seq_lens  # any int32 pointer; unused when not mixed
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        out,
        part_out,
        part_lse,
        kv_cache,
        block_tables,
        seq_lens,
        qsl,
        *shared.positional,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n,
        NUM_SPLITS=num_splits,
        MIXED=mixed,
        **shared.constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.options(q),
    )
    if num_splits > 1:
        heads, parts = _reduce_outputs(out, int8_outputs, mixed, head_dim)
        _decode_reduce_kernel[(num_seqs, num_heads // heads)](
            out, part_out, part_lse, qsl, *parts.args, out.shape[0], out.stride(0), out.stride(1), head_dim,
            shared.v_scale, BLOCK_D=block_d, NUM_SPLITS=num_splits, MIXED=mixed, HEADS=heads, **parts.constexprs,
            num_warps=4, **pdl.options(q),
        )  # fmt: skip


def _reduce_outputs(
    out: torch.Tensor, wanted: Int8Outputs | None, mixed: bool, head_dim: int
) -> tuple[int, x_int8_outputs.Prepared]:
    """Heads per program of the merge kernel and the int8 parts it writes of `out` (attached to
    it): only in a decode-only batch (every row's output comes from the merge), with out
    contiguous and a power-of-two head_dim; a program covers enough heads for a whole tile group
    or block of the layouts read at this row count (two 128-wide heads for GGUF's 256-value
    blocks, one for any batch-1 GEMV)."""
    num_tokens, num_heads = out.shape[:2]
    if wanted is not None and not mixed and out.is_contiguous() and not head_dim & (head_dim - 1):
        heads = max(1, wanted.at(num_tokens, num_heads * head_dim).columns_per_write() // head_dim)
        if num_heads % heads == 0:
            parts = x_int8_outputs.prepare(out, wanted, columns_per_program=heads * head_dim)
            if parts.writes:
                return heads, parts
    return 1, x_int8_outputs.prepare(out, None)


def read_scales(
    dot: int, kv_cache: torch.Tensor, scale: float, k_scale: float, v_scale: float
) -> tuple[float, float, float]:
    """(q's pre-scale, the scores' scale after it, v's scale) for reading the cache; the fp8
    scales apply to fp8 caches only (as in write_kv_cache), so fp16/bf16 caches ignore them.
    DOT_FP16 multiplies q by the softmax scale before rounding it to fp16 (headroom below fp16's
    65504 for bf16 queries: sqrt(D) with the usual scale), and the scores come out the same."""
    if kv_cache.dtype not in FP8_KV_DTYPES:
        return 1.0, float(scale), 1.0
    if dot == DOT_FP16:
        return float(scale), float(k_scale), float(v_scale)
    return 1.0, float(scale * k_scale), float(v_scale)


def dot_mode(q: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """How the kernels feed tl.dot (DOT_*):
    - an fp8 cache under bf16 queries: fp16. e4m3 / e5m2 widen to fp16 in one conversion per
      pair of values, to bf16 only through fp16 and a second, per-value conversion (F2F, 16 a
      cycle per multiprocessor on Hopper: fewer values than the cache streams at full
      bandwidth), which ate what the halved bytes saved. fp16 holds every e4m3 value; q times
      the softmax scale and the softmax weights round to fp16's 11 bits, not bf16's 8;
    - bf16 off the GPU (TRITON_INTERPRET=1): fp32, since the interpreter keeps bf16 as raw uint16
      bits and its dot multiplies those integers (bf16 -> fp32 is exact);
    - otherwise q's dtype."""
    if kv_cache.dtype in FP8_KV_DTYPES and q.dtype == torch.bfloat16:
        return DOT_FP16
    if q.device.type != "cuda" and q.dtype == torch.bfloat16:
        return DOT_FP32
    return DOT_AS_IS


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclass(frozen=True)
class LaunchArgs:
    """What the decode and prefill kernels take alike: `positional` follows their sequence
    pointers (q's, out's, the cache's and the block table's strides, head_dim, the three scales,
    the soft cap, the window), `constexprs` their flags; `v_scale` also serves the merge kernel."""

    positional: tuple[int | float, ...]
    constexprs: dict[str, int | bool]
    v_scale: float


def launch_args(
    q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, scale: float,
    k_scale: float, v_scale: float, soft_cap: float | None, sliding_window: int | None,
) -> LaunchArgs:  # fmt: skip
    """The shared launch arguments of one attention call (q already last-dim contiguous)."""
    dot = dot_mode(q, kv_cache)
    q_prescale, qk_scale, v_read_scale = read_scales(dot, kv_cache, scale, k_scale, v_scale)
    positional = (
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_cache.stride()[:4], block_tables.stride(0),
        q.shape[2], q_prescale, qk_scale, v_read_scale, float(soft_cap or 0.0), int(sliding_window or 0),
    )  # fmt: skip
    constexprs = dict(BLOCK_SIZE=kv_cache.shape[2], USE_WINDOW=sliding_window is not None,
                      USE_SOFTCAP=soft_cap is not None, DOT=dot)  # fmt: skip
    return LaunchArgs(positional, constexprs, v_read_scale)


def check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim, got {tuple(out.shape)}")
