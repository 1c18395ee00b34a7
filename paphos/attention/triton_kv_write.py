"""Triton kernels that store this step's K/V rows in the paged cache by slot mapping.

Data flow: attention layer -> TritonAttentionBackend (triton_backend.py) -> here, before the
attention kernels (triton_attention.py, triton_prefill.py) read the cache. One program per token
writes its [Hkv, D] tile at its slot (a negative slot marks a padding row: not stored); an fp8
cache stores x / scale, saturated and rounded to nearest even. `rope_and_write_kv_cache_triton`
also applies the rotary embedding to q and k first (paphos/layers/fused.py's rotation), one launch
per layer instead of two. The torch references are `write_kv_cache` in backend.py and `RotaryEmbedding`;
tests compare them byte for byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paphos.attention.backend import FP8_KV_DTYPES
from paphos.layers import pdl
from paphos.layers.fused import _rope_rotate_heads


@triton.jit
def _round_to_fp8_grid(x, fp8_max, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 x saturated to +-fp8_max and rounded (to nearest, ties to even) onto the grid of an
    fp8 format with MANT mantissa bits and smallest normal exponent MIN_EXP, still as fp32.

    The final cast to fp8 is then exact. Rounding here rather than in the cast keeps results
    identical on the GPU and under the Triton interpreter, whose fp8 downcast drops the carry
    of a rounded-up mantissa (e.g. 7.99 -> 4.0 in e4m3).
    """
    x = tl.minimum(tl.maximum(x, -fp8_max), fp8_max)
    ax = tl.abs(x)
    exp = (ax.to(tl.int32, bitcast=True) >> 23) - 127
    # Spacing of the fp8 grid around ax (subnormals share the smallest normal's spacing).
    quantum = ((tl.maximum(exp, MIN_EXP) - MANT + 127) << 23).to(tl.float32, bitcast=True)
    y = ax / quantum  # exact: quantum is a power of two; y < 2 ** (MANT + 1)
    n = y.to(tl.int32)
    frac = y - n.to(tl.float32)
    n += ((frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))).to(tl.int32)
    r = n.to(tl.float32) * quantum
    return tl.where(x < 0, -r, r)


@triton.jit
def _store_token_kv(
    k_ptr, v_ptr, cache_ptr, token, slot, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch, num_kv_heads, head_dim, k_scale, v_scale, fp8_max,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
    FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
):  # fmt: skip
    """Stores one token's K/V [Hkv, D] tiles at `slot` (>= 0) of the paged cache."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < num_kv_heads) & (offs_d < head_dim)
    dst = (
        cache_ptr
        + (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + offs_h * stride_ch
        + offs_d
    )
    k = tl.load(k_ptr + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    if IS_FP8:
        k = _round_to_fp8_grid(k.to(tl.float32) / k_scale, fp8_max, FP8_MANT, FP8_MIN_EXP)
        v = _round_to_fp8_grid(v.to(tl.float32) / v_scale, fp8_max, FP8_MANT, FP8_MIN_EXP)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch, num_kv_heads, head_dim, k_scale, v_scale, fp8_max,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
    FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        # A negative slot marks a padding row that must not be stored anywhere.
        return
    _store_token_kv(
        k_ptr, v_ptr, cache_ptr, token, slot, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cb, stride_ckv, stride_cs, stride_ch, num_kv_heads, head_dim, k_scale, v_scale, fp8_max,
        BLOCK_SIZE, BLOCK_H, BLOCK_D, IS_FP8, FP8_MANT, FP8_MIN_EXP,
    )  # fmt: skip


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, slot_ptr, pos_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch, cos_sin_stride, num_q_heads, num_kv_heads, head_dim,
    k_scale, v_scale, fp8_max,
    HALF: tl.constexpr, Q_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
    FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.release(PDL)
    pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + dims)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + dims)
    _rope_rotate_heads(q_ptr, stride_qt, stride_qh, token, num_q_heads, cos, sin, HALF, Q_HEADS)
    _rope_rotate_heads(k_ptr, stride_kt, stride_kh, token, num_kv_heads, cos, sin, HALF, BLOCK_H)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        # The rotated k was stored by other threads of this program: make it visible first.
        tl.debug_barrier()
        _store_token_kv(
            k_ptr, v_ptr, cache_ptr, token, slot, stride_kt, stride_kh, stride_vt, stride_vh,
            stride_cb, stride_ckv, stride_cs, stride_ch, num_kv_heads, head_dim, k_scale, v_scale, fp8_max,
            BLOCK_SIZE, BLOCK_H, BLOCK_D, IS_FP8, FP8_MANT, FP8_MIN_EXP,
        )  # fmt: skip


def _cache_args(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[list, dict]:
    """The cache strides, scales and compile-time flags both kernels take."""
    is_fp8 = kv_cache.dtype in FP8_KV_DTYPES
    fp8_max = float(torch.finfo(kv_cache.dtype).max) if is_fp8 else 0.0
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    args = [*kv_cache.stride()[:4]]
    consts = dict(
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        IS_FP8=is_fp8,
        FP8_MANT=3 if kv_cache.dtype == torch.float8_e4m3fn else 2,
        FP8_MIN_EXP=-6 if kv_cache.dtype == torch.float8_e4m3fn else -14,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )
    return args + [num_kv_heads, head_dim, float(k_scale), float(v_scale), fp8_max], consts


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store K/V rows [T, Hkv, D] at `slot_mapping` [T] (slot < 0: skipped) in
    kv_cache [num_blocks, 2, block_size, Hkv, D]; fp8 caches store x / scale, saturated."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    cache_args, consts = _cache_args(kv_cache, k_scale, v_scale)
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache_args, **consts
    )


def rope_and_write_kv_cache_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """One launch for what `rope_` (paphos.layers.fused) then `write_kv_cache_triton` do: q and k
    [T, H, D] are rotated in place at `positions` (same arithmetic, bit for bit), and the rotated
    k with v is stored at `slot_mapping`. q, k and v may be strided views of one qkv tensor."""
    num_tokens, num_q_heads, _ = q.shape
    if slot_mapping.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise ValueError(f"{num_tokens} tokens, {slot_mapping.shape[0]} slots, {positions.shape[0]} positions")
    half = rotary_dim // 2
    if half & (half - 1) or half == 0:
        raise ValueError(f"fused rope needs a power-of-two rotary_dim / 2, got {half}")
    if num_tokens == 0:
        return
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("q, k and v must be contiguous in their last dimension (rotated in place)")
    cache_args, consts = _cache_args(kv_cache, k_scale, v_scale)
    _rope_write_kv_kernel[(num_tokens,)](
        q, k, v, kv_cache, slot_mapping, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache_args[:4], cos_sin_cache.stride(0), num_q_heads, *cache_args[4:],
        HALF=half, Q_HEADS=triton.next_power_of_2(num_q_heads), **consts, **pdl.options(q),
    )  # fmt: skip
