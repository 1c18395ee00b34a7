"""Triton kernel that stores this step's K/V rows in the paged cache by slot mapping.

Data flow: attention layer -> TritonAttentionBackend (triton_backend.py) -> `write_kv_cache_triton`
here, before the attention kernels of triton_attention.py read the cache. One program per token
writes its [Hkv, D] tile at its slot (a negative slot marks a padding row: not stored); an fp8
cache stores x / scale, saturated and rounded to nearest even. The torch reference is
`write_kv_cache` in backend.py; tests compare the two byte for byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paphos.attention.backend import FP8_KV_DTYPES


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
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    k_scale,
    v_scale,
    fp8_max,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        # A negative slot marks a padding row that must not be stored anywhere.
        return
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
    k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    if IS_FP8:
        k = _round_to_fp8_grid(k.to(tl.float32) / k_scale, fp8_max, FP8_MANT, FP8_MIN_EXP)
        v = _round_to_fp8_grid(v.to(tl.float32) / v_scale, fp8_max, FP8_MANT, FP8_MIN_EXP)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


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
    is_fp8 = kv_cache.dtype in FP8_KV_DTYPES
    fp8_max = float(torch.finfo(kv_cache.dtype).max) if is_fp8 else 0.0
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        float(k_scale),
        float(v_scale),
        fp8_max,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        IS_FP8=is_fp8,
        FP8_MANT=3 if kv_cache.dtype == torch.float8_e4m3fn else 2,
        FP8_MIN_EXP=-6 if kv_cache.dtype == torch.float8_e4m3fn else -14,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )
