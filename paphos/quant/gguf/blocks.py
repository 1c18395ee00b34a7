"""Byte-level helpers of the GGUF dequantizers (dequant.py, dequant_iq.py): fields of raw blocks
(uint8 [n_blocks, type_size]) as torch integers and floats, on the blocks' device.

Arithmetic is int32 (int64 where bit 31 of a 32-bit word matters): torch has few uint16/uint32
operations."""

from __future__ import annotations

from functools import cache

import torch


def f16_at(b: torch.Tensor, at: int) -> torch.Tensor:
    """fp16 at byte offset `at` of each block -> float32 [n, 1]."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 words of `b` [n, 2k] -> int32 [n, k]."""
    w = b.to(torch.int32).reshape(b.shape[0], -1, 2)
    return w[..., 0] | (w[..., 1] << 8)


def u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 words of `b` [n, 4k] -> int64 [n, k]."""
    w = b.to(torch.int64).reshape(b.shape[0], -1, 4)
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


@cache
def const(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table, made once per device (no host-to-device copy per call, which CUDA
    graph capture would reject)."""
    return torch.tensor(values, dtype=dtype, device=device)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., k] -> int32 [..., 2k]: the k low nibbles, then the k high nibbles."""
    q = qs.to(torch.int32)
    return torch.cat([q & 0xF, q >> 4], dim=-1)


def bits(b: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The `count` fields of `width` bits at shifts 0, width, 2 * width, ... of each element:
    [...] -> [..., count], int32 (int64 for int64 input, whose bit 31 may be set)."""
    dtype = torch.int64 if b.dtype == torch.int64 else torch.int32
    shifts = torch.arange(0, width * count, width, device=b.device, dtype=dtype)
    return (b.to(dtype).unsqueeze(-1) >> shifts) & ((1 << width) - 1)


def sign_values(sign_bits: torch.Tensor) -> torch.Tensor:
    """0/1 sign bits -> +1.0/-1.0."""
    return 1.0 - 2.0 * sign_bits.float()
