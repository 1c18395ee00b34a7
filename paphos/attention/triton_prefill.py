"""Triton kernel for prefill chunks over the paged KV cache, and its launcher.

Data flow: TritonAttentionBackend (triton_backend.py) -> `paged_attention_prefill`: chunks with
query_len > 1 (possibly after a cached prefix), flash-attention style: a program owns a tile of
BLOCK_Q query positions x the G query heads of one kv head (GQA packing: the G heads share every
K/V load) and sweeps the key blocks with `tl.dot` and an online softmax. Programs find their
sequence by a binary search over the device `query_start_loc`, so the grid depends only on the
token and sequence counts. The pieces it shares with the decode kernels (scores, the K/V gather,
the softmax step, the dot dtype, the cache's scales) are in triton_attention.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paphos.attention.triton_attention import (
    check_out,
    dot_q,
    last_dim_contiguous,
    launch_args,
    load_kv_tile,
    online_softmax_step,
    scores,
)


# The sequence count changes every step: specialising on its value (== 1, % 16) would recompile
# the kernel mid-serving, a stall of a second or more, the first time a step has an unseen kind.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
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
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Sequence i owns tile slots [f(i), f(i+1)) with f(i) = query_start_loc[i] // BLOCK_Q + i,
    # at least ceil(query_len_i / BLOCK_Q) of them; the grid is f(num_seqs) = T // BLOCK_Q + B.
    # Find the last i with f(i) <= pid (f is non-decreasing) by bisection on the device array.
    lo = pid * 0  # int32 tensors from the start: loop-carried values need one type
    hi = pid * 0 + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= q_len:
        return
    if SKIP_DECODE:
        if q_len == 1:
            return  # handled by the split-KV decode kernel
    ctx = tl.load(seq_lens_ptr + seq)
    first_pos = ctx - q_len + tile * BLOCK_Q  # position of the tile's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = tile * BLOCK_Q + offs_m // BLOCK_G  # query row within the chunk
    g = offs_m % BLOCK_G
    row_valid = (q_idx < q_len) & (g < GROUP)
    d_valid = offs_d < head_dim
    q_pos = ctx - q_len + q_idx
    heads = kv_head * GROUP + g
    tokens = (q_start + q_idx).to(tl.int64)
    io_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    q = dot_q(q, q_prescale, DOT)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Keys the tile can see: up to its last query (causal), from its first query's window start.
    kv_end = tl.minimum(first_pos + BLOCK_Q, ctx)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos - sliding_window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N

    # Key blocks in [full_lo, full_hi) are visible to every row of the tile (below its first
    # query, inside its last query's window) and skip the mask; the rest are masked.
    full_hi = kv_lo + ((first_pos + 1 - kv_lo) // BLOCK_N) * BLOCK_N
    full_lo = kv_lo
    if USE_WINDOW:
        full_lo = tl.maximum(kv_lo, tl.cdiv(kv_end - sliding_window, BLOCK_N) * BLOCK_N)
    full_hi = tl.maximum(full_hi, full_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _prefill_blocks(
        q, q_pos, m_i, l_i, acc, kv_lo, tl.minimum(full_lo, kv_end),
        cache_ptr, bt_row, kv_head, offs_d, d_valid, stride_cb, stride_cs, stride_ch, stride_ckv, kv_end,
        qk_scale, soft_cap, sliding_window, BLOCK_N, BLOCK_SIZE, USE_WINDOW, USE_SOFTCAP, True,
    )  # fmt: skip
    m_i, l_i, acc = _prefill_blocks(
        q, q_pos, m_i, l_i, acc, full_lo, full_hi,
        cache_ptr, bt_row, kv_head, offs_d, d_valid, stride_cb, stride_cs, stride_ch, stride_ckv, kv_end,
        qk_scale, soft_cap, sliding_window, BLOCK_N, BLOCK_SIZE, USE_WINDOW, USE_SOFTCAP, False,
    )  # fmt: skip
    m_i, l_i, acc = _prefill_blocks(
        q, q_pos, m_i, l_i, acc, full_hi, kv_end,
        cache_ptr, bt_row, kv_head, offs_d, d_valid, stride_cb, stride_cs, stride_ch, stride_ckv, kv_end,
        qk_scale, soft_cap, sliding_window, BLOCK_N, BLOCK_SIZE, USE_WINDOW, USE_SOFTCAP, True,
    )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None] * v_scale
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


@triton.jit
def _prefill_blocks(
    q, q_pos, m_i, l_i, acc, lo, hi,
    cache_ptr, bt_row, kv_head, offs_d, d_valid, stride_cb, stride_cs, stride_ch, stride_ckv, kv_end,
    qk_scale, soft_cap, sliding_window,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """Fold the key blocks starting in [lo, hi) into one tile's softmax state; MASKED applies the
    causal and window masks (blocks on the diagonal or the window edge)."""
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_valid = tok < kv_end
        k_t, v = load_kv_tile(
            cache_ptr, bt_row, tok, tok_valid, kv_head, offs_d, d_valid,
            stride_cb, stride_cs, stride_ch, stride_ckv, BLOCK_SIZE,
        )  # fmt: skip
        s = scores(q, k_t.to(q.dtype), qk_scale, soft_cap, USE_SOFTCAP)
        if MASKED:
            visible = tok[None, :] <= q_pos[:, None]
            if USE_WINDOW:
                visible = visible & (tok[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v.to(q.dtype))
    return m_i, l_i, acc


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # packed rows per tile: BLOCK_Q query positions x BLOCK_G heads
    block_n: int
    num_warps: int
    num_stages: int


def default_prefill_config(
    head_dim: int, device: torch.device, num_tiles_at_128: int = 1 << 30
) -> PrefillConfig:
    """Tile sizes; `num_tiles_at_128` is the grid the batch would have with 128-row tiles."""
    if device.type != "cuda":
        # The interpreter: small tiles so tests cross tile and page boundaries on tiny inputs.
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    # Measured on an H200 (--sweep, triton 3.6, Llama-3-8B heads): 128x32 tiles run a 4 x 4096
    # prefill at ~330 TFLOP/s; when they would not fill two waves of the SMs (short prompts,
    # a 512-token chunk), 64x64 tiles finish sooner.
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if num_tiles_at_128 >= 2 * _num_sms(device):
        return PrefillConfig(block_m=128, block_n=32, num_warps=4, num_stages=2)
    return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    skip_decode_rows: bool = True,
    config: PrefillConfig | None = None,
) -> None:
    """Causal attention of every chunk of the flat batch over its paged context, into `out`.

    Sequence i's query rows are query_start_loc[i]:query_start_loc[i+1], sitting at the last
    positions of its seq_lens[i]-token context. With `skip_decode_rows`, sequences with
    query_len 1 are left to `paged_attention_decode`. The grid is sized from q.shape[0] and the
    number of sequences only (no host lists, no sync).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = kv_cache.shape[3]
    if num_seqs == 0 or num_tokens == 0:
        return
    q = last_dim_contiguous(q)
    check_out(out, q)
    shared = launch_args(q, out, kv_cache, block_tables, scale, k_scale, v_scale, soft_cap, sliding_window)
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    cfg = config or default_prefill_config(
        head_dim, q.device, (num_tokens // max(1, 128 // block_g) + num_seqs) * num_kv_heads
    )
    block_q = max(1, cfg.block_m // block_g)
    if block_q * block_g < 16:
        block_q = 16 // block_g  # tl.dot needs at least 16 rows
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        out,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        *shared.positional,
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=cfg.block_n,
        SKIP_DECODE=skip_decode_rows,
        **shared.constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
